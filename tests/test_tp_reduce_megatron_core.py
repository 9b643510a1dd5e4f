"""FP32 tensor-parallel reductions in megatron-core's local layers, on real megatron-core over gloo.

Every rank holds different inputs; numerics are compared against independent oracles (the FP32
sum of the group's BF16 partials in rank order rounded once, built locally from the partials;
exact integer sums; all-gather + plain FP32 matmul; an FP32 TP=1 model with the same weights).
Reductions run at TP=4 and at TP=2 x DP=2 (world 4), on sizes not divisible by TP.
"""


import pytest
import torch

from conftest import StandInGroup, check_refused_where_upstream_cannot_take, skip_unless_upstream_takes
from megapatch.testing import run_ranks
from reduction_oracles import partial as _partial, rank_order_sum as _oracle

MODES = ("fp32", "fp32-accumulate")


def _linear_config(sequence_parallel=False, tp=None):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=8,
                             tensor_model_parallel_size=tp or torch.distributed.get_world_size(),
                             sequence_parallel=sequence_parallel, params_dtype=torch.bfloat16,
                             bf16=True, use_cpu_initialization=True, perform_initialization=False,
                             gradient_accumulation_fusion=False)


GRAD_SCALE = (1.0, 2.0, 4.0)  # powers of two: g * w stays a BF16 value


def _column_dgrad(ctx, row_partial, sequence_parallel=False, frozen=False):
    """dgrad of a column-parallel layer (one output column per rank, weight row ``row_partial``):
    this rank's partial dgrad is exactly ``g[row] * row_partial``. Returns (x.grad, partial)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    tp, k = ctx.tp_size, row_partial.numel()
    layer = ColumnParallelLinear(k, tp, config=_linear_config(sequence_parallel, tp), init_method=None,
                                 bias=False, gather_output=False)
    with torch.no_grad():
        layer.weight.copy_(row_partial.view(1, k))
    layer.weight.requires_grad_(not frozen)
    rows = 2 if sequence_parallel else 2 * tp  # SP: this rank's sequence shard
    x = torch.zeros((rows, 1, k), dtype=torch.bfloat16, requires_grad=True)
    out, _ = layer(x)
    g = torch.tensor([GRAD_SCALE[r % 3] for r in range(2 * tp)], dtype=torch.bfloat16).view(-1, 1, 1)
    out.backward(g.expand(out.shape).contiguous())
    return x.grad


def _dgrad_partial(row_partial, tp):
    g = torch.tensor([GRAD_SCALE[r % 3] for r in range(2 * tp)], dtype=torch.float32).view(-1, 1, 1)
    return (g * row_partial.float().view(1, 1, -1)).to(torch.bfloat16)


def _paths(ctx, kind):
    """Every megatron-core TP reduction path on this rank's ``kind`` partials, each with its oracle
    (built from the partials of the TP group's ranks, in rank order)."""
    from megatron.core.tensor_parallel import mappings

    tp, t, d, group = ctx.tp_size, ctx.tp_rank, ctx.dp_rank, ctx.tp_group
    part = lambda shape, r=t: _partial(kind, shape, r, d, tp)  # noqa: E731
    full = lambda shape: _oracle([part(shape, r) for r in range(tp)])  # noqa: E731
    shard = lambda shape: full(shape)[2 * t:2 * t + 2]  # noqa: E731  (dim-0 shard of 2 rows)
    found = {}
    for shape in ((5, 3), (4, 4)):  # 15 elements: padded to a multiple of TP; 16: in place
        found[f"forward all-reduce {shape}"] = (
            mappings.reduce_from_tensor_model_parallel_region(part(shape), group=group), full(shape))
        x = torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True)
        mappings.copy_to_tensor_model_parallel_region(x, group=group).backward(part(shape))
        found[f"backward all-reduce (copy_to) {shape}"] = (x.grad, full(shape))
    shape = (2 * tp, 3)
    found["SP reduce-scatter"] = (
        mappings.reduce_scatter_to_sequence_parallel_region(part(shape), group=group), shard(shape))
    x = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
    mappings.gather_from_sequence_parallel_region(x, group=group).backward(part(shape))
    found["SP gather backward reduce-scatter"] = (x.grad, shard(shape))
    row = lambda r=t: part((7,), r)  # noqa: E731  (7 inputs: not divisible by TP)
    dgrad = _oracle([_dgrad_partial(row(r), tp) for r in range(tp)])
    found["column dgrad async all-reduce"] = (_column_dgrad(ctx, row()), dgrad)
    found["column dgrad async reduce-scatter (SP)"] = (
        _column_dgrad(ctx, row(), sequence_parallel=True), dgrad[2 * t:2 * t + 2])
    found["frozen-weight dgrad all-reduce"] = (_column_dgrad(ctx, row(), frozen=True), dgrad)
    return {path: (got.detach().float(), want.float()) for path, (got, want) in found.items()}


