"""Fidelity of ``tp_invariant``'s layers (issue 48 item 7): what the mode computes in the dense and MoE
layers and in the dynamic engine's attention, against oracles that are not the mode's code -- an FP64
reference written here, and upstream's own module on the same inputs with the mode off -- within a BF16
bound, at TP 1 and TP 2, over the flags that change each function. One 4-rank job (TP 2 x DP 2, then
TP 1 x DP 4; each data-parallel replica with its own inputs, so a sum over the wrong group shows).

Bounds are in BF16 ulps of the oracle's largest magnitude (``_ulp``): the mode rounds each result once
from FP32, so it stays within an ulp or two, and it must be no worse than twice upstream's own error
plus half an ulp. The trainer's core attention, expert-gradient terms, the loss report and the TE
layers: tests/test_tp_invariant_fidelity.py and tests/test_tp_invariant_fidelity_te.py."""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megapatch.testing import run_ranks
from tests.conftest import bare_module
from tests.test_tp_invariant import _needs_the_mode

H, N, V, EXPERTS, FFN = 64, 48, 96, 8, 32  # hidden, column outputs, vocabulary, experts, expert FFN: W = 8 cuts each
#: sequence parallel -> (sequence, batch); 7 positions divide neither the TP size nor W (no SP there)
SHAPES = {False: (7, 3), True: (16, 2)}


def _ulp(magnitude: float) -> float:
    """A BF16 ulp at ``magnitude`` (8 significant bits); 0 for an all-zero oracle (an unchosen expert)."""
    return 2.0 ** (math.floor(math.log2(magnitude)) - 7) if magnitude else 0.0


def _check(what, mode, exact, ulps, native=None):
    """The mode within ``ulps`` BF16 ulps of the oracle; with upstream's ``native`` result on the same
    inputs, also no worse than twice upstream's error plus half an ulp."""
    ulp, err = _ulp(exact.abs().max().item()), (mode.double() - exact).abs().max().item()
    assert err <= ulps * ulp, f"{what}: the mode is {err / (ulp or 1):.2f} BF16 ulps off the oracle (bound {ulps})"
    if native is not None:
        upstream = (native.double() - exact).abs().max().item()
        assert err <= 2 * upstream + ulp / 2, f"{what}: the mode's error {err:.3g} against upstream's {upstream:.3g}"


