"""Transformer Engine's modules run on CPU through megapatch's TE runtime stand-in
(``megapatch.testing.stand_ins.te_runtime``), against an independent FP32 oracle; and
``tp_reduce_dtype=fp32`` on TE layers, run.

1. ``te.Linear`` (column and row parallel), ``te.LayerNormLinear`` (LayerNorm; RMSNorm with
   zero-centered gamma) and ``te.LayerNormMLP`` (GELU through TE's bias-GELU path, GELU through the
   GEMM's GELU epilogue, SwiGLU with RMSNorm), forward and backward, at TP 1, 2 and 4 with and
   without sequence parallelism, on 4 spawned gloo ranks. The oracle runs in the test process in
   float64 with plain torch (``F.linear``, ``F.layer_norm``, a manual RMSNorm, ``F.gelu(approximate=
   "tanh")``, ``F.silu``) on the same (BF16-representable) weights; the ranks' shards are put back
   together by the test's own reading of TE's sharding. Sizes are distinct and not square, every
   input row carries a ramp over its sequence position, so a wrong transpose, a swapped shard or a
   mis-ordered sequence chunk is an error of order 1.
2. ``tp_reduce_dtype="fp32"`` through the existing patch (``patches/tp_reduce/transformer_engine.py``):
   row-parallel ``te.Linear`` and ``te.LayerNormMLP`` (its fc2 is row-parallel) at TP 2 and 4, SP
   and not, with partial sums that cancel across ranks (each rank's partial carries +-L, L large):
   natively each BF16 partial is rounded before the sum, losing the small part; under ``fp32`` the
   GEMM's FP32 accumulator is reduced and rounded once.
3. megatron-core's ``TERowParallelLinear`` (built from a ``TransformerConfig``) at TP 2, SP and not,
   under the same two modes and inputs.

Needs Transformer Engine (a venv with ``../shared/te-cpu/install.sh``); skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megapatch.testing import run_ranks


pytestmark = pytest.mark.te

BF16 = torch.bfloat16
SEQ, BATCH, HIDDEN, OUT, FFN = 8, 3, 48, 80, 96  # SEQ, OUT, FFN and HIDDEN divisible by 4 (TP, SP)
EPS = 1e-5
TPS = (1, 2, 4)
WORLD = 4

#: case -> (module, constructor keywords); the gelu-epilogue case turns TE's bias-GELU fusion off
#: as TE itself does (module.bias_gelu_nvfusion), so fc1 and fc2's dgrad use the GEMM's GELU epilogue
CASES = {
    "linear-column": ("Linear", dict(parallel_mode="column")),
    "linear-row": ("Linear", dict(parallel_mode="row")),
    "lnlinear-layernorm": ("LayerNormLinear", dict(parallel_mode="column", normalization="LayerNorm")),
    "lnlinear-rmsnorm-zc": ("LayerNormLinear", dict(parallel_mode="column", normalization="RMSNorm",
                                                    zero_centered_gamma=True)),
    "mlp-gelu": ("LayerNormMLP", dict(activation="gelu")),
    "mlp-gelu-epilogue": ("LayerNormMLP", dict(activation="gelu")),
    "mlp-swiglu-rmsnorm": ("LayerNormMLP", dict(activation="swiglu", normalization="RMSNorm")),
}

#: the tex kernels each case must go through (forward and backward)
EXPECTED_KERNELS = {
    "linear-column": {"generic_gemm TN bias", "generic_gemm NN grad", "generic_gemm NT bias grad"},
    "linear-row": {"generic_gemm TN", "generic_gemm NN grad", "generic_gemm NT grad"},  # bias grad: TE sums dy itself
    "lnlinear-layernorm": {"layernorm_fwd", "layernorm_bwd", "generic_gemm TN bias"},
    "lnlinear-rmsnorm-zc": {"rmsnorm_fwd", "rmsnorm_bwd", "generic_gemm TN bias"},
    "mlp-gelu": {"layernorm_fwd", "layernorm_bwd", "generic_gemm TN", "generic_gemm NN grad"},
    "mlp-gelu-epilogue": {"generic_gemm TN bias gelu", "generic_gemm NN gelu grad", "generic_gemm NT bias grad"},
    "mlp-swiglu-rmsnorm": {"rmsnorm_fwd", "swiglu", "dswiglu", "rmsnorm_bwd"},
}


# -- full (unsharded) tensors: BF16-representable, seeded per case ------------------------------

def _bf16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).float()


def _ramp(shape) -> torch.Tensor:
    """A per-sequence-position offset: rows of different positions differ by O(1)."""
    return torch.linspace(-1.0, 1.0, shape[0]).view(-1, *([1] * (len(shape) - 1))).expand(shape)


def full_tensors(case: str) -> dict:
    module, kw = CASES[case]
    g = torch.Generator().manual_seed(sorted(CASES).index(case) + 7)
    rnd = lambda *shape, scale=1.0: _bf16_exact(torch.randn(*shape, generator=g) * scale)  # noqa: E731
    t = {"x": _bf16_exact(torch.randn(SEQ, BATCH, HIDDEN, generator=g) + 2 * _ramp((SEQ, BATCH, HIDDEN)))}
    if module == "LayerNormMLP":
        gated = kw["activation"] == "swiglu"
        t["layer_norm_weight"] = rnd(HIDDEN, scale=0.2) + (0.0 if kw.get("zero_centered_gamma") else 1.0)
        if kw.get("normalization", "LayerNorm") == "LayerNorm":
            t["layer_norm_bias"] = rnd(HIDDEN, scale=0.2)
        t["fc1_weight"] = rnd((2 if gated else 1) * FFN, HIDDEN, scale=HIDDEN ** -0.5)
        t["fc1_bias"] = rnd((2 if gated else 1) * FFN, scale=0.2)
        t["fc2_weight"] = rnd(HIDDEN, FFN, scale=FFN ** -0.5)
        t["fc2_bias"] = rnd(HIDDEN, scale=0.2)
        out = HIDDEN
    else:
        if module == "LayerNormLinear":
            t["layer_norm_weight"] = rnd(HIDDEN, scale=0.2) + (0.0 if kw.get("zero_centered_gamma") else 1.0)
            if kw["normalization"] == "LayerNorm":
                t["layer_norm_bias"] = rnd(HIDDEN, scale=0.2)
        t["weight"] = rnd(OUT, HIDDEN, scale=HIDDEN ** -0.5)
        t["bias"] = rnd(OUT, scale=0.2)
        out = OUT
    t["grad_out"] = _bf16_exact(torch.randn(SEQ, BATCH, out, generator=g) + _ramp((SEQ, BATCH, out)))
    return t


# -- TE's sharding, as the test reads it ---------------------------------------------------------

def _layout(case: str, name: str, sp: bool):
    """How ``name`` is laid out over the TP ranks: ("split", dim), ("gated", 0) (each rank holds its
    chunk of both halves), ("same",) (replicated, equal), ("sum",) (replicated parameter, gradient
    over this rank's tokens: summed). Parameters' own layout is the first three only."""
    module, kw = CASES[case]
    row = kw.get("parallel_mode") == "row"
    tokens_split = ("split", 0) if sp else ("same",)
    if name in ("x", "dx"):
        return ("split", 2) if row else tokens_split
    if name in ("y", "grad_out"):
        if module == "LayerNormMLP" or row:
            return tokens_split
        return ("split", 2)
    gated = module == "LayerNormMLP" and kw["activation"] == "swiglu"
    shards = {"weight": ("split", 1) if row else ("split", 0), "bias": None if row else ("split", 0),
              "fc1_weight": ("gated", 0) if gated else ("split", 0),
              "fc1_bias": ("gated", 0) if gated else ("split", 0), "fc2_weight": ("split", 1)}
    if shards.get(name) is not None:
        return shards[name]
    return ("sum",) if sp else ("same",)


def shard(full: torch.Tensor, layout, tp: int, r: int) -> torch.Tensor:
    if layout[0] == "split":
        return full.chunk(tp, dim=layout[1])[r].contiguous()
    if layout[0] == "gated":
        act, gate = full.chunk(2, dim=0)
        return torch.cat([act.chunk(tp)[r], gate.chunk(tp)[r]]).contiguous()
    return full.clone()


def unshard(parts, layout) -> torch.Tensor:
    if layout[0] == "split":
        return torch.cat(parts, dim=layout[1])
    if layout[0] == "gated":
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if layout[0] == "sum":
        return sum(p.double() for p in parts)
    for p in parts[1:]:
        assert torch.equal(p, parts[0]), "a replicated tensor differs between TP ranks"
    return parts[0]


# -- the ranks --------------------------------------------------------------------------------------

def _build(case: str, tp: int, sp: bool, group, tp_rank: int):
    import transformer_engine.pytorch as te

    module, kw = CASES[case]
    common = dict(params_dtype=BF16, device="cpu", tp_group=group, tp_size=tp, sequence_parallel=sp)
    if module == "Linear":
        layer = te.Linear(HIDDEN, OUT, bias=True, **kw, **common)
    elif module == "LayerNormLinear":
        layer = te.LayerNormLinear(HIDDEN, OUT, bias=True, eps=EPS, **kw, **common)
    else:
        layer = te.LayerNormMLP(HIDDEN, FFN, bias=True, eps=EPS, set_parallel_mode=True,
                                normalization=kw.get("normalization", "LayerNorm"),
                                activation=kw["activation"], **common)
        if case == "mlp-gelu-epilogue":
            layer.bias_gelu_nvfusion = False
    full = full_tensors(case)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(shard(full[name], _layout(case, name, False), tp, tp_rank))
    return layer, full


def run_case(case: str, tp: int, sp: bool, group, tp_rank: int) -> dict:
    """One forward and backward of ``case`` on this rank's shard: the local output, input gradient
    and parameter gradients (as float32), and the tex kernels called."""
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    with te_cpu_runtime() as calls:
        start = len(calls)
        layer, full = _build(case, tp, sp, group, tp_rank)
        x = shard(full["x"], _layout(case, "x", sp), tp, tp_rank).to(BF16).requires_grad_()
        y = layer(x)
        grad_out = shard(full["grad_out"], _layout(case, "y", sp), tp, tp_rank).to(BF16)
        y.backward(grad_out)
        kernels = sorted(set(calls[start:]))
    found = {"y": y.detach().float(), "dx": x.grad.float(), "kernels": kernels, "dtype": str(y.dtype)}
    found.update({name: p.grad.float() for name, p in layer.named_parameters()})
    return found


def _groups(rank: int):
    """Every TP layout of the 4 ranks (every rank creates every group, in the same order)."""
    import torch.distributed as dist

    mine = {}
    for tp in TPS:
        for first in range(0, WORLD, tp):
            ranks = list(range(first, first + tp))
            group = dist.new_group(ranks) if tp > 1 else None
            if rank in ranks:
                mine[tp] = (group, rank - first)
    return mine


def _modules_rank(ctx):
    found = {}
    for tp, (group, tp_rank) in _groups(ctx.rank).items():
        for case in CASES:
            for sp in ((False, True) if tp > 1 else (False,)):
                found[(case, tp, sp)] = run_case(case, tp, sp, group, tp_rank)
    return found


@pytest.fixture(scope="module")
def module_runs():
    return run_ranks(_modules_rank, WORLD, init_megatron=False, timeout=300)


# -- the oracle (float64, plain torch) --------------------------------------------------------------

def oracle(case: str) -> dict:
    module, kw = CASES[case]
    t = {k: v.double().requires_grad_(k != "grad_out") for k, v in full_tensors(case).items()}
    x = t["x"]
    if module in ("LayerNormLinear", "LayerNormMLP"):
        gamma = t["layer_norm_weight"] + (1.0 if kw.get("zero_centered_gamma") else 0.0)
        if kw.get("normalization", "LayerNorm") == "LayerNorm":
            h = F.layer_norm(x, (HIDDEN,), gamma, t["layer_norm_bias"], EPS)
        else:
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * gamma
    else:
        h = x
    if module == "LayerNormMLP":
        a = F.linear(h, t["fc1_weight"], t["fc1_bias"])
        if kw["activation"] == "swiglu":
            act, gate = a.chunk(2, dim=-1)
            a = F.silu(act) * gate
        else:
            a = F.gelu(a, approximate="tanh")
        y = F.linear(a, t["fc2_weight"], t["fc2_bias"])
    else:
        y = F.linear(h, t["weight"], t["bias"])
    y.backward(t["grad_out"])
    found = {"y": y.detach(), "dx": x.grad}
    found.update({k: v.grad for k, v in t.items() if k not in ("x", "grad_out")})
    return found


def normalized_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


# BF16 keeps 8 significant bits: one rounding is within 2^-9 of the value. The outputs and
# gradients here pass through at most four roundings (the norm's output, fc1's output, the
# activation, the GEMM's own output; natively, TP partial sums too) and sums of 48-192 terms of
# mixed sign, which can grow an element's error relative to the tensor's largest element; 2^-5
# bounds every one of them here (the largest seen: see test_errors_are_bf16_rounding_not_layout),
# while a wrong transpose, shard or chunk order is an error of order 1 (0.4 and up).
TOLERANCE = 2.0 ** -6


def assembled(runs, case: str, tp: int, sp: bool) -> dict:
    per_rank = [runs[r][(case, tp, sp)] for r in range(tp)]
    return {name: unshard([p[name] for p in per_rank], _layout(case, name, sp))
            for name in per_rank[0] if name not in ("kernels", "dtype")}


LAYOUTS = [(tp, sp) for tp in TPS for sp in ((False, True) if tp > 1 else (False,))]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tp, sp", LAYOUTS, ids=[f"tp{tp}{'-sp' if sp else ''}" for tp, sp in LAYOUTS])
def test_module_forward_and_backward_match_the_fp32_oracle(module_runs, case, tp, sp):
    want = oracle(case)
    got = assembled(module_runs, case, tp, sp)
    assert set(got) == set(want), (sorted(got), sorted(want))
    errors = {name: normalized_error(got[name], want[name]) for name in want}
    bad = {name: e for name, e in errors.items() if not e <= TOLERANCE}
    assert not bad, f"{case} tp={tp} sp={sp}: normalized errors above {TOLERANCE}: {bad} (all: {errors})"
    runs = [module_runs[r][(case, tp, sp)] for r in range(tp)]
    assert all(r["dtype"] == "torch.bfloat16" for r in runs)
    missing = EXPECTED_KERNELS[case] - set(runs[0]["kernels"])
    assert not missing, f"{case}: kernels not called: {missing} (called: {runs[0]['kernels']})"


def test_errors_are_bf16_rounding_not_layout(module_runs):
    """The errors are those of BF16 rounding: every module's output is off the oracle somewhere (the
    comparison is not vacuous) and no error comes near a layout bug's."""
    worst = {}
    for case in CASES:
        want = oracle(case)
        for tp, sp in LAYOUTS:
            got = assembled(module_runs, case, tp, sp)
            for name in want:
                worst[(case, name)] = max(worst.get((case, name), 0.0), normalized_error(got[name], want[name]))
    assert all(worst[(case, "y")] > 0 for case in CASES), worst
    assert max(worst.values()) <= TOLERANCE, max(worst.items(), key=lambda kv: kv[1])