def _int64_paths(ctx):
    """Integer tensors above 2^24 (not representable in FP32) go through upstream, exactly."""
    from megatron.core.tensor_parallel import mappings

    tp, group = ctx.tp_size, ctx.tp_group
    part = lambda r: (2 ** 40 + torch.arange(4 * tp) * 3 + r * 7 + ctx.dp_rank * 11)  # noqa: E731
    total = sum(part(r) for r in range(tp))
    return {
        "int64 all-reduce": (mappings.reduce_from_tensor_model_parallel_region(part(ctx.tp_rank), group=group),
                             total),
        "int64 SP reduce-scatter": (mappings.reduce_scatter_to_sequence_parallel_region(
            part(ctx.tp_rank).view(2 * tp, 2), group=group),
            total.view(2 * tp, 2)[2 * ctx.tp_rank:2 * ctx.tp_rank + 2]),
    }


def _every_reduction_path(ctx):
    """World 4: first TP=4 (order-sensitive partials), then TP=2 x DP=2 (each TP group sums
    different partials: a reduction over the wrong group is caught)."""
    import megapatch
    from megapatch.testing import reinit_model_parallel

    found = {}
    for layout in ("tp4", "tp2xdp2"):
        if layout == "tp2xdp2":
            ctx = reinit_model_parallel(ctx, tp=2)
            assert ctx.dp_size == 2
        for mode in ("native",) + MODES:
            megapatch.enable(tp_reduce_dtype=mode)
            kinds = ("exact", "order") if layout == "tp4" and mode != "fp32" else ("exact",)
            for kind in kinds:
                found[(layout, mode, kind)] = _paths(ctx, kind)
            found[(layout, mode, "int64")] = {p: (a.tolist(), b.tolist())
                                              for p, (a, b) in _int64_paths(ctx).items()}
    megapatch.disable()
    return found


def _needs_fp32_reductions():
    skip_unless_upstream_takes("tp_reduce.megatron_core", "FP32 TP reductions")


def test_fp32_reductions_on_a_megatron_core_that_cannot_take_them_are_refused():
    """The version matrix's oldest cell (megatron-core 0.12.3: ``_reduce(input_)`` has no group)."""
    check_refused_where_upstream_cannot_take("tp_reduce.megatron_core", "FP32 TP reductions",
                                             tp_reduce_dtype="fp32")


@pytest.fixture(scope="module")
def reduction_paths():
    _needs_fp32_reductions()
    return run_ranks(_every_reduction_path, world_size=4, tp=4, timeout=300)


def _checked(reduction_paths, mode):
    for rank, found in enumerate(reduction_paths):
        for (layout, m, kind), paths in found.items():
            if m == mode:
                yield rank, layout, kind, paths


@pytest.mark.quick("tp_reduce.megatron_core")
@pytest.mark.parametrize("mode", MODES)
def test_every_tp_reduction_equals_the_rank_order_fp32_oracle(reduction_paths, mode):
    """Position-, rank- and DP-dependent partials, sizes not divisible by TP, TP=4 and TP=2xDP=2:
    each result is the FP32 sum of the group's BF16 partials rounded once (for fp32-accumulate
    also where the FP32 sum depends on the order: it adds in rank order); integers stay exact."""
    seen = set()
    for rank, layout, kind, paths in _checked(reduction_paths, mode):
        for path, (got, want) in paths.items():
            seen.add((layout, kind, path))
            if kind == "int64":
                assert got == want, (mode, rank, layout, path, got, want)
            else:
                assert got.shape == want.shape and torch.equal(got, want), (
                    mode, rank, layout, kind, path, got.flatten().tolist(), want.flatten().tolist())
    assert len(seen) == (31 if mode == "fp32-accumulate" else 22), sorted(seen)


def test_native_gloo_bf16_sums_miss_the_oracle(reduction_paths):
    """The oracle can fail: natively gloo sums four BF16 partials in BF16 and loses low bits.
    (Two partials rounded once each way give the same BF16 value, so TP=2 cannot show it.)"""
    wrong = {(layout, kind, path)
             for _rank, layout, kind, paths in _checked(reduction_paths, "native") if kind != "int64"
             for path, (got, want) in paths.items() if not torch.equal(got, want)}
    for layout, kind in (("tp4", "exact"), ("tp4", "order")):
        missed = {path for (l, k, path) in wrong if (l, k) == (layout, kind)}
        assert len(missed) >= 5, (layout, kind, missed)