def _randn(seed, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _fp64(fn, tensors, grad):
    """``fn`` on FP64 copies of ``tensors``: its output, then each tensor's gradient for ``grad``."""
    leaves = [t.detach().double().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(grad.double())
    return [out.detach()] + [torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for leaf in leaves]


@contextmanager
def _mode(on: bool):
    """The mode on (``_job`` enabled it), or off: its wrappers then pass upstream's calls through."""
    from megapatch.core import options, state

    saved, sources = state.current(), dict(state._sources)
    state.set_current(saved if on else options.NATIVE, sources)
    try:
        yield
    finally:
        state.set_current(saved, sources)


def _part(t, ctx, dim, split=True):
    """This TP rank's part of ``t`` along ``dim`` (a fresh copy; all of it where nothing is split)."""
    return (t.chunk(ctx.tp_size, dim)[ctx.tp_rank] if split else t).clone()


def _tp_sum(t, ctx):
    """A sequence-parallel parameter's gradient summed over TP, as ``finalize_model_grads`` sums it."""
    t = t.clone()
    torch.distributed.all_reduce(t, group=ctx.tp_group)
    return t


def _both(run, exact):
    """``{quantity: (mode, upstream or None, oracle)}`` from ``run(mode)`` for the mode on and off."""
    on, off = run(True), run(False)
    return {k: (v.detach(), None if off is None else off[k].detach(), exact[k]) for k, v in on.items()}


# -- the rank job ------------------------------------------------------------------------------------

def _linear(ctx, bias, sp):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megapatch.testing.models.tiny_gpt import tiny_gpt_config

    (s, b), split = SHAPES[sp], sp and ctx.tp_size > 1
    seed = 100 * ctx.dp_rank + 10 * sp + bias
    x, wc, bc, gy = (_randn(seed, s, b, H), _randn(seed + 1, N, H, scale=H ** -0.5), _randn(seed + 2, N),
                     _randn(seed + 3, s, b, N))
    z, wr, br, gz = (_randn(seed + 4, s, b, N), _randn(seed + 5, H, N, scale=N ** -0.5), _randn(seed + 6, H),
                     _randn(seed + 7, s, b, H))

    def run(mode):
        with _mode(mode):
            config = tiny_gpt_config(ctx.tp_size, sequence_parallel=split)
            col = ColumnParallelLinear(H, N, config=config, init_method=torch.nn.init.zeros_, bias=bias,
                                       gather_output=False)
            row = RowParallelLinear(N, H, config=config, init_method=torch.nn.init.zeros_, bias=bias,
                                    input_is_parallel=True, skip_bias_add=False)
            with torch.no_grad():
                col.weight.copy_(_part(wc, ctx, 0))
                row.weight.copy_(_part(wr, ctx, 1))
                if bias:
                    col.bias.copy_(_part(bc, ctx, 0))
                    row.bias.copy_(br)
            xi, zi = _part(x, ctx, 0, split).requires_grad_(), _part(z, ctx, 2).requires_grad_()
            y, _ = col(xi)
            y.backward(_part(gy, ctx, 2))
            o, _ = row(zi)
            o.backward(_part(gz, ctx, 0, split))
            found = {"column output": y, "column dgrad": xi.grad, "column wgrad": col.weight.grad,
                     "row output": o, "row dgrad": zi.grad, "row wgrad": row.weight.grad}
            if bias:  # with SP a row bias is a sequence-parallel parameter
                found.update({"column bias grad": col.bias.grad,
                              "row bias grad": _tp_sum(row.bias.grad, ctx) if split else row.bias.grad})
            return found

    cy, cx, cw, cb = _fp64(lambda x, w, b_: x @ w.t() + (b_ if bias else 0), (x, wc, bc), gy)
    ro, rz, rw, rb = _fp64(lambda z, w, b_: z @ w.t() + (b_ if bias else 0), (z, wr, br), gz)
    return _both(run, {
        "column output": _part(cy, ctx, 2), "column dgrad": _part(cx, ctx, 0, split), "column wgrad": _part(cw, ctx, 0),
        "column bias grad": _part(cb, ctx, 0), "row output": _part(ro, ctx, 0, split), "row dgrad": _part(rz, ctx, 2),
        "row wgrad": _part(rw, ctx, 1), "row bias grad": rb})


NORMS = (("LayerNorm", False), ("RMSNorm", False), ("FusedLayerNorm", False), ("FusedLayerNorm", True))


def _norm(ctx, kind, zero_centred, sp):
    from megatron.core.fusions import fused_layer_norm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megapatch.patches.tp_invariant import _norms
    from megapatch.testing.models.tiny_gpt import tiny_gpt_config

    (s, b), split = SHAPES[sp], sp and ctx.tp_size > 1
    seed = 1000 + 100 * ctx.dp_rank + 10 * sp + NORMS.index((kind, zero_centred))
    x, grad = _randn(seed, s, b, H, scale=2.0) + _randn(seed + 1, H), _randn(seed + 2, s, b, H)
    weight, bias = _randn(seed + 3, H, scale=0.5) + (0 if zero_centred else 1), _randn(seed + 4, H, scale=0.5)

    def run(mode):
        if kind == "FusedLayerNorm" and not mode:
            return None  # upstream's needs apex: FP64 alone is its oracle
        with _mode(mode):
            config = tiny_gpt_config(ctx.tp_size, sequence_parallel=split, layernorm_zero_centered_gamma=zero_centred,
                                     normalization="RMSNorm" if kind == "RMSNorm" else "LayerNorm")
            if kind == "FusedLayerNorm":
                saved, fused_layer_norm.HAVE_FUSED_LAYER_NORM = fused_layer_norm.HAVE_FUSED_LAYER_NORM, True
                try:
                    norm = fused_layer_norm.FusedLayerNorm(config, H, eps=1e-5)
                finally:
                    fused_layer_norm.HAVE_FUSED_LAYER_NORM = saved
            else:
                norm = WrappedTorchNorm(config, H, eps=1e-5)
            norm = norm.to(torch.bfloat16)
            has_bias = getattr(norm, "bias", None) is not None
            with torch.no_grad():
                norm.weight.copy_(weight)
                if has_bias:
                    norm.bias.copy_(bias)
            if mode:  # what the mode's construction does to a block's norms
                _norms.token_blocked_norm(norm, False, ctx.tp_group)
            xi = _part(x, ctx, 0, split).requires_grad_()
            out = norm(xi)
            out.backward(_part(grad, ctx, 0, split))
            params = {"weight grad": norm.weight, **({"bias grad": norm.bias} if has_bias else {})}
            return {"output": out, "input grad": xi.grad,
                    **{k: _tp_sum(p.grad, ctx) if split else p.grad for k, p in params.items()}}

    def reference(x, w, b_):
        if kind == "RMSNorm":
            return x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-5) * w
        normed = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
        return normed * (w + 1 if zero_centred else w) + b_

    out, gx, gw, gb = _fp64(reference, (x, weight, bias), grad)
    return _both(run, {"output": _part(out, ctx, 0, split), "input grad": _part(gx, ctx, 0, split),
                       "weight grad": gw, "bias grad": gb})


def _cross_entropy(ctx, smoothing):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    s, b = SHAPES[False]
    seed = 2000 + 100 * ctx.dp_rank + int(smoothing * 10)
    logits, grad = _randn(seed, s, b, V, scale=3.0), _randn(seed + 1, s, b, dtype=torch.float32)
    target = torch.randint(0, V, (s, b), generator=torch.Generator().manual_seed(seed + 2))

    def run(mode):
        with _mode(mode):
            local = _part(logits, ctx, 2).requires_grad_()
            loss = vocab_parallel_cross_entropy(local, target, smoothing)
            loss.backward(grad)
            return {"loss": loss, "logits grad": local.grad}

    def reference(logits):  # upstream's smoothing: alpha K / (K - 1) of the mean log-prob over the vocabulary
        logp = logits.log_softmax(-1)
        alpha = smoothing * V / (V - 1)
        return -(1 - alpha) * logp.gather(-1, target[..., None])[..., 0] - alpha * logp.mean(-1)

    loss, glogits = _fp64(reference, (logits,), grad)
    return _both(run, {"loss": loss, "logits grad": _part(glogits, ctx, 2)})


def _refused_smoothing(ctx, smoothing):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megapatch.core.errors import UnsupportedConfigurationError

    s, b = SHAPES[False]
    logits = _part(_randn(7, s, b, V, scale=3.0), ctx, 2)
    target = torch.randint(0, V, (s, b), generator=torch.Generator().manual_seed(8))
    with _mode(False):
        upstream = vocab_parallel_cross_entropy(logits, target, smoothing)  # mode off: upstream's, unrefused
    with _mode(True):
        try:
            vocab_parallel_cross_entropy(logits, target, smoothing)
        except UnsupportedConfigurationError as refused:
            return {"message": str(refused), "upstream finite": bool(upstream.isfinite().all())}
    return {"message": None, "upstream finite": bool(upstream.isfinite().all())}


ROUTERS = {  # score function, pre-softmax, top-k, group-limited routing, scaling, expert bias, aux losses
    "softmax top-2, aux and z losses": dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_router_dtype="fp32"),
    "pre-softmax top-3": dict(moe_router_topk=3, moe_router_pre_softmax=True, moe_aux_loss_coeff=1e-2,
                              moe_router_dtype="fp32"),
    "sigmoid, expert bias, group-limited, scaled, seq aux loss": dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32"),
    "softmax top-2, BF16 logits": dict(moe_aux_loss_coeff=1e-2),
}