def _ulp_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the BF16 spacing at |want| (BF16: 8 significant bits)."""
    exponent = torch.floor(torch.log2(want.abs().clamp_min(1e-30)))
    return (got.double() - want).abs() / torch.exp2(exponent - 7)


@pytest.mark.parametrize("case", ["linear-column", "lnlinear-layernorm"])
def test_a_single_gemm_output_is_rounded_once_from_fp32(module_runs, case):
    """The forward GEMM accumulates in FP32 and rounds once: at TP 1, Linear's output is the FP32
    oracle rounded to BF16 (within half a spacing, plus the FP32 sum-order slack); LayerNormLinear's
    output adds the rounding of the norm's BF16 output (its own check: within a few spacings)."""
    want = oracle(case)["y"]
    got = assembled(module_runs, case, 1, False)["y"]
    ulps = _ulp_errors(got, want)
    if case == "linear-column":
        assert float(ulps.max()) <= 0.5 + 1e-3, float(ulps.max())
    else:
        assert float(ulps.max()) > 0.5, "the norm's BF16 output should cost more than one rounding"


# -- the runtime's own contracts ----------------------------------------------------------------------

def test_generic_gemm_layouts_accumulate_and_epilogues():
    """generic_gemm against torch on small non-square operands: TN, NN and NT as TE's modules use them
    (fprop x W^T, dgrad dy W, wgrad dy^T x), leading dimensions kept, accumulate= into out (FP32 sum,
    one rounding), the bias and GELU epilogues, the bias gradient."""
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 7, generator=g).to(BF16)   # (.., K=7)
    w = torch.randn(3, 7, generator=g).to(BF16)      # (N=3, K)
    dy = torch.randn(2, 5, 3, generator=g).to(BF16)  # (.., N)
    b = torch.randn(3, generator=g).to(BF16)
    with te_cpu_runtime():
        from transformer_engine.pytorch.cpp_extensions import general_gemm

        fprop, *_ = general_gemm(w, x, out_dtype=BF16, layout="TN")
        dgrad, *_ = general_gemm(w, dy, out_dtype=BF16, layout="NN", grad=True)
        wgrad, dbias, *_ = general_gemm(x, dy, out_dtype=BF16, layout="NT", grad=True, bias=b)
        main_grad = torch.full((3, 7), 0.25, dtype=torch.float32)
        general_gemm(x, dy, out_dtype=torch.float32, layout="NT", out=main_grad, accumulate=True)
        act, _, pre, _ = general_gemm(w, x, out_dtype=BF16, layout="TN", bias=b, gelu=True)
    x2, dy2 = x.double().reshape(10, 7), dy.double().reshape(10, 3)
    assert fprop.shape == (2, 5, 3) and dgrad.shape == (2, 5, 7) and wgrad.shape == (3, 7)
    assert torch.equal(fprop, (x.double() @ w.double().t()).to(BF16))
    assert torch.equal(dgrad, (dy.double() @ w.double()).to(BF16))
    assert torch.equal(wgrad, (dy2.t() @ x2).to(BF16)) and torch.equal(dbias, dy2.sum(0).to(BF16))
    assert torch.allclose(main_grad.double(), 0.25 + dy2.t() @ x2, rtol=1e-6, atol=1e-6)
    pre_want = x.double() @ w.double().t() + b.double()
    assert torch.equal(pre, pre_want.to(BF16))
    assert torch.equal(act, F.gelu(pre_want, approximate="tanh").to(BF16))


