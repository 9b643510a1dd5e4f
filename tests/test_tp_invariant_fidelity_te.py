"""Fidelity of ``tp_invariant`` on Transformer Engine layers (issue 48 item 7): the mode's fused norm
+ linear against TE's own ``LayerNormLinear`` arithmetic with the mode off (TE 2.20.2's module path run
by the TE CPU runtime, ``megapatch.testing.stand_ins.te_runtime``) and against an FP64 reference,
within a BF16 bound, over the flags that change the norm: LayerNorm / RMSNorm, zero-centred gamma
(Megatron-LM's ``--apply-layernorm-1p``), at TP 1 and TP 2.

Kills the audit survivor N24 (the fused norm reading the config's attribute name instead of TE's
``zero_centered_gamma``: ``--apply-layernorm-1p`` ignored under the mode, max |diff| 22.7).
Runs where TE is installed (CI's te stage)."""

import pytest
import torch

from megapatch.testing import run_ranks

pytestmark = pytest.mark.te

HIDDEN, OUT, EPS = 32, 48, 1e-5
CASES = (("LayerNorm", True), ("RMSNorm", True), ("LayerNorm", False))  # (normalization, zero-centred gamma)


def _inputs():
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(8, 2, HIDDEN, generator=gen) * 3 + 1).bfloat16()
    gamma = (torch.randn(HIDDEN, generator=gen) * 0.5).bfloat16()  # 1 + gamma differs from gamma
    beta = (torch.randn(HIDDEN, generator=gen) * 0.5).bfloat16()
    weight = (torch.randn(OUT, HIDDEN, generator=gen) / HIDDEN ** 0.5).bfloat16()
    return x, gamma, beta, weight


def _oracle(norm, one_p):
    """The layer's function in FP64: the norm, its affine (``1 + gamma`` when zero-centred), the GEMM."""
    x, gamma, beta, weight = (t.double() for t in _inputs())
    if norm == "LayerNorm":
        normed = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + EPS)
    else:
        normed = x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS)
    scale = gamma + 1 if one_p else gamma
    normed = normed * scale + (beta if norm == "LayerNorm" else 0)
    return normed @ weight.t()


def _job(ctx):
    import megapatch
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    from megapatch.testing.models.tiny_gpt import llama_config
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    tp, rank = ctx.tp_size, ctx.tp_rank
    x, gamma, beta, weight = _inputs()
    shard = slice(rank * OUT // tp, (rank + 1) * OUT // tp)
    out = {}
    for norm, one_p in CASES:
        results = {}
        for mode in (True, False):  # False: megapatch off, TE's own module path
            if mode:
                megapatch.enable(tp_invariant=True)
            else:
                megapatch.disable()
            with te_cpu_runtime():
                config = llama_config(tp=tp, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=4,
                                      perform_initialization=False, normalization=norm, layernorm_epsilon=EPS,
                                      layernorm_zero_centered_gamma=one_p)
                layer = TELayerNormColumnParallelLinear(HIDDEN, OUT, config=config, init_method=None,
                                                        gather_output=False, bias=False, skip_bias_add=False,
                                                        is_expert=False)
                with torch.no_grad():
                    layer.layer_norm_weight.copy_(gamma)
                    if getattr(layer, "layer_norm_bias", None) is not None:
                        layer.layer_norm_bias.copy_(beta)
                    layer.weight.copy_(weight[shard])
                    results[mode] = layer(x)[0].detach().float()
            megapatch.disable()
            torch.distributed.barrier()
        out[(norm, one_p)] = results
    return out


@pytest.fixture(scope="module")
def runs():
    return {1: run_ranks(_job, world_size=1, tp=1, timeout=300)[0],
            2: run_ranks(_job, world_size=2, tp=2, timeout=300)}


@pytest.mark.parametrize("norm, one_p", CASES)
def test_the_fused_norm_linear_computes_tes_function_with_its_flags(runs, norm, one_p):
    """N24: the mode's ``TELayerNormColumnParallelLinear`` against TE's own module path (mode off)
    and FP64, at TP 1 and at TP 2 (each rank's output features); zero-centred gamma must scale by
    ``1 + gamma`` under the mode as TE does."""
    oracle = _oracle(norm, one_p)
    bound = 2 ** -6 * oracle.abs().max().item()
    for tp, per_rank in ((1, [runs[1]]), (2, runs[2])):
        for rank, out in enumerate(per_rank):
            shard = slice(rank * OUT // tp, (rank + 1) * OUT // tp)
            mode, native = out[(norm, one_p)][True], out[(norm, one_p)][False]
            assert (native.double() - oracle[..., shard]).abs().max() < bound, (tp, "TE itself vs FP64")
            assert (mode.double() - oracle[..., shard]).abs().max() < bound, (tp, rank, norm, one_p)
            assert (mode - native).abs().max() < bound, (tp, rank, norm, one_p)


# -- TE grouped-GEMM experts with the routing probabilities on their input ---------------------------

PROBS_ON_INPUT = dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True)


def _probs_on_input_job(ctx):
    """The Qwen3-MoE-shaped model with ``--moe-apply-probs-on-input`` (top-1): TE grouped experts under
    the mode, and the same weights in upstream's own local experts with megapatch off."""
    from megapatch.testing.scenarios import moe_tiny
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    with te_cpu_runtime():
        mode = moe_tiny.invariant_training(ctx, [(1, 1)], "alltoall", steps=0, spec="te-grouped",
                                           config_overrides=PROBS_ON_INPUT,
                                           full_weights=moe_tiny.weights_of("local", config_overrides=PROBS_ON_INPUT))
        native = moe_tiny.invariant_training(ctx, [(1, 1)], "alltoall", steps=0, modes=("native",), spec="local",
                                             config_overrides=PROBS_ON_INPUT)  # TE's final norm: the runtime's
    return mode[("tp_invariant", 1, 1)], native[("native", 1, 1)]


def test_grouped_te_experts_apply_the_probabilities_once_on_their_input_as_upstream():
    """N25 (the ``moe_apply_probs_on_input`` condition dropped: the probabilities applied twice, p^2
    instead of p): under the mode the TE grouped experts' logits, per-token losses and every routed
    expert's weight gradient are within a BF16 bound of upstream's native local experts on the same
    weights and tokens (megapatch off: an oracle outside the mode's code)."""
    from megapatch.testing.scenarios import moe_tiny

    mode, native = run_ranks(_probs_on_input_job, world_size=1, tp=1, timeout=300)[0]
    assert (mode["logits"] - native["logits"]).abs().max() < 2 ** -5 * native["logits"].abs().max()
    assert (mode["losses"] - native["losses"]).abs().max() < 2 ** -5 * native["losses"].abs().max()
    worst = {}
    for name, grad in mode["grads"].items():
        if moe_tiny.is_expert_parameter(name):
            want = native["grads"][moe_tiny.local_name(name)].float()
            worst[name] = ((grad.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert len(worst) == 2 * 8 * 2, sorted(worst)  # fc1 and fc2 of 8 experts in 2 layers
    print("N25 worst relative expert-gradient difference", max(worst.values()))
    assert max(worst.values()) < 2 ** -5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