def _router(ctx, name):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from megapatch.testing.scenarios import moe_tiny

    (s, b), split = SHAPES[True], ctx.tp_size > 1
    seed = 3000 + 100 * ctx.dp_rank + list(ROUTERS).index(name)
    x, weight = _randn(seed, s, b, H), _randn(seed + 1, EXPERTS, H, scale=H ** -0.5)
    grad = _randn(seed + 2, s, b, EXPERTS)
    runs = {}
    for mode in (True, False):
        with _mode(mode):
            config = moe_tiny.qwen3_moe_config(ctx.tp_size, "allgather", **ROUTERS[name])
            router = TopKRouter(config, pg_collection=get_default_pg_collection()).train()
            with torch.no_grad():
                router.weight.copy_(weight)
                if router.expert_bias is not None:
                    router.expert_bias.copy_(_randn(seed + 3, EXPERTS, scale=0.2, dtype=torch.float32))
            xi = _part(x, ctx, 0, split).requires_grad_()
            probs, routing_map = router(xi)
            probs.backward(_part(grad, ctx, 0, split).view(-1, EXPERTS))
            runs[mode] = {"probs": probs.detach(), "routing map": routing_map, "input grad": xi.grad,
                          "weight grad": _tp_sum(router.weight.grad, ctx)}
    return {"mode": runs[True], "native": runs[False],
            "fp64 logits": _part(x, ctx, 0, split).double().view(-1, H) @ weight.double().t()}