def test_megatron_core_clipping_runs_the_multi_tensor_kernels_on_cpu():
    """megatron-core binds TE's multi_tensor_scale / multi_tensor_l2norm at import when TE is
    installed (gradient clipping, the BF16 optimizer's copies): inside the runtime its own bound
    names run the CPU kernels -- the scale's product in FP32 written in the target's dtype, the norm
    against a float64 oracle, a non-finite input flagged."""
    from megatron.core.optimizer import clip_grads

    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(5, 3, generator=g) * 7, torch.randn(11, generator=g).to(BF16)]
    targets = [torch.empty(5, 3), torch.empty(11, dtype=BF16)]
    with te_cpu_runtime() as calls:
        before = len(calls)
        flag = torch.zeros(1, dtype=torch.int)
        clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, flag, [grads, targets], 0.3)
        total, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, flag, [grads], False)
        bad = torch.zeros(1, dtype=torch.int)
        clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, bad,
                                        [[torch.tensor([1.0, float("inf")])], [torch.empty(2)]], 2.0)
    assert calls[before:] == ["multi_tensor_scale", "multi_tensor_l2norm", "multi_tensor_scale"]
    for grad, target in zip(grads, targets):
        assert torch.equal(target, (grad.float() * 0.3).to(target.dtype))
    want = torch.cat([t.double().flatten() for t in grads]).norm()
    assert total.dtype == torch.float32 and abs(total.item() - want.item()) <= 1e-6 * want.item()
    assert flag.item() == 0 and bad.item() == 1