def _integer_tensor(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).to(torch.bfloat16)


def _row_parallel_vs_oracle(ctx, mode, k_total=512, n_out=16, tokens=6):
    import megapatch
    from megatron.core.tensor_parallel import RowParallelLinear
    from megapatch.testing import gather_tp_logits

    if mode != "native":
        megapatch.enable(tp_reduce_dtype=mode)
    tp = ctx.tp_size
    layer = RowParallelLinear(k_total, n_out, config=_linear_config(), init_method=None, bias=True,
                              input_is_parallel=True, skip_bias_add=False)
    with torch.no_grad():
        layer.weight.copy_(_integer_tensor((n_out, k_total // tp), seed=100 + ctx.rank))
        layer.bias.copy_(_integer_tensor((n_out,), seed=7))
    x = _integer_tensor((tokens, 1, k_total // tp), seed=200 + ctx.rank).requires_grad_()
    out, _ = layer(x)
    grad = _integer_tensor(out.shape, seed=300)
    out.backward(grad)
    # oracle: all-gather the shards, plain FP32 matmul (integers: every partial sum is exact)
    full_x = gather_tp_logits(x.detach(), ctx).float()
    full_w = gather_tp_logits(layer.weight.detach(), ctx).float()
    oracle = (full_x @ full_w.t() + layer.bias.detach().float()).to(torch.bfloat16)
    megapatch.disable()
    return {"out": out.detach().float(), "oracle": oracle.float(), "dtype": str(out.dtype),
            "x_grad": x.grad.float(), "w_grad": layer.weight.grad.float()}


@pytest.mark.quick("linear.fp32_output", "tp_reduce.megatron_core")
@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_hands_its_fp32_accumulator_to_the_reduction(tp):
    _needs_fp32_reductions()
    native = run_ranks(_row_parallel_vs_oracle, world_size=tp, tp=tp, args=("native",))
    fp32 = run_ranks(_row_parallel_vs_oracle, world_size=tp, tp=tp, args=("fp32",))
    for rank in range(tp):
        assert fp32[rank]["dtype"] == "torch.bfloat16"
        # one rounding of the exact sum: bit-identical to the oracle
        assert torch.equal(fp32[rank]["out"], fp32[rank]["oracle"]), rank
        # natively each rank's partial sum is rounded to BF16 first: the oracle catches it
        assert not torch.equal(native[rank]["out"], native[rank]["oracle"]), rank
        # the backward is upstream's: same BF16 gradient in, bit-identical grads out
        assert torch.equal(fp32[rank]["x_grad"], native[rank]["x_grad"])
        assert torch.equal(fp32[rank]["w_grad"], native[rank]["w_grad"])


def _row_parallel_oracle_hooks(model, ctx):
    """After each RowParallelLinear forward, record whether its output equals the FP32 sum, in TP
    rank order and rounded once, of the partials upstream's BF16 GEMM gives on each rank
    (recomputed here with the same ``torch.matmul`` and all-gathered with plain torch)."""
    from megatron.core.tensor_parallel import RowParallelLinear

    found = []

    def check(module, args, output):
        out = output[0]
        assert module.input_is_parallel and (module.skip_bias_add or module.bias is None)
        with torch.no_grad():
            partial = torch.matmul(args[0], module.weight.t()).contiguous()
            parts = [torch.empty_like(partial) for _ in range(ctx.tp_size)]
            torch.distributed.all_gather(parts, partial, group=ctx.tp_group)
            oracle = _oracle(parts)
            if module.sequence_parallel:
                oracle = oracle.chunk(ctx.tp_size, dim=0)[ctx.tp_rank]
        found.append(bool(out.dtype == torch.bfloat16 and torch.equal(out, oracle)))

    for module in model.modules():
        if isinstance(module, RowParallelLinear):
            module.register_forward_hook(check)
    return found


def _tiny_gpt_step(ctx, mode, sequence_parallel, enable_then_disable=False):
    import megapatch
    from megapatch.testing import build_tiny_gpt, gather_tp_logits, make_batch, tiny_gpt_config

    if enable_then_disable:
        megapatch.enable(tp_reduce_dtype="fp32")
        megapatch.disable()
    elif mode != "native":
        megapatch.enable(tp_reduce_dtype=mode)
    config = tiny_gpt_config(tp=ctx.tp_size, sequence_parallel=sequence_parallel)
    model = build_tiny_gpt(config, vocab_size=128, seq_len=16, seed=1234)
    row_oracle = _row_parallel_oracle_hooks(model, ctx)
    batch = make_batch(seed=5, batch=2, seq_len=16, vocab=128)
    logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
    logits.float().sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    result = {"logits": gather_tp_logits(logits, ctx).float(), "grads": grads,
              "active": megapatch.status().active, "row_parallel_equals_oracle": row_oracle}
    megapatch.disable()
    return result


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_disabled_megapatch_is_bit_identical_to_stock(sequence_parallel):
    _needs_fp32_reductions()  # it enables them, then disables
    stock = run_ranks(_tiny_gpt_step, world_size=2, tp=2, args=("native", sequence_parallel))
    toggled = run_ranks(_tiny_gpt_step, world_size=2, tp=2, args=("native", sequence_parallel, True))
    for a, b in zip(stock, toggled):
        assert b["active"] == []
        assert torch.equal(a["logits"], b["logits"])
        assert a["grads"].keys() == b["grads"].keys()
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), name


def _fp32_reference_logits(ctx):
    """The same tiny GPT (same seed, hence the same BF16-rounded weights) run in FP32 at TP=1."""
    from megapatch.testing import build_tiny_gpt, make_batch, reinit_model_parallel, tiny_gpt_config

    reinit_model_parallel(ctx, tp=1)
    bf16_model = build_tiny_gpt(tiny_gpt_config(tp=1), vocab_size=128, seq_len=16, seed=1234)
    fp32_config = tiny_gpt_config(tp=1, params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False)
    model = build_tiny_gpt(fp32_config, vocab_size=128, seq_len=16, seed=1234)
    model.load_state_dict(bf16_model.state_dict())  # the BF16 weights, held in FP32
    batch = make_batch(seed=5, batch=2, seq_len=16, vocab=128)
    with torch.no_grad():
        return model(batch.tokens, batch.position_ids, batch.attention_mask).float()


def _drift(ctx, sequence_parallel):
    steps = {mode: _tiny_gpt_step(ctx, mode, sequence_parallel) for mode in ("native",) + MODES}
    reference = _fp32_reference_logits(ctx)
    return {mode: (step["logits"] - reference).abs().mean().item() for mode, step in steps.items()}, \
        {mode: step["row_parallel_equals_oracle"] for mode, step in steps.items()}


@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (4, False), (4, True)])
def test_fp32_reductions_bring_tiny_gpt_closer_to_fp32_reference(tp, sequence_parallel):
    ranks = run_ranks(_drift, world_size=tp, tp=tp, args=(sequence_parallel,))
    errors = ranks[0][0]
    assert errors["fp32"] < errors["native"], errors
    # fp32-accumulate is checked against an independent oracle, not against native (at TP=2 a
    # sum of two BF16 partials rounds the same either way, so its error may equal native's)
    for _errors, row_oracle in ranks:
        assert len(row_oracle["fp32-accumulate"]) == 4, row_oracle  # 2 layers x (proj, fc2)
        assert all(row_oracle["fp32-accumulate"]), row_oracle
        if tp > 2:  # the oracle can fail: four partials summed in BF16 miss it
            assert not all(row_oracle["native"]), row_oracle


# -- mutation-audit additions (results/mutation.md) ----------------------------------------------

def test_only_the_tp_layers_reduce_scatter_is_wrapped_not_torchs_function_elsewhere():
    """``layers.dist_reduce_scatter_func`` *is* torch's ``reduce_scatter_tensor``: the patch wraps
    that one module global, never the same object held by the data-parallel gradient buffer (whose
    reduce-scatter is not a TP reduction) or by torch itself."""
    import megapatch
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import layers, mappings

    original = torch.distributed.reduce_scatter_tensor
    assert layers.dist_reduce_scatter_func is original  # the precondition that makes aliases matter
    megapatch.enable(tp_reduce_dtype="fp32")
    try:
        assert layers.dist_reduce_scatter_func is not original
        assert layers.dist_reduce_scatter_func.__wrapped__ is original
        assert param_and_grad_buffer.dist_reduce_scatter_func is original
        assert mappings.dist_reduce_scatter_func is original
        assert torch.distributed.reduce_scatter_tensor is original
    finally:
        megapatch.disable()
    assert layers.dist_reduce_scatter_func is original


@pytest.mark.parametrize("mode,backend", [("fp32", "fp32 wire, FP32 row-parallel accumulator ("),
                                          ("fp32-accumulate", "activation-dtype wire, FP32 local accumulation")])
def test_status_names_the_wire_and_accumulator_of_each_mode(mode, backend):
    import megapatch
    from megapatch.core import engine

    megapatch.enable(tp_reduce_dtype=mode)
    try:
        patch = next(p for p in engine.patches() if p.name == "tp_reduce.megatron_core")
        assert patch.backend().startswith(backend), patch.backend()
    finally:
        megapatch.disable()


# -- issue 28 item 8: survivors of the fresh hand-made sample ------------------------------------

SPLITS = {2: [3, 6], 4: [1, 4, 2, 3]}  # uneven token counts per TP rank (MoE), rows not divisible by TP


def _uneven_reduce_scatter(ctx):
    """MoE's uneven reduce-scatters, called as megatron-core calls them: the combine path's
    ``reduce_scatter_to_sequence_parallel_region(..., input_split_sizes=)`` (token_dispatcher.py)
    and the backward of the dispatch path's ``gather_from_sequence_parallel_region(...,
    output_split_sizes=)`` (upstream's backward, called with the ctx its forward would have set:
    gloo cannot all-gather uneven shards). World 4 as TP=2 x DP=2 (world size is not the TP size:
    a sum over the wrong ranks is caught), then TP=4 (four BF16 partials: a BF16 running sum loses
    bits). The oracle: the all-gather of every TP rank's FP32 input, a plain FP32 sum (integers:
    exact in any order), this rank's rows rounded once to the caller's dtype."""
    from types import SimpleNamespace

    import megapatch
    from megatron.core.tensor_parallel import mappings
    from megapatch.testing import reinit_model_parallel

    found = {}
    for layout in ("tp2xdp2", "tp4"):
        if layout == "tp4":
            ctx = reinit_model_parallel(ctx, tp=4)
        tp, t, group, splits = ctx.tp_size, ctx.tp_rank, ctx.tp_group, SPLITS[ctx.tp_size]
        rows = sum(splits)
        for dtype in (torch.bfloat16, torch.float16):
            x = _partial("exact", (rows, 5), t, ctx.dp_rank, tp).to(dtype)  # position/rank-dependent
            gathered = [torch.empty(rows, 5) for _ in range(tp)]
            torch.distributed.all_gather(gathered, x.float(), group=group)
            assert torch.equal(gathered[t], x.float())
            total = torch.stack(gathered).sum(dim=0)
            start = sum(splits[:t])
            want = total[start:start + splits[t]].to(dtype)
            for mode in ("native",) + MODES:
                megapatch.enable(tp_reduce_dtype=mode)
                combine = mappings.reduce_scatter_to_sequence_parallel_region(
                    x, group=group, input_split_sizes=splits)
                dispatch_ctx = SimpleNamespace(tensor_parallel_output_grad=True, group=group,
                                               output_split_sizes=splits, use_global_buffer=False)
                dispatch_grad = mappings._GatherFromSequenceParallelRegion.backward(dispatch_ctx, x)[0]
                found[(layout, str(dtype), mode)] = {
                    path: (str(got.dtype), tuple(got.shape), got.float(), want.float())
                    for path, got in (("combine forward", combine), ("dispatch backward", dispatch_grad))}
    megapatch.disable()
    return found


def test_uneven_split_reduce_scatter_keeps_the_callers_dtype_and_equals_the_gathered_sum():
    """issue 28 survivor: the uneven-split (MoE) reduce-scatter returned FP32 instead of the
    caller's BF16/FP16, and no test passed split sizes."""
    _needs_fp32_reductions()
    ranks = run_ranks(_uneven_reduce_scatter, world_size=4, tp=2, timeout=300)
    checked = 0
    for rank, found in enumerate(ranks):
        for (layout, dtype, mode), paths in found.items():
            for path, (got_dtype, shape, got, want) in paths.items():
                assert shape == want.shape, (rank, layout, path, shape)  # this rank's split
                if mode == "native":
                    continue
                checked += 1
                assert got_dtype == dtype, (rank, layout, dtype, mode, path, got_dtype)
                assert torch.equal(got, want), (rank, layout, dtype, mode, path,
                                                (got - want).abs().max().item())
    assert checked == 4 * 2 * 2 * 2 * 2  # ranks x layouts x dtypes x modes x paths
    # the oracle can fail: natively gloo sums four BF16 partials in BF16
    missed = {(rank, path) for rank, found in enumerate(ranks)
              for path, (_d, _s, got, want) in found[("tp4", "torch.bfloat16", "native")].items()
              if not torch.equal(got, want)}
    assert len(missed) >= 4, missed


def _own_tp_group(ctx):
    """World 2 with megatron's TP size 1 (its TP groups are single ranks), and a RowParallelLinear
    built with its own ``tp_group`` over both ranks, as a model-parallel-aware caller (MoE
    experts, Megatron-Bridge's pg_collection) builds it. The FP32 reduction must run over the
    layer's group: its oracle is the all-gather over that group and a plain FP32 matmul."""
    import megapatch
    from megatron.core.tensor_parallel import RowParallelLinear

    assert ctx.tp_size == 1
    group = torch.distributed.new_group([0, 1])
    found = {}
    for mode in ("native", "fp32"):
        megapatch.enable(tp_reduce_dtype=mode)
        layer = RowParallelLinear(512, 16, config=_linear_config(tp=2), init_method=None, bias=False,
                                  input_is_parallel=True, skip_bias_add=False, tp_group=group)
        assert layer.tp_group is group and layer.input_size_per_partition == 256
        with torch.no_grad():
            layer.weight.copy_(_integer_tensor((16, 256), seed=100 + ctx.rank))
        x = _integer_tensor((6, 1, 256), seed=200 + ctx.rank)
        with torch.no_grad():
            out, _ = layer(x)
        xs, ws = [torch.empty(6, 1, 256) for _ in range(2)], [torch.empty(16, 256) for _ in range(2)]
        torch.distributed.all_gather(xs, x.float(), group=group)
        torch.distributed.all_gather(ws, layer.weight.detach().float(), group=group)
        oracle = (torch.cat(xs, dim=-1) @ torch.cat(ws, dim=-1).t()).to(torch.bfloat16)
        found[mode] = (str(out.dtype), torch.equal(out, oracle), (out.float() - oracle.float()).abs().max().item())
    megapatch.disable()
    return found


def test_a_layer_with_its_own_tp_group_is_reduced_in_fp32_over_that_group():
    """issue 28 (weak): the reduction of a layer built with its own tp_group, where megatron's
    default TP group differs (size 1 here), must be the FP32 one over the layer's group."""
    _needs_fp32_reductions()
    for rank, found in enumerate(run_ranks(_own_tp_group, world_size=2, tp=1, timeout=300)):
        assert found["fp32"][:2] == ("torch.bfloat16", True), (rank, found)
        assert found["native"][1] is False, (rank, found)  # BF16-rounded partials: the oracle can fail


# -- contracts of the pieces, in-process (the rank jobs above show them end to end) ---------------

class _Work:
    """A c10d work handle: records its waits, completes when waited."""

    def __init__(self, events):
        self.events, self.done = events, False

    def wait(self, *args, **kwargs):
        self.events.append(("wait", args, kwargs))
        self.done = True
        return "the work's result"

    def is_completed(self):
        return self.done

    def exception(self):
        return "asked the work"


def test_an_async_handle_rounds_into_the_callers_tensor_once_after_the_work_and_only_on_wait():
    from megapatch.numerics.fp32_collectives import CastBackOnWait, _done

    events = []
    work = _Work(events)
    handle = _done(lambda: events.append("finish"), work, async_op=True)
    assert isinstance(handle, CastBackOnWait) and events == []  # nothing before wait()
    work.done = True
    assert not handle.is_completed()  # the collective is done; the caller's tensor is not yet
    assert handle.wait(timeout=3) == "the work's result"
    assert events == [("wait", (), {"timeout": 3}), "finish"]
    assert handle.is_completed()
    assert handle.wait() == "the work's result" and events[-1] != "finish"  # rounded once
    assert handle.exception() == "asked the work"  # everything else is the work's
    # synchronous: wait for the work, then round; a collective that returned no work just rounds
    events.clear()
    assert _done(lambda: events.append("finish"), _Work(events), async_op=False) is None
    assert events == [("wait", (), {}), "finish"]
    events.clear()
    assert _done(lambda: events.append("finish"), None, async_op=False) is None
    assert events == ["finish"]


@pytest.mark.parametrize("collective", ["all_reduce_", "reduce_scatter_"])
def test_an_unknown_reduction_mode_is_refused_naming_it_and_the_valid_ones(collective):
    from megapatch.numerics import fp32_collectives

    x = torch.ones(4, dtype=torch.bfloat16)
    args = (x, None, "bf16") if collective == "all_reduce_" else (x, x, None, "bf16")
    with pytest.raises(ValueError, match=r"unknown tp_reduce_dtype mode 'bf16'; valid: fp32, fp32-accumulate$"):
        getattr(fp32_collectives, collective)(*args)
    assert torch.equal(x, torch.ones(4, dtype=torch.bfloat16))  # nothing touched


def test_reduction_mode_checks_the_group_first_and_takes_only_bf16_and_fp16_tensors(monkeypatch):
    """A group of one, megapatch's native mode, and a tensor that is neither BF16 nor FP16 (FP32,
    integers) go to upstream's own collective; the settings check runs on every group of more than
    one rank before the dtype is looked at (the first call on a group may carry an FP32 tensor);
    no group means torch's default group, as torch.distributed takes it."""
    from types import SimpleNamespace

    from megapatch.core import cross_rank, options, state
    from megapatch.patches.tp_reduce import _reduction

    checked = []
    monkeypatch.setattr(cross_rank, "ensure_group_agrees", lambda group, settings: checked.append((group, settings)))
    world = StandInGroup(3)
    monkeypatch.setattr(_reduction, "c10d", SimpleNamespace(group=SimpleNamespace(WORLD=world)))
    bf16 = torch.ones(2, dtype=torch.bfloat16)
    monkeypatch.setattr(state, "_current", options.NATIVE)
    assert _reduction.reduction_mode(bf16, StandInGroup(2)) is None and checked == []
    for mode in MODES:
        settings = options.Settings(tp_reduce_dtype=mode)
        monkeypatch.setattr(state, "_current", settings)
        two = StandInGroup(2)
        assert _reduction.reduction_mode(bf16, StandInGroup(1)) is None and checked == []
        for dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
            assert _reduction.reduction_mode(torch.ones(2, dtype=dtype), two) is None, dtype
            assert checked.pop() == (two, settings)
        for dtype in (torch.bfloat16, torch.float16):
            assert _reduction.reduction_mode(torch.ones(2, dtype=dtype), two) == mode, dtype
            assert checked.pop() == (two, settings)
        assert _reduction.reduction_mode(bf16, None) == mode and checked.pop() == (world, settings)
        assert checked == []


def _collectives_taken(monkeypatch, mode):
    """The patch module, the calls it hands to megapatch's FP32 collectives (recorded, not run),
    a stand-in for upstream's collective, and BF16 output/input tensors with a group of two."""
    from megapatch.core import cross_rank, options, state
    from megapatch.numerics import fp32_collectives
    from megapatch.patches.tp_reduce import megatron_core as patch

    monkeypatch.setattr(cross_rank, "ensure_group_agrees", lambda group, settings: None)
    monkeypatch.setattr(state, "_current", options.Settings(tp_reduce_dtype=mode))
    taken = []
    monkeypatch.setattr(fp32_collectives, "reduce_scatter_", lambda *a, **k: taken.append(("rs", a, k)))
    monkeypatch.setattr(fp32_collectives, "all_reduce_", lambda *a, **k: taken.append(("ar", a, k)))
    upstream = lambda *a, **k: ("upstream", a, k)  # noqa: E731
    return patch, taken, upstream, torch.empty(1, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16), StandInGroup(2)


def test_only_a_sum_is_taken_by_the_patched_collectives(monkeypatch):
    """``dist_reduce_scatter_func`` and the dgrad ``all_reduce`` with another op (MAX, ...) go to
    upstream's own collective untouched; a sum in FP32 mode does not."""
    patch, taken, upstream, out, x, group = _collectives_taken(monkeypatch, "fp32")
    MAX, SUM = torch.distributed.ReduceOp.MAX, torch.distributed.ReduceOp.SUM
    assert patch._layers_reduce_scatter(upstream, None, (out, x, MAX, group), {})[0] == "upstream"
    assert patch._layers_reduce_scatter(upstream, None, (out, x), {"op": MAX, "group": group})[0] == "upstream"
    with patch.scoped(patch._in_linear_backward, True):
        assert patch._dgrad_all_reduce(upstream, None, (x, MAX, group), {})[0] == "upstream"
        assert taken == []
        patch._dgrad_all_reduce(upstream, None, (x,), {"group": group, "async_op": True})
    patch._layers_reduce_scatter(upstream, None, (out, x, SUM, group, True), {})
    assert taken == [("ar", (x, group, "fp32"), {"async_op": True}), ("rs", (out, x, group, "fp32"), {"async_op": True})]
    # outside a linear layer's backward, torch.distributed.all_reduce is never megapatch's
    assert patch._dgrad_all_reduce(upstream, None, (x, SUM, group), {})[0] == "upstream"


# -- issue 28 item 8: survivors of the sixth fresh mutation sample (seed 33) ----------------------

def test_a_patch_serving_an_option_applies_exactly_when_the_option_has_that_value():
    """``when(option, value)``: equal, not ordered -- "native" sorts after "fp32", 16 after 8."""
    from megapatch.core.options import Settings
    from megapatch.patches._common import when

    fp32_logits = when("logits_dtype", "fp32")
    assert fp32_logits(Settings(logits_dtype="fp32")) is True and fp32_logits(Settings()) is False
    width_8 = when("tp_invariant_width", 8)
    assert [width_8(Settings(tp_invariant_width=w)) for w in (4, 8, 16)] == [False, True, False]


def test_the_patched_collectives_read_torchs_signatures_by_position_by_keyword_and_by_default(monkeypatch):
    """``torch.distributed.all_reduce(tensor, op, group, async_op)`` and ``reduce_scatter_tensor(output,
    input, op, group, async_op)``: megatron-core passes group and async_op by keyword, but a caller may
    pass them by position; not passing async_op means a synchronous call (None returned, the result in
    place), never a handle nobody waits on."""
    patch, taken, upstream, out, x, group = _collectives_taken(monkeypatch, "fp32-accumulate")
    SUM = torch.distributed.ReduceOp.SUM
    with patch.scoped(patch._in_linear_backward, True):
        patch._dgrad_all_reduce(upstream, None, (x, SUM, group, True), {})
        patch._dgrad_all_reduce(upstream, None, (x, SUM, group), {})
        patch._dgrad_all_reduce(upstream, None, (x,), {"op": SUM, "group": group})
    patch._layers_reduce_scatter(upstream, None, (out, x, SUM, group), {})
    patch._layers_reduce_scatter(upstream, None, (out, x), {"group": group, "async_op": True})
    mode = "fp32-accumulate"
    assert taken == [("ar", (x, group, mode), {"async_op": True}), ("ar", (x, group, mode), {"async_op": False}),
                     ("ar", (x, group, mode), {"async_op": False}), ("rs", (out, x, group, mode), {"async_op": False}),
                     ("rs", (out, x, group, mode), {"async_op": True})]


def test_row_parallel_asks_for_its_fp32_accumulator_only_where_a_reduction_follows(monkeypatch):
    """fp32 mode: a row-parallel layer of a TP group of more than one rank hands its FP32 GEMM
    accumulator to the reduction and returns the caller's dtype; a layer alone in its group (TP 1),
    or an expert layer whose communication is the dispatcher's, runs upstream's forward untouched
    (no FP32 request: zero cost); inside an MoE layer that sums on (``MOE_FP32_SUM``) the FP32 output
    is kept; an upstream that ignored the request is refused."""
    from types import SimpleNamespace

    from megapatch.core import options, state
    from megapatch.core.errors import UpstreamSurfaceError
    from megapatch.numerics import fp32_output_linear
    from megapatch.patches.tp_reduce import megatron_core as patch
    from megapatch.patches.tp_reduce._reduction import MOE_FP32_SUM

    monkeypatch.setattr(state, "_current", options.Settings(tp_reduce_dtype="fp32"))
    x = torch.ones(2, 3, dtype=torch.bfloat16)
    requests = []

    def upstream(input_, output_dtype=None):
        requests.append(fp32_output_linear.requested_output_dtype())
        return (input_.to(output_dtype or fp32_output_linear.requested_output_dtype() or input_.dtype) / 3,
                "bias")

    def forward(layer, dtype=None):
        return patch._row_parallel_forward(lambda *a, **k: upstream(*a, output_dtype=dtype, **k), layer, (x,), {})

    alone, expert = SimpleNamespace(tp_group=StandInGroup(1)), SimpleNamespace(tp_group=StandInGroup(2), explicit_expert_comm=True)
    for layer in (alone, expert):
        out, bias = forward(layer)
        assert requests.pop() is None and out.dtype == torch.bfloat16 and bias == "bias"
    out, bias = forward(SimpleNamespace(tp_group=StandInGroup(2)))
    assert requests.pop() is torch.float32 and out.dtype == torch.bfloat16 and bias == "bias"
    assert torch.equal(out, (x.float() / 3).to(torch.bfloat16))
    summed_on = SimpleNamespace(tp_group=StandInGroup(1), **{MOE_FP32_SUM: True})
    out, _ = forward(summed_on)
    assert requests.pop() is torch.float32 and out.dtype == torch.float32
    with pytest.raises(UpstreamSurfaceError, match="RowParallelLinear produced torch.bfloat16, not its FP32"):
        forward(SimpleNamespace(tp_group=StandInGroup(2)), dtype=torch.bfloat16)