MOES = {  # the experts' flags: gated or not, top-k, probabilities on the input
    "SwiGLU top-2": {},
    "GELU top-2": dict(gated_linear_unit=False, activation_func=F.gelu),
    "top-1, probabilities on the input": dict(moe_router_topk=1, moe_router_pre_softmax=True,
                                              moe_apply_probs_on_input=True),
}


def _moe_reference(config):
    """The MoE layer's function in FP64: top-k of the router's logits; each chosen expert's output times
    the token's probability (the expert run on probability-scaled tokens with probabilities on the input)."""
    k, act, on_input = config.moe_router_topk, config.activation_func, config.moe_apply_probs_on_input

    def layer(x, router, *experts):
        tokens = x.reshape(-1, H)
        logits = tokens @ router.t()
        if config.moe_router_pre_softmax:
            probs, chosen = logits.softmax(-1).topk(k, dim=-1)
        else:
            top, chosen = logits.topk(k, dim=-1)
            probs = top.softmax(-1)
        out = torch.zeros_like(tokens)
        for e in range(EXPERTS):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            p = probs[rows, slot][:, None]
            h = (tokens[rows] * p if on_input else tokens[rows]) @ experts[2 * e].t()
            h = act(h[:, :FFN]) * h[:, FFN:] if config.gated_linear_unit else act(h)
            out = out.index_add(0, rows, h @ experts[2 * e + 1].t() * (1 if on_input else p))
        return out.view_as(x)

    return layer


def _moe(ctx, name):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megapatch.testing.scenarios import moe_tiny

    config = moe_tiny.qwen3_moe_config(ctx.tp_size, "allgather", moe_router_dtype="fp32", **MOES[name])
    glu, split, (s, b) = config.gated_linear_unit, ctx.tp_size > 1, SHAPES[True]

    def data(dp):  # input, gate weight, each expert's fc1 and fc2, output gradient
        seed = 4000 + 100 * dp + 20 * list(MOES).index(name)
        shapes = [(FFN * (1 + glu), H), (H, FFN)] * EXPERTS
        experts = [_randn(seed + 2 + i, *shape, scale=shape[1] ** -0.5) for i, shape in enumerate(shapes)]
        inputs = [_randn(seed, s, b, H), _randn(seed + 1, EXPERTS, H, scale=H ** -0.5), *experts]
        return inputs, _randn(seed + 99, s, b, H)

    def fc_part(e, w):  # a rank's fc1 rows ([gate_r; up_r] for SwiGLU) or fc2 columns
        return torch.cat([_part(h, ctx, 0) for h in w.chunk(1 + glu)]) if e % 2 == 0 else _part(w, ctx, 1)

    (x, gate, *experts), grad = data(ctx.dp_rank)

    def run(mode):
        with _mode(mode):
            layer = build_module(get_gpt_layer_local_spec(num_experts=EXPERTS).submodules.mlp, config=config)
            fcs = [getattr(m, f"linear_fc{i}").weight for m in layer.experts.local_experts for i in (1, 2)]
            with torch.no_grad():
                layer.router.weight.copy_(gate)
                for i, (param, w) in enumerate(zip(fcs, experts)):
                    param.copy_(fc_part(i, w))
            xi = _part(x, ctx, 0, split).requires_grad_()
            out, _ = layer(xi)
            out.backward(_part(grad, ctx, 0, split))
            found = {"output": out, "input grad": xi.grad, "router weight grad": _tp_sum(layer.router.weight.grad, ctx)}
            for i, param in enumerate(fcs):  # summed over the expert-data-parallel replicas, as DDP sums them
                g = param.grad.clone()
                torch.distributed.all_reduce(g, group=parallel_state.get_expert_data_parallel_group())
                found[f"expert {i // 2} fc{i % 2 + 1} wgrad"] = g
            return found

    exact = {}
    for dp in range(ctx.dp_size):  # the expert weights' gradients: every replica's, summed
        tensors, g = data(dp)
        out, gx, ggate, *gexperts = _fp64(_moe_reference(config), tensors, g)
        if dp == ctx.dp_rank:
            exact.update({"output": _part(out, ctx, 0, split), "input grad": _part(gx, ctx, 0, split),
                          "router weight grad": ggate})
        for i, w in enumerate(gexperts):
            key = f"expert {i // 2} fc{i % 2 + 1} wgrad"
            exact[key] = exact.get(key, 0) + fc_part(i, w)
    return _both(run, exact)