@pytest.mark.parametrize("mode", [0, 1], ids=["adam-l2", "adamw"])
def test_fused_adam_step_matches_a_float64_adam_step(mode):
    """tex.multi_tensor_adam (TE's FusedAdam, Megatron-LM's optimizer where TE is installed) against
    the Adam/AdamW step in float64: one step from non-zero moments at step 3, FP32 params in place,
    and with FP32 master params beside BF16 params (the params get the master's update rounded)."""
    from megapatch.testing.stand_ins.te_cpu_optimizer import multi_tensor_adam

    g = torch.Generator().manual_seed(9)
    grad, param, m, v = (torch.randn(7, 5, generator=g) for _ in range(4))
    v = v.abs()
    lr, b1, b2, eps, step, decay = 1e-2, 0.9, 0.95, 1e-8, 3, 0.1
    x_g, x_p, x_m, x_v = (t.double() for t in (grad, param, m, v))
    if mode == 0:
        x_g = x_g + decay * x_p
    x_m = b1 * x_m + (1 - b1) * x_g
    x_v = b2 * x_v + (1 - b2) * x_g * x_g
    update = (x_m / (1 - b1 ** step)) / ((x_v / (1 - b2 ** step)).sqrt() + eps)
    want = x_p - lr * (update + (decay * x_p if mode == 1 else 0))
    flag = torch.zeros(1, dtype=torch.int)
    p32, m32, v32 = param.clone(), m.clone(), v.clone()
    multi_tensor_adam(2048, flag, [[grad], [p32], [m32], [v32]], lr, b1, b2, eps, step, mode, 1, decay)
    assert torch.allclose(p32.double(), want, rtol=0, atol=1e-6) and not torch.equal(p32, param)
    assert torch.allclose(m32.double(), x_m, atol=1e-6) and torch.allclose(v32.double(), x_v, atol=1e-6)
    bf16, master, m2, v2 = param.to(BF16), param.clone(), m.clone(), v.clone()
    multi_tensor_adam(2048, flag, [[grad], [bf16], [m2], [v2], [master]], lr, b1, b2, eps, step, mode, 1, decay)
    assert torch.equal(master, p32) and torch.equal(bf16, p32.to(BF16)) and flag.item() == 0


