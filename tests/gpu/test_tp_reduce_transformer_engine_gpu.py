"""tp_reduce_dtype on real Transformer Engine layers: 2 GPUs, NCCL, TP=2, BF16 (needs CUDA and TE).

Each mode (native, fp32, fp32-accumulate) runs the same layers on the same data:

* row-parallel ``te.Linear`` (with and without sequence parallelism): forward and backward; the
  output and the weight gradient are compared with an FP32 reference built from the all-gathered
  shards (plain FP32 matmul); every rank holds different input and weight shards;
* column-parallel ``te.Linear``: the input gradient (TP all-reduce of the dgrad) against the FP32
  reference;
* row-parallel ``te.LayerNormMLP``: only fc2 may return an FP32 accumulator.

Asserted: fp32 and fp32-accumulate errors <= native's, fp32's forward error strictly lower
(one rounding instead of three), and in fp32 exactly one intercepted (FP32-output) GEMM per
row-parallel forward, none otherwise. Run: ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import importlib.util
import pytest
import torch

from megapatch.testing import run_ranks

WORLD = 2
MODES = ("native", "fp32", "fp32-accumulate")


def _te_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= WORLD
                            and _te_importable()),
                       reason=f"needs {WORLD}+ CUDA GPUs and Transformer Engine"),
]


def _count_gemms(module):
    """Record the output dtype of every general_gemm call made through ``module``'s global (on top
    of megapatch's wrapper); returns (dtypes, restore)."""
    inner = module.general_gemm
    dtypes = []

    def gemm(*args, **kwargs):
        result = inner(*args, **kwargs)
        dtypes.append(result[0].dtype)
        return result

    module.general_gemm = gemm
    return dtypes, lambda: setattr(module, "general_gemm", inner)


def _gather(t, dim):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def _err(a, b):
    return (a.float() - b.float()).abs().mean().item()