def _cases(ctx):
    out = {}
    for bias, sp in ((True, False), (False, False), (True, True)):
        out.update({("linear", f"bias={bias} sp={sp}", k): v for k, v in _linear(ctx, bias, sp).items()})
    for (kind, zero_centred), sp in itertools.product(NORMS, (False, True)):
        out.update({("norm", f"{kind} zero-centred={zero_centred} sp={sp}", k): v
                    for k, v in _norm(ctx, kind, zero_centred, sp).items()})
    for smoothing in (0.0, 0.1):
        if smoothing and ctx.tp_size > 1:  # refused by the mode: the refusal's words, and upstream's loss still runs
            out[("refusal", f"label smoothing {smoothing}")] = _refused_smoothing(ctx, smoothing)
            continue
        out.update({("cross entropy", f"label smoothing {smoothing}", k): v
                    for k, v in _cross_entropy(ctx, smoothing).items()})
    out.update({("router", name): _router(ctx, name) for name in ROUTERS})
    for name in MOES:
        out.update({("experts", name, k): v for k, v in _moe(ctx, name).items()})
    return out


def _job(ctx):
    import megapatch
    from megapatch.testing import reinit_model_parallel

    megapatch.enable(tp_invariant=True)
    found = {"TP 2": _cases(ctx)}  # TP 2 x DP 2
    found["TP 1"] = _cases(reinit_model_parallel(ctx, tp=1))  # TP 1 x DP 4
    megapatch.disable()
    return found


@pytest.fixture(scope="module")
def layers():
    _needs_the_mode()
    ranks = run_ranks(_job, world_size=4, tp=2, timeout=300)
    return {(layout, rank): found[layout] for rank, found in enumerate(ranks) for layout in found}


def _each(layers, part, case=lambda name: True):
    for (layout, rank), found in layers.items():
        for key, value in found.items():
            if key[0] == part and case(key[1]):
                yield f"{layout} rank {rank}, {part} {', '.join(key[1:])}", value


# -- the dense layers, norms and cross entropy -------------------------------------------------------

def test_column_and_row_parallel_layers_compute_the_fp64_linear_map(layers):
    """``ColumnParallelLinear``/``RowParallelLinear``: forward, input and weight (and bias) gradients, bias on
    and off, sequence parallel at TP 2, 7 positions that TP 2 does not divide: within one BF16 ulp of FP64
    (two for a row-parallel output with bias, which upstream adds after the rounded sum)."""
    for what, (mode, native, exact) in _each(layers, "linear"):
        _check(what, mode, exact, 2 if "row output" in what and "bias=True" in what else 1, native)
        _check(what + " (upstream)", native, exact, 8)  # the oracle is upstream's function


def test_norms_compute_the_fp64_norm_and_its_gradients_with_zero_centred_gamma(layers):
    """torch's LayerNorm and RMSNorm (the local spec without apex) and megatron-core's ``FusedLayerNorm``
    with and without ``layernorm_zero_centered_gamma`` (``--apply-layernorm-1p``): output, input gradient,
    weight and bias gradients (with sequence parallelism: over both TP ranks' tokens) within two BF16 ulps
    of FP64; ``1 + gamma`` is rounded to BF16 before use, by upstream as by the mode."""
    for what, (mode, native, exact) in _each(layers, "norm"):
        _check(what, mode, exact, 2, native)
        if native is not None:
            _check(what + " (upstream)", native, exact, 8)


def test_vocab_parallel_cross_entropy_is_the_fp64_log_softmax_loss(layers):
    """Loss (FP32: within 1/64 BF16 ulp) and logits gradient (BF16 logits, a vocabulary of 96 split over
    TP 2), without label smoothing, and with it at TP 1 (at TP 2: the test below)."""
    for what, (mode, native, exact) in _each(layers, "cross entropy"):
        if what.startswith("TP 1") or "smoothing 0.0" in what:
            _check(what, mode, exact, 1 / 64 if what.endswith("loss") else 1, native)


