"""The Transformer Engine reduce-helper wrappers (``patches/tp_reduce/_te_reductions.py``) against the
rank-order FP32 oracle, on 4 bare gloo ranks (no TE, no megatron needed).

The helpers are test_tp_reduce_transformer_engine_wiring's stand-ins with the contracts of TE's
``distributed.py`` (``allreduce``, ``reduce_scatter_along_first_dim``), wrapped by the patch's own
wrapper functions as the engine wraps TE's. Partials depend on position, TP rank and DP rank;
sizes are not divisible by TP; the layouts are TP=4 (order-sensitive FP32 sums: fp32-accumulate
adds in rank order) and TP=2 x DP=2 (groups {0,1} and {2,3}: a reduction over the wrong group is
caught).
"""

import pytest
import torch

from megapatch.testing import run_ranks
from reduction_oracles import partial, rank_order_sum

MODES = ("fp32", "fp32-accumulate")


def _cases(group, tp, tp_rank, dp_rank, kind):
    from test_tp_reduce_transformer_engine_wiring import _standin_helpers

    helpers = _standin_helpers()
    ar, rs = helpers["allreduce"], helpers["reduce_scatter_along_first_dim"]
    part = lambda shape, r=tp_rank: partial(kind, shape, r, dp_rank, tp)  # noqa: E731
    full = lambda shape: rank_order_sum([part(shape, r) for r in range(tp)])  # noqa: E731
    found = {}
    for shape in ((5, 3), (4, 4)):
        x = part(shape)
        y, handle = ar(x, group)
        found[f"allreduce {shape}"] = (x, full(shape), y is x and handle is None)
        x = part(shape)
        y, handle = ar(x, group, async_op=True)
        handle.wait()
        found[f"allreduce async {shape}"] = (x, full(shape), y is x)
    shape = (2 * tp, 3)
    want = full(shape)[2 * tp_rank:2 * tp_rank + 2]
    y, handle = rs(part(shape), group)
    found["reduce_scatter"] = (y, want, handle is None and y.dtype == torch.bfloat16)
    y, handle = rs(part(shape), group, async_op=True)
    handle.wait()
    found["reduce_scatter async"] = (y, want, True)
    buf = torch.empty(2, 3, dtype=torch.bfloat16)
    y, _ = rs(part(shape), group, False, buf)
    found["reduce_scatter output="] = (buf, want, y is buf)
    x = 2 ** 40 + torch.arange(15) * 3 + tp_rank * 7 + dp_rank * 11
    total = sum(2 ** 40 + torch.arange(15) * 3 + r * 7 + dp_rank * 11 for r in range(tp))
    y, _ = ar(x, group)
    found["int64 allreduce"] = (x, total, y.dtype == torch.int64)
    return {case: (got.double(), want.double(), contract) for case, (got, want, contract) in found.items()}


def _rank(ctx):
    import torch.distributed as dist

    import megapatch

    rank = ctx.rank
    layouts = {"tp4": (dist.new_group([0, 1, 2, 3]), 4, rank, 0)}
    tp2 = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    layouts["tp2xdp2"] = (tp2[rank // 2], 2, rank % 2, rank // 2)
    found = {}
    for mode in ("native",) + MODES:
        megapatch.enable(tp_reduce_dtype=mode)
        dist.barrier()
        for layout, (group, tp, tp_rank, dp_rank) in layouts.items():
            for kind in ("exact", "order") if tp == 4 else ("exact",):
                found[(mode, layout, kind)] = _cases(group, tp, tp_rank, dp_rank, kind)
    megapatch.disable()
    return found


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, world_size=4, init_megatron=False, timeout=300)


@pytest.mark.quick("tp_reduce.transformer_engine")
@pytest.mark.parametrize("mode", MODES)
def test_te_helpers_equal_the_rank_order_fp32_oracle(results, mode):
    checked = 0
    for rank, found in enumerate(results):
        for (m, layout, kind), cases in found.items():
            if m != mode or (mode == "fp32" and kind == "order"):  # fp32: gloo's FP32 order is its own
                continue
            for case, (got, want, contract) in cases.items():
                assert contract, (mode, rank, layout, kind, case)
                assert got.shape == want.shape and torch.equal(got, want), (
                    mode, rank, layout, kind, case, got.flatten().tolist(), want.flatten().tolist())
                checked += 1
    assert checked == 4 * 8 * (3 if mode == "fp32-accumulate" else 2), checked


def test_native_bf16_sums_miss_the_oracle(results):
    """The oracle can fail: four BF16 partials summed natively in BF16 lose low bits."""
    for kind in ("exact", "order"):
        missed = {case for found in results for case, (got, want, _c) in found[("native", "tp4", kind)].items()
                  if not torch.equal(got, want)}
        assert len(missed) >= 5, (kind, missed)