def _row(te, rank, sp, seed):
    import transformer_engine.pytorch.module.linear as linear

    m, k, n = 64, 4096, 256
    g = torch.Generator(device="cuda").manual_seed(seed + rank)  # different shards on each rank
    x = torch.randn(m, k // WORLD, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(n, k // WORLD, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).to(torch.bfloat16)
    layer = te.Linear(k, n, bias=True, parallel_mode="row", sequence_parallel=sp,
                      tp_group=torch.distributed.group.WORLD, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(bias)
    dtypes, restore = _count_gemms(linear)
    try:
        y = layer(x)
        fwd = list(dtypes)
        y.float().square().sum().backward()
    finally:
        restore()
    xf, wf = _gather(x.detach(), 1).float(), _gather(w, 1).float()
    ref = xf @ wf.t() + bias.float()
    ref_local = ref.chunk(WORLD, dim=0)[rank] if sp else ref
    # the reference weight gradient of this rank's shard, from the BF16 output the layer produced
    dy = 2 * (_gather(y.detach(), 0) if sp else y.detach()).float()
    dw_ref = dy.t() @ _gather(x.detach(), 1).float()[:, rank * (k // WORLD):(rank + 1) * (k // WORLD)]
    return {"out_dtype": str(y.dtype), "fwd_err": _err(y, ref_local), "fwd_gemm_dtypes": [str(d) for d in fwd],
            "wgrad_err": _err(layer.weight.grad, dw_ref) / dw_ref.abs().mean().item()}


def _column(te, rank, seed):
    m, k, n = 64, 1024, 4096
    g = torch.Generator(device="cuda").manual_seed(seed)  # same input on every rank (column-parallel)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    gr = torch.Generator(device="cuda").manual_seed(seed + 100 + rank)  # different weight shards
    w = torch.randn(n // WORLD, k, device="cuda", generator=gr).to(torch.bfloat16)
    dy = torch.randn(m, n // WORLD, device="cuda", generator=gr).to(torch.bfloat16)
    layer = te.Linear(k, n, bias=False, parallel_mode="column", tp_group=torch.distributed.group.WORLD,
                      params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w)
    layer(x).backward(dy)
    dx_ref = _gather(dy, 1).float() @ _gather(w, 0).float()
    return {"dgrad_err": _err(x.grad, dx_ref), "dgrad_dtype": str(x.grad.dtype)}


def _lnmlp(te):
    import transformer_engine.pytorch.module.layernorm_mlp as lnmlp

    layer = te.LayerNormMLP(1024, 4096, set_parallel_mode=True, tp_group=torch.distributed.group.WORLD,
                            params_dtype=torch.bfloat16)
    x = torch.randn(64, 1024, device="cuda").to(torch.bfloat16)
    dtypes, restore = _count_gemms(lnmlp)
    try:
        y = layer(x)
    finally:
        restore()
    return {"out_dtype": str(y.dtype), "gemm_dtypes": [str(d) for d in dtypes]}


def _all_modes(ctx):
    import torch.distributed as dist
    import transformer_engine.pytorch as te

    import megapatch

    rank = ctx.rank
    results = {}
    for mode in MODES:
        megapatch.disable()
        megapatch.enable(tp_reduce_dtype=mode)
        dist.barrier()
        results[mode] = {
            "state": megapatch.status().patch("tp_reduce.transformer_engine").state,
            "row": _row(te, rank, sp=False, seed=1),
            "row_sp": _row(te, rank, sp=True, seed=2),
            "column": _column(te, rank, seed=3),
            "lnmlp": _lnmlp(te),
        }
    megapatch.disable()
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_modes, WORLD, init_megatron=False, backend="nccl", timeout=900)


def test_patch_is_active_in_the_fp32_modes(results):
    for ranks in results:
        assert ranks["native"]["state"] == "inactive"
        assert ranks["fp32"]["state"] == ranks["fp32-accumulate"]["state"] == "active"


@pytest.mark.parametrize("case", ["row", "row_sp"])
def test_row_parallel_forward_is_closer_to_fp32(results, case):
    for rank, ranks in enumerate(results):
        native, fp32, acc = (ranks[m][case] for m in MODES)
        assert native["out_dtype"] == fp32["out_dtype"] == acc["out_dtype"] == "torch.bfloat16"
        assert fp32["fwd_err"] < native["fwd_err"], (rank, case, native, fp32)
        assert acc["fwd_err"] <= native["fwd_err"] * 1.0001, (rank, case, native, acc)
        # the FP32 accumulator is used in mode fp32 only, for exactly the one fprop GEMM
        assert fp32["fwd_gemm_dtypes"] == ["torch.float32"], fp32
        assert native["fwd_gemm_dtypes"] == acc["fwd_gemm_dtypes"] == ["torch.bfloat16"]
        # the weight gradient involves no TP reduction: it must not get worse
        assert fp32["wgrad_err"] <= native["wgrad_err"] * 1.05 + 1e-3, (rank, case, native, fp32)


def test_column_parallel_dgrad_reduction(results):
    for rank, ranks in enumerate(results):
        native, fp32, acc = (ranks[m]["column"] for m in MODES)
        assert native["dgrad_dtype"] == fp32["dgrad_dtype"] == acc["dgrad_dtype"] == "torch.bfloat16"
        assert fp32["dgrad_err"] <= native["dgrad_err"] * 1.0001, (rank, native, fp32)
        assert acc["dgrad_err"] <= native["dgrad_err"] * 1.0001, (rank, native, acc)


def test_layernorm_mlp_intercepts_only_fc2(results):
    for ranks in results:
        assert ranks["fp32"]["lnmlp"]["gemm_dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert ranks["native"]["lnmlp"]["gemm_dtypes"] == ["torch.bfloat16", "torch.bfloat16"]
        assert all(ranks[m]["lnmlp"]["out_dtype"] == "torch.bfloat16" for m in MODES)