def test_label_smoothing_at_tp2_is_refused_naming_the_value_and_the_tp_size(layers):
    """Upstream smooths with the mean log-prob over each rank's vocabulary shard, another function of
    the logits at every TP size and on every TP rank: the mode refuses it at TP > 1 (at TP 1 it runs
    and is the FP64 smoothed loss, above); with the mode off upstream's call runs."""
    refusals = {(layout, rank): found[("refusal", "label smoothing 0.1")] for (layout, rank), found in layers.items()
                if ("refusal", "label smoothing 0.1") in found}
    assert refusals and all(layout.startswith("TP 2") for layout, _ in refusals), sorted(layers)
    for where, found in refusals.items():
        assert found["upstream finite"], where
        assert found["message"] and "label_smoothing=0.1" in found["message"], (where, found)
        assert "at TP size 2" in found["message"] and "tp_invariant=True does not support" in found["message"], found


# -- the MoE router and the experts' probabilities ----------------------------------------------------

def test_the_router_chooses_and_weighs_experts_as_upstreams_router(layers):
    """megatron-core's ``TopKRouter`` in training (gating GEMM, top-k, aux, sequence-aux and z losses)
    with the mode on and off on the same tokens, at TP 1 and TP 2 (sequence parallel): the same experts
    for every token (but where the FP64 logits nearly tie, with BF16 router logits), the same
    probabilities, and input and gate-weight gradients (aux-loss gradients included) within BF16 ulps."""
    for (layout, rank), found in layers.items():
        for key, run in ((k, v) for k, v in found.items() if k[0] == "router"):
            what, mode, native = f"{layout} rank {rank}, router {key[1]}", run["mode"], run["native"]
            differ = (mode["routing map"] != native["routing map"]).any(-1)
            top = run["fp64 logits"].sort(-1, descending=True).values
            k = int(native["routing map"].sum(-1).max())
            near_tie = (top[:, k - 1] - top[:, k]) < 2 ** -6 * top.abs().max()
            assert not (differ & ~near_tie).any(), f"{what}: other experts for tokens {differ.nonzero().tolist()}"
            assert differ.sum() <= differ.numel() // 16, what
            _check(what + " probs", mode["probs"][~differ], native["probs"][~differ].double(),
                   1 if "BF16" in key[1] else 1 / 64)
            if not differ.any():
                for name in ("input grad", "weight grad"):
                    _check(f"{what} {name}", mode[name], native[name].double(), 2)


def test_the_moe_layer_weighs_each_experts_output_by_its_routing_probability(layers):
    """A local-spec ``MoELayer`` (router, allgather dispatcher, ``SequentialMLP`` experts, expert TP = TP,
    sequence parallel at TP 2): output, input gradient, gate-weight gradient and every expert's fc1/fc2
    weight gradient (summed over the expert-data-parallel replicas, as DDP sums them) against an FP64
    mixture of experts and against upstream's layer; SwiGLU and GELU experts, top-2 and top-1 with
    ``moe_apply_probs_on_input``."""
    for what, (mode, native, exact) in _each(layers, "experts"):
        _check(what, mode, exact, 4, native)
        _check(what + " (upstream)", native, exact, 8)


# -- the dynamic engine's paged attention (per head: no ranks) ---------------------------------------

HEADS, GROUPS, DIM, PAGE = 4, 2, 64, 16