def test_unsupported_paths_are_refused_by_name():
    from megapatch.testing.stand_ins.te_cpu_refusals import NotOnCpuRuntime
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    with te_cpu_runtime():
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.cpp_extensions import general_gemm

        w = torch.ones(4, 8, dtype=BF16)
        with pytest.raises(NotOnCpuRuntime, match="quantize"):
            tex.quantize(w, None)
        with pytest.raises(NotOnCpuRuntime, match="comm\\+GEMM overlap"):
            tex.generic_gemm(w, True, w, False, None, None, None, None, tex.DType.kBFloat16, False, None,
                             False, torch.empty(0), 0, False, False, comm_type=tex.CommOverlapType.RS)
        quantizer = te.tensor.float8_tensor.Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device="cpu")
        with pytest.raises(NotOnCpuRuntime, match="Float8CurrentScalingQuantizer"):
            general_gemm(w, w, out_dtype=BF16, quantization_params=quantizer)
    assert not torch.cuda.is_available()  # restored


# -- tp_reduce_dtype=fp32 on TE layers ------------------------------------------------------------------

CANCEL = 256.0  # the size of each rank's cancelling partial


def fp32_case_tensors(module: str, tp: int) -> dict:
    """Full tensors whose row-parallel partial sums cancel across ranks: rank r's first input feature
    (Linear) or first FFN unit (LayerNormMLP: fc1 weight row 0, bias 8, so GELU gives exactly 8) carries
    (-1)^r CANCEL times one shared column, which sums to 0 over ranks; the rest is small and random."""
    g = torch.Generator().manual_seed(11 + tp)
    rnd = lambda *shape, scale=1.0: _bf16_exact(torch.randn(*shape, generator=g) * scale)  # noqa: E731
    column = _bf16_exact(torch.rand(HIDDEN if module == "LayerNormMLP" else OUT, generator=g) + 0.5)
    t = {"x": _bf16_exact(torch.randn(SEQ, BATCH, HIDDEN, generator=g) + _ramp((SEQ, BATCH, HIDDEN)))}
    if module == "Linear":
        t["weight"] = rnd(OUT, HIDDEN, scale=HIDDEN ** -0.5)
        # zero: TE adds the row-parallel bias after the reduction, in BF16 (a second rounding); without
        # it the output is the reduction's one rounding
        t["bias"] = torch.zeros(OUT)
        for r, first in enumerate(range(0, HIDDEN, HIDDEN // tp)):
            t["x"][..., first] = (-1) ** r
            t["weight"][:, first] = CANCEL * column
        out = OUT
    else:
        t["layer_norm_weight"] = 1.0 + rnd(HIDDEN, scale=0.2)
        t["layer_norm_bias"] = rnd(HIDDEN, scale=0.2)
        t["fc1_weight"] = rnd(FFN, HIDDEN, scale=HIDDEN ** -0.5)
        t["fc1_bias"] = rnd(FFN, scale=0.2)
        t["fc2_weight"] = rnd(HIDDEN, FFN, scale=FFN ** -0.5)
        t["fc2_bias"] = rnd(HIDDEN, scale=0.2)
        for r, first in enumerate(range(0, FFN, FFN // tp)):
            t["fc1_weight"][first] = 0.0
            t["fc1_bias"][first] = 8.0
            t["fc2_weight"][:, first] = (-1) ** r * (CANCEL / 8) * column
        out = HIDDEN
    t["grad_out"] = _bf16_exact(torch.randn(SEQ, BATCH, out, generator=g))
    return t


def fp32_oracle(module: str, tp: int) -> dict:
    t = {k: v.double().requires_grad_(k != "grad_out") for k, v in fp32_case_tensors(module, tp).items()}
    if module == "Linear":
        y = F.linear(t["x"], t["weight"], t["bias"])
    else:
        h = F.layer_norm(t["x"], (HIDDEN,), t["layer_norm_weight"], t["layer_norm_bias"], EPS)
        a = F.gelu(F.linear(h, t["fc1_weight"], t["fc1_bias"]), approximate="tanh")
        y = F.linear(a, t["fc2_weight"], t["fc2_bias"])
    y.backward(t["grad_out"])
    found = {"y": y.detach(), "dx": t["x"].grad}
    found.update({k: v.grad for k, v in t.items() if k not in ("x", "grad_out")})
    return found


def _fp32_layouts(module: str, sp: bool) -> dict:
    split0 = ("split", 0) if sp else ("same",)
    if module == "Linear":
        return {"x": ("split", 2), "y": split0, "weight": ("split", 1), "bias": ("sum",) if sp else ("same",)}
    replicated = ("sum",) if sp else ("same",)
    return {"x": split0, "y": split0, "layer_norm_weight": replicated, "layer_norm_bias": replicated,
            "fc1_weight": ("split", 0), "fc1_bias": ("split", 0), "fc2_weight": ("split", 1),
            "fc2_bias": replicated}


def _fp32_rank(ctx):
    import transformer_engine.pytorch as te

    import megapatch
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    groups = _groups(ctx.rank)
    found = {}
    for mode in ("native", "fp32"):
        megapatch.disable()
        # strict=False only for the megatron-core patch, whose surface check refuses torch 2.14's
        # C-level Function.apply; the TE patch's state is returned and asserted
        megapatch.enable(tp_reduce_dtype=mode, strict=False)
        state = megapatch.status().patch("tp_reduce.transformer_engine").state
        for tp in (2, 4):
            group, tp_rank = groups[tp]
            for module in ("Linear", "LayerNormMLP"):
                for sp in (False, True):
                    layouts = _fp32_layouts(module, sp)
                    full = fp32_case_tensors(module, tp)
                    with te_cpu_runtime() as calls:
                        start = len(calls)
                        common = dict(params_dtype=BF16, device="cpu", tp_group=group, tp_size=tp,
                                      sequence_parallel=sp)
                        if module == "Linear":
                            layer = te.Linear(HIDDEN, OUT, bias=True, parallel_mode="row", **common)
                        else:
                            layer = te.LayerNormMLP(HIDDEN, FFN, bias=True, eps=EPS, set_parallel_mode=True,
                                                    **common)
                        with torch.no_grad():
                            for name, param in layer.named_parameters():
                                param.copy_(shard(full[name], _fp32_layouts(module, False)[name], tp, tp_rank))
                        x = shard(full["x"], layouts["x"], tp, tp_rank).to(BF16).requires_grad_()
                        y = layer(x)
                        y.backward(shard(full["grad_out"], layouts["y"], tp, tp_rank).to(BF16))
                        fprop_fp32 = [c for c in calls[start:] if c.startswith("generic_gemm TN")]
                    result = {"y": y.detach().float(), "dx": x.grad.float(), "y_dtype": str(y.dtype),
                              "gemms": fprop_fp32, "state": state}
                    result.update({name: p.grad.float() for name, p in layer.named_parameters()})
                    found[(mode, module, tp, sp)] = result
    megapatch.disable()
    return found


@pytest.fixture(scope="module")
def fp32_runs():
    return run_ranks(_fp32_rank, WORLD, init_megatron=False, timeout=300)


def _fp32_assembled(runs, mode, module, tp, sp):
    layouts = _fp32_layouts(module, sp)
    per_rank = [runs[r][(mode, module, tp, sp)] for r in range(tp)]
    names = [n for n in per_rank[0] if n not in ("y_dtype", "gemms", "state")]
    layouts["dx"] = layouts["x"]
    return {n: unshard([p[n] for p in per_rank], layouts[n]) for n in names}


FP32_LAYOUTS = [(module, tp, sp) for module in ("Linear", "LayerNormMLP") for tp in (2, 4) for sp in (False, True)]


@pytest.mark.parametrize("module, tp, sp", FP32_LAYOUTS,
                         ids=[f"{m}-tp{tp}{'-sp' if sp else ''}" for m, tp, sp in FP32_LAYOUTS])
def test_fp32_row_parallel_forward_is_rounded_once_where_native_loses_the_cancelled_part(fp32_runs, module, tp, sp):
    want = fp32_oracle(module, tp)
    native = _fp32_assembled(fp32_runs, "native", module, tp, sp)
    fp32 = _fp32_assembled(fp32_runs, "fp32", module, tp, sp)
    rank0 = fp32_runs[0][("fp32", module, tp, sp)]
    assert rank0["state"] == "active" and rank0["y_dtype"] == "torch.bfloat16"
    err_native, err_fp32 = normalized_error(native["y"], want["y"]), normalized_error(fp32["y"], want["y"])
    # the patch is on the path: the outputs differ, and by what the oracle says they should
    assert not torch.equal(native["y"], fp32["y"])
    assert err_fp32 * 8 < err_native, (err_fp32, err_native)
    if module == "Linear":
        # one GEMM, its FP32 accumulator reduced in FP32, one rounding: within half a BF16 spacing of
        # the oracle, plus FP32 summation's own error (the textbook bound: n 2^-24 times the sum of
        # the terms' magnitudes, n = HIDDEN products and tp partials): what is left of the cancelled part
        full = fp32_case_tensors(module, tp)
        fp32_slack = (HIDDEN + tp) * 2.0 ** -24 * (full["x"].abs() @ full["weight"].abs().t()).double()
        spacing = torch.exp2(torch.floor(torch.log2(want["y"].abs().clamp_min(1e-30))) - 7)
        excess = (fp32["y"].double() - want["y"]).abs() - (0.5 * spacing + fp32_slack)
        assert float(excess.max()) <= 0, float(excess.max())
        assert float(((native["y"].double() - want["y"]).abs() - (0.5 * spacing + fp32_slack)).max()) > 0
    # the backward: weight and input gradients no worse than native, within BF16 rounding of the oracle
    for name in want:
        if name == "y":
            continue
        assert normalized_error(fp32[name], want[name]) <= TOLERANCE, name


def test_fp32_figures(fp32_runs, capsys):
    """The figures docs/te.md quotes (printed with -s): the forward output's normalized error
    against the FP32 oracle, native vs fp32."""
    lines = []
    for module, tp, sp in FP32_LAYOUTS:
        want = fp32_oracle(module, tp)["y"]
        errs = [normalized_error(_fp32_assembled(fp32_runs, mode, module, tp, sp)["y"], want)
                for mode in ("native", "fp32")]
        lines.append(f"{module:12s} tp={tp} sp={int(sp)}  native {errs[0]:.3e}  fp32 {errs[1]:.3e}")
        assert errs[1] < errs[0]
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# -- megatron-core's TE wrapper --------------------------------------------------------------------

def _mcore_rank(ctx):
    from megatron.core.extensions.transformer_engine import TERowParallelLinear
    from megatron.core.transformer import TransformerConfig

    import megapatch
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    found = {}
    for mode in ("native", "fp32"):
        megapatch.disable()
        megapatch.enable(tp_reduce_dtype=mode, strict=False)  # strict=False: see _fp32_rank
        for sp in (False, True):
            layouts = _fp32_layouts("Linear", sp)
            full = fp32_case_tensors("Linear", ctx.tp_size)
            with te_cpu_runtime():
                config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                                           params_dtype=BF16, bf16=True, use_cpu_initialization=True,
                                           tensor_model_parallel_size=ctx.tp_size, sequence_parallel=sp)
                layer = TERowParallelLinear(HIDDEN, OUT, config=config, init_method=torch.nn.init.zeros_,
                                            bias=True, input_is_parallel=True, skip_bias_add=False,
                                            is_expert=False)
                with torch.no_grad():
                    for name, param in layer.named_parameters():
                        param.copy_(shard(full[name], _fp32_layouts("Linear", False)[name], ctx.tp_size, ctx.tp_rank))
                x = shard(full["x"], layouts["x"], ctx.tp_size, ctx.tp_rank).to(BF16).requires_grad_()
                y, _ = layer(x)
                y.backward(shard(full["grad_out"], layouts["y"], ctx.tp_size, ctx.tp_rank).to(BF16))
            result = {"y": y.detach().float(), "dx": x.grad.float()}
            result.update({name: p.grad.float() for name, p in layer.named_parameters()})
            found[(mode, "Linear", ctx.tp_size, sp)] = result
    megapatch.disable()
    return found


@pytest.fixture(scope="module")
def mcore_runs():
    return run_ranks(_mcore_rank, 2, tp=2, timeout=300)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_megatron_core_te_row_parallel_linear_under_fp32(mcore_runs, sp):
    """megatron-core's TERowParallelLinear (a te.Linear built from a TransformerConfig) constructs and
    runs on CPU through the runtime; under fp32 its forward is the oracle's, natively it is not."""
    runs = mcore_runs
    want = fp32_oracle("Linear", 2)
    native = _fp32_assembled(runs, "native", "Linear", 2, sp)
    fp32 = _fp32_assembled(runs, "fp32", "Linear", 2, sp)
    err_native, err_fp32 = normalized_error(native["y"], want["y"]), normalized_error(fp32["y"], want["y"])
    assert err_fp32 * 8 < err_native, (err_fp32, err_native)
    for name in want:
        assert normalized_error(fp32[name], want[name]) <= TOLERANCE, name


# -- 4. a Qwen3-MoE-shaped model from megatron-core's TE spec: TE attention and TE experts ----------

MOE_LAYOUTS = ((1, 1), (2, 1), (4, 1), (2, 2))  # (TP, EP); expert TP = TP
MOE_MODES = ("native", "fp32")
MOE_SPECS = ("te", "te-grouped")  # sequential TE experts; grouped-GEMM experts (TEGroupedMLP)


def _te_moe_rank(ctx, ep, spec):
    """The model (``moe_tiny``: SwiGLU TE experts, alltoall dispatcher, QK RMSNorm, GQA, RoPE) from
    ``get_gpt_layer_with_transformer_engine_spec`` run natively and under ``tp_reduce_dtype='fp32'``:
    logits, expert choices, loss and gradients, and the TE kernels called."""
    from megapatch.testing.scenarios import moe_tiny
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    with te_cpu_runtime() as calls:
        found = moe_tiny.moe_forward(ctx, MOE_MODES, "alltoall", ep, grads=True, spec=spec)
    if found is not None:
        found["kernels"] = sorted(set(calls))
    return found


def _te_moe_reference(ctx, spec):
    from megapatch.testing.scenarios import moe_tiny
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    with te_cpu_runtime():  # the TE model is built for its weights; the FP32 run is the local spec's
        return moe_tiny.fp32_reference(ctx, spec=spec)


@pytest.fixture(scope="module")
def moe_runs():
    runs = {}
    for spec in MOE_SPECS:
        runs.update({(spec, tp, ep): run_ranks(_te_moe_rank, world_size=tp * ep, tp=tp, timeout=300,
                                               args=(ep, spec))[0] for tp, ep in MOE_LAYOUTS})
        runs[(spec, "reference")] = run_ranks(_te_moe_reference, world_size=1, tp=1, timeout=300, args=(spec,))[0]
    return runs


def _relative(a, reference):
    return ((a.double() - reference.double()).norm() / reference.double().norm()).item()


def _kl(p_logits, q_logits):
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def _flips(routing, reference):
    return sum(int((a != b).any(-1).sum()) for a, b in zip(routing, reference))


@pytest.mark.parametrize("spec", MOE_SPECS)
def test_te_moe_model_runs_te_attention_and_te_experts_on_the_runtime(moe_runs, spec):
    """Natively every GEMM, norm and softmax is TE's (through the runtime): TE's DotProductAttention
    takes its unfused backend (no fused backend reported), its masked softmax runs forward and
    backward, grouped experts run TE's grouped GEMM; the logits are within BF16 error of the same
    weights run in FP32 through the local spec's layers (an independent path)."""
    kernels = moe_runs[(spec, 1, 1)]["kernels"]
    assert {"get_fused_attn_backend", "scaled_masked_softmax_forward", "scaled_masked_softmax_backward",
            "rmsnorm_fwd", "rmsnorm_bwd", "generic_gemm TN", "generic_gemm NN grad",
            "generic_gemm NT grad"} <= set(kernels), kernels
    assert ("te_general_grouped_gemm" in kernels) == (spec == "te-grouped"), kernels
    native = moe_runs[(spec, 1, 1)]["native"]
    assert native["dtype"] == "torch.bfloat16" and len(native["routing"]) == 2
    assert _relative(native["logits"], moe_runs[(spec, "reference")]["logits"]) < 2e-2


@pytest.mark.parametrize("spec", MOE_SPECS)
@pytest.mark.parametrize("tp, ep", MOE_LAYOUTS[1:])
def test_fp32_te_experts_make_tp_and_ep_sizes_agree_and_keep_every_expert_choice(moe_runs, spec, tp, ep):
    """Under fp32 the TE experts' fc2 (a TERowParallelLinear per expert, or the grouped GEMM's
    GroupedLinear) hands its FP32 accumulator to the MoE layer's FP32 sums (the layer refuses a BF16
    expert output): every token routed as at TP 1, KL(TP1 || layout) at least 20x below native's. The
    error against the FP32 reference stays at TP 1's BF16 error: FP32 sums make layouts agree, they do
    not make BF16 more accurate than TP 1 is."""
    base, here, reference = moe_runs[(spec, 1, 1)], moe_runs[(spec, tp, ep)], moe_runs[(spec, "reference")]
    fp32, native = here["fp32"], here["native"]
    assert fp32["dtype"] == "torch.bfloat16" and "refused" not in fp32, fp32.get("refused")
    assert {"tp_reduce.moe", "tp_reduce.transformer_engine"} <= set(fp32["active"]), fp32["active"]
    assert _flips(fp32["routing"], base["fp32"]["routing"]) == 0
    assert _kl(base["fp32"]["logits"], fp32["logits"]) * 20 <= _kl(base["native"]["logits"], native["logits"])
    tp1_error = _relative(base["native"]["logits"], reference["logits"])
    assert _relative(fp32["logits"], reference["logits"]) == pytest.approx(tp1_error, rel=0.05)
    # the gradients (this rank's experts at EP 2) move less from TP 1's than native ones do
    common = [name for name in fp32["grads"] if name in base["fp32"]["grads"]
              and fp32["grads"][name].shape == base["fp32"]["grads"][name].shape]
    assert len(common) >= 15  # (grouped experts: TE gives their weights no TP attributes, not gathered)

    def drift(mode):
        return sum(_relative(here[mode]["grads"][n], base[mode]["grads"][n]) for n in common)

    assert drift("fp32") < drift("native"), (drift("fp32"), drift("native"))


@pytest.mark.parametrize("spec", MOE_SPECS)
def test_precondition_natively_a_tp_change_flips_expert_choices_of_this_model(moe_runs, spec):
    assert sum(_flips(moe_runs[(spec, *layout)]["native"]["routing"], moe_runs[(spec, 1, 1)]["native"]["routing"])
               for layout in MOE_LAYOUTS[1:]) > 0


@pytest.mark.parametrize("mask", ["causal", "padding"])
def test_te_dot_product_attention_runs_its_unfused_backend_against_an_fp64_oracle(mask):
    """TE's DotProductAttention (GQA: 4 heads in 2 groups) on the runtime: forward and backward
    within BF16 error of plain float64 attention with the groups repeated, position-dependent inputs;
    the masked softmax kernels are the runtime's (a padding mask: the last 5 tokens of batch 1, queries
    and keys, as TE reads a [b, 1, 1, s] self-attention mask)."""
    import transformer_engine.pytorch as te

    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    s, b, h, g, d = 24, 2, 4, 2, 8
    ramp = torch.linspace(-1, 1, s)[:, None, None, None]
    torch.manual_seed(3)
    q, k, v = ((torch.randn(s, b, n, d) + ramp * (i + 1)).to(BF16).requires_grad_()
               for i, n in enumerate((h, g, g)))
    grad = torch.randn(s, b, h * d).to(BF16)
    pad = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    pad[1, ..., -5:] = True
    with te_cpu_runtime() as calls:
        attention = te.DotProductAttention(h, d, num_gqa_groups=g, attn_mask_type=mask, attention_dropout=0.0)
        out = attention(q, k, v, attention_mask=pad if mask == "padding" else None)
        out.backward(grad)
    assert {"get_fused_attn_backend", "scaled_masked_softmax_forward", "scaled_masked_softmax_backward"} <= set(calls) \
        or {"get_fused_attn_backend", "scaled_softmax_forward", "scaled_softmax_backward"} <= set(calls), calls

    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", qd, kd.repeat_interleave(h // g, 2)) / d ** 0.5
    hidden = (torch.triu(torch.ones(s, s, dtype=torch.bool), 1) if mask == "causal"
              else pad.expand(b, 1, s, s))
    # a padding mask in self-attention pads queries too (TE: their rows give 0): the oracle keeps the rest
    valid = (~pad[:, 0, 0, :]).t()[..., None].double() if mask == "padding" else torch.ones(s, b, 1).double()
    want = torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(hidden, float("-inf")).softmax(-1),
                        vd.repeat_interleave(h // g, 2)).reshape(s, b, h * d) * valid
    want.backward(grad.double())
    assert normalized_error(out, want) < 1e-2
    for got, ref in ((q, qd), (k, kd), (v, vd)):
        assert normalized_error(got.grad, ref.grad) < 2e-2


def test_the_gpu_checks_te_section_dry_run_passes(tmp_path):
    """tools/gpu_check.py's te_layers section (TE-spec Llama at TP 1/2/4 natively, under fp32 and under
    tp_invariant; on a GPU with TE's own kernels) on CPU through the runtime: it cannot rot."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "gpu_check.py"), "--dry-run", "--sections",
                           "te_layers", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["te_layers"]
    assert section["ok"] and "skipped" not in section, section
    assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear", "TEDotProductAttention"} <= set(section["modules"])
    rows = {(r["mode"], r["tp"]): r for r in section["rows"]}
    assert all(rows[("tp_invariant", tp)]["bit_identical_to_tp1"] for tp in (2, 4))
    assert not rows[("native", 4)]["bit_identical_to_tp1"]  # the check can fail
    assert set(section["cost_at_tp1"]) == {"native", "fp32", "tp_invariant"}
    assert "## te_layers: ok" in (tmp_path / "gpu_check.md").read_text()