def _engine(q, keys, values, q_counts, decode, scale=None):
    """``Attention.flash_decode_and_prefill`` through the mode's wrapper (upstream's call, flash-attn stood
    in for on CPU, where the mode is off). Request i: ``len(keys[i])`` cached positions, paged out of
    order, and its ``q_counts[i]`` last positions' queries in ``q`` [tokens, heads, dim], then padding."""
    from megatron.core.transformer import attention as attention_module

    from megapatch.patches.tp_invariant import engine_attention as patch
    from megapatch.testing.stand_ins import dynamic_inference_compat as stand_in

    pages, lengths = -(-max(map(len, keys)) // PAGE), [len(k) for k in keys]
    k_cache = torch.zeros(len(keys) * pages, PAGE, *keys[0].shape[1:], dtype=q.dtype)
    v_cache = torch.zeros_like(k_cache)
    table = torch.randperm(len(keys) * pages, generator=torch.Generator().manual_seed(0)).view(len(keys), pages)
    for i, (k, v) in enumerate(zip(keys, values)):
        for pos in range(len(k)):
            k_cache[table[i, pos // PAGE], pos % PAGE], v_cache[table[i, pos // PAGE], pos % PAGE] = k[pos], v[pos]
    owner = bare_module(attention_module.SelfAttention)
    owner.config = SimpleNamespace(multi_latent_attention=False)
    owner.training, owner.batch_invariant_mode, owner.softmax_scale = False, False, scale
    cu = [torch.tensor([0, *itertools.accumulate(c)], dtype=torch.int32) for c in (q_counts, lengths)]
    saved = [getattr(attention_module, f, None) for f in ("flash_attn_varlen_func", "flash_attn_with_kvcache")]
    attention_module.flash_attn_varlen_func = stand_in._varlen(None)
    attention_module.flash_attn_with_kvcache = stand_in._with_kvcache(None)
    try:
        upstream = attention_module.Attention.flash_decode_and_prefill.__get__(owner)
        args = (q.unsqueeze(1), k_cache, v_cache, max(q_counts), max(lengths), *((None, None) if decode else cu),
                torch.tensor(lengths, dtype=torch.int32), table, decode)
        return patch._engine_attention(upstream, owner, args, {})[:, 0]
    finally:
        attention_module.flash_attn_varlen_func, attention_module.flash_attn_with_kvcache = saved


def _fp64_engine(q, keys, values, q_counts, scale):
    """Each request's queries (its last positions) over its keys so far, softmax in FP64; padding rows 0."""
    out, start = torch.zeros(q.shape, dtype=torch.float64), 0
    for rows, k, v in zip(q_counts, keys, values):
        if rows and len(k):
            kd, vd = (t.double().repeat_interleave(q.shape[1] // t.shape[1], dim=1).transpose(0, 1) for t in (k, v))
            scores = q[start:start + rows].double().transpose(0, 1) @ kd.transpose(1, 2) * scale
            position = torch.arange(rows)[:, None] + len(k) - rows
            scores = scores.masked_fill(torch.arange(len(k))[None] > position, float("-inf"))
            out[start:start + rows] = (scores.softmax(-1) @ vd).transpose(0, 1)
        start += rows
    return out


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_engine_attention_is_fp64_paged_causal_attention_at_tp1_and_on_a_tp2_ranks_heads(monkeypatch, step):
    """The dynamic engine's paged attention under the mode: a decode step (one query per request over 70,
    1 and 33 cached keys -- past one 64-key block -- and a padded slot without keys) and a prefill step
    (5, 1 and 3 queries, the last request its whole prompt, two padding rows, the layer's own
    ``softmax_scale``): every row within two BF16 ulps of FP64 causal attention over the request's keys
    and no worse than upstream's call, padding zero; at TP 1 (4 heads, 2 KV groups) and on a TP-2 rank's
    heads (2 heads, 1 group)."""
    from megapatch.core import options, state

    lengths, q_counts = ((70, 1, 0, 33), (1, 1, 1, 1)) if step == "decode" else ((70, 17, 3), (5, 1, 3))
    gen = torch.Generator().manual_seed(11)
    keys = [torch.randn(n, GROUPS, DIM, generator=gen).bfloat16() for n in lengths]
    values = [torch.randn(n, GROUPS, DIM, generator=gen).bfloat16() for n in lengths]
    q = torch.randn(sum(q_counts) + (0 if step == "decode" else 2), HEADS, DIM, generator=gen).bfloat16()
    scale = DIM ** -0.5 if step == "decode" else 0.7 * DIM ** -0.5  # decode: upstream passes flash-attn none
    for heads, groups in ((slice(0, 4), slice(0, 2)), (slice(2, 4), slice(1, 2))):  # TP 1; TP 2's rank 1
        ks, vs, qs = [k[:, groups] for k in keys], [v[:, groups] for v in values], q[:, heads].contiguous()
        got = {}
        for mode in (True, False):
            monkeypatch.setattr(state, "_current", options.Settings(tp_invariant=mode))
            got[mode] = _engine(qs, ks, vs, q_counts, step == "decode", None if step == "decode" else scale)
        assert not got[True].isnan().any()
        _check(f"{step}, heads {heads}", got[True], _fp64_engine(qs, ks, vs, q_counts, scale), 2, got[False])
        padding = got[True][2] if step == "decode" else got[True][sum(q_counts):]  # no keys; no request
        assert not padding.any()
