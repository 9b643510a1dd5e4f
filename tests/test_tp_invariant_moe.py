"""Bitwise TP invariance (``tp_invariant=True``) on mixture-of-experts models (issue 26), with real
megatron-core MoE layers on CPU ranks (part 1's Qwen3-MoE-shaped model and stand-ins,
``megapatch/testing/scenarios/moe_tiny.py``): top-2 softmax routing, SwiGLU experts, QK RMSNorm,
grouped-query attention, aux and z losses on, expert TP = TP, sequence parallelism at TP > 1.

The oracle is the same model at TP=1 under the mode; without the mode the bits, and expert
choices, change with the TP size on this model (the precondition: else the tests could not fail).
"""

from __future__ import annotations

import pytest
import torch

from megapatch.testing import run_ranks
from megapatch.testing.scenarios import moe_tiny
from tests.test_tp_invariant import _differing, _needs_the_mode

TPS = (1, 2, 4)
STEPS = 3
LOSSES = dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, num_query_groups=4)
#: name -> (dispatcher, config overrides)
VARIANTS = {
    "alltoall": ("alltoall", LOSSES),
    # DeepSeek-style shared expert (no gate), reduced by the layer itself
    "allgather-shared-experts": ("allgather", {**LOSSES, "moe_shared_expert_intermediate_size": 64}),
}
#: name -> (config overrides at TP 2, the flag the refusal must name)
REFUSED = {
    "expert parallelism": ({"expert_model_parallel_size": 2}, "--expert-model-parallel-size"),
    "grouped GEMM": ({"moe_grouped_gemm": True}, "--moe-grouped-gemm"),
    "shared expert gate": ({"moe_shared_expert_intermediate_size": 64, "moe_shared_expert_gate": True},
                           "--moe-shared-expert-gate"),
    "shared expert overlap": ({"moe_shared_expert_intermediate_size": 64, "moe_shared_expert_overlap": True},
                              "--moe-shared-expert-overlap"),
    "token dropping": ({"moe_expert_capacity_factor": 1.5}, "--moe-expert-capacity-factor"),
    "expert TP 1 at TP 2": ({"expert_tensor_parallel_size": 1}, "--expert-tensor-parallel-size"),
    # upstream takes expert biases only with expert TP 1 (an assertion of its own); the bias is named first
    "expert biases": ({"add_bias_linear": True, "expert_tensor_parallel_size": 1}, "--disable-bias-linear"),
    "per-token loss with the aux loss": ({"calculate_per_token_loss": True, "moe_aux_loss_coeff": 1e-2},
                                         "--calculate-per-token-loss"),
    "FP64 router": ({"moe_router_dtype": "fp64"}, "--moe-router-dtype"),
    "Sinkhorn": ({"moe_router_load_balancing_type": "sinkhorn", "moe_router_topk": 1}, "sinkhorn"),
    "experts' FFN the width cannot cut": ({"moe_ffn_hidden_size": 36}, "--moe-ffn-hidden-size"),
}


def _refusal(ctx, overrides):
    """The refusal met while the model is built at TP 2 (expert parallelism: EP 2), else None."""
    import megapatch
    from megapatch.core.errors import MegapatchError

    megapatch.enable(tp_invariant=True)
    try:
        moe_tiny.build_full_then_shard(ctx, overrides.get("expert_model_parallel_size", 1),
                                       moe_tiny.qwen3_moe_config(2, "alltoall", **{**LOSSES, **overrides}))
    except MegapatchError as exc:
        return str(exc)
    except (AssertionError, ValueError) as exc:  # upstream's own config checks: the row is wrong
        return f"upstream refused first: {type(exc).__name__}: {exc}"
    finally:
        megapatch.disable()
    return None


def _job(ctx):
    out = {}
    for name, (dispatcher, overrides) in VARIANTS.items():
        runs = moe_tiny.invariant_training(ctx, TPS, dispatcher, steps=STEPS, config_overrides=overrides)
        out.update({(name, tp): run for (_, tp), run in (runs or {}).items()})
    native = moe_tiny.invariant_training(ctx, (1, 4), "alltoall", steps=0, modes=("native",),
                                         config_overrides=LOSSES)
    out.update({("native", tp): run for (_, tp), run in (native or {}).items()})
    for name, (overrides, _) in REFUSED.items():
        out[("refused", name)] = _refusal(ctx, overrides)
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def runs():
    _needs_the_mode()
    return run_ranks(_job, world_size=4, tp=1, timeout=900)[0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tp", TPS[1:])
def test_moe_logits_expert_choices_losses_and_gradients_are_bit_identical_to_tp1(runs, variant, tp):
    base, here = runs[(variant, 1)], runs[(variant, tp)]
    assert torch.equal(here["logits"], base["logits"])
    assert len(base["routing"]) == 2 and all(torch.equal(a, b) for a, b in zip(here["routing"], base["routing"]))
    assert torch.equal(here["losses"], base["losses"])
    assert here["grads"].keys() == base["grads"].keys() and len(base["grads"]) >= 45
    assert any("router" in name for name in base["grads"]) and any("local_experts" in name for name in base["grads"])
    assert _differing(here["grads"], base["grads"]) == []


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tp", TPS[1:])
def test_moe_grad_norms_and_parameters_after_clipped_adamw_steps_are_bit_identical_to_tp1(runs, variant, tp):
    base, here = runs[(variant, 1)], runs[(variant, tp)]
    assert len(base["norms"]) == STEPS + 1 and min(base["norms"]) > moe_tiny_clip()  # clipping scaled every step
    assert here["norms"] == base["norms"]
    assert _differing(here["params"], base["params"]) == []


def moe_tiny_clip() -> float:
    import inspect

    return inspect.signature(moe_tiny.invariant_training).parameters["clip"].default


def test_precondition_without_the_mode_tp_changes_the_bits_and_expert_choices(runs):
    base, here = runs[("native", 1)], runs[("native", 4)]
    assert not torch.equal(here["logits"], base["logits"])
    assert any(not torch.equal(a, b) for a, b in zip(here["routing"], base["routing"]))
    assert len(_differing(here["grads"], base["grads"])) > 40


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_moe_paths_the_mode_cannot_cover_are_refused_at_construction_naming_the_flag(runs, name):
    message = runs[("refused", name)]
    assert message is not None, f"{name}: built under tp_invariant"
    assert REFUSED[name][1] in message and "tp_invariant was set by" in message, message


MOE_FLAGS = ["--tensor-model-parallel-size", "2", "--num-attention-heads", "8", "--hidden-size", "64",
             "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion",
             "--swiglu", "--num-experts", "8", "--moe-router-topk", "2", "--sequence-parallel",
             "--disable-bias-linear", "--seq-length", "32", "--moe-ffn-hidden-size", "32"]


@pytest.mark.parametrize("extra,refused", [
    ([], None),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type"),
    (["--moe-permute-fusion"], "--moe-permute-fusion"),
    (["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate"], "--moe-shared-expert-gate"),
    (["--expert-tensor-parallel-size", "1"], "--expert-tensor-parallel-size"),
    (["--moe-ffn-hidden-size", "36"], "--moe-ffn-hidden-size"),
], ids=["covered", "ep", "flex", "permute-fusion", "shared-gate", "etp", "ffn"])
def test_doctor_refuses_the_moe_flags_the_run_refuses(extra, refused):
    from tests.test_doctor import _cli

    result = _cli(["doctor", "--", *MOE_FLAGS, *extra], env={"MEGAPATCH_TP_INVARIANT": "1"})
    if refused is None:
        assert result.returncode == 0, result.stdout + result.stderr
        return
    assert result.returncode == 1, result.stdout + result.stderr
    assert refused in result.stdout and "tp_invariant.construction" in result.stdout, result.stdout


@pytest.mark.quick("tp_invariant.moe")
def test_top_k_routing_runs_once_per_token_block_with_the_same_rows_at_every_tp_size():
    """Ties are broken the same way everywhere because every top-k call sees the same rows: W token
    blocks at TP=1, W/t per rank with sequence parallelism (here 8 blocks of 4 tokens); the padding
    mask is cut with its tokens; a replayed routing takes its recorded indices in one call."""
    import megapatch
    from megapatch.patches import tp_invariant

    calls = []

    def routing(logits, topk, padding_mask=None, router_replay=None):
        calls.append((logits.clone(), padding_mask))
        return logits * 2, (logits > 40) if padding_mask is None else padding_mask[:, None].expand_as(logits)

    logits = torch.arange(32 * 3, dtype=torch.float32).view(32, 3)
    mask = torch.arange(32) % 3 == 0
    megapatch.enable(tp_invariant=True)
    try:
        with tp_invariant.scoped(tp_invariant._router_blocks, 8):
            probs, chosen = tp_invariant._per_token_blocks(routing, None, (logits, 2), {})
            assert [c.shape[0] for c, _ in calls] == [4] * 8 and torch.equal(torch.cat([c for c, _ in calls]), logits)
            assert torch.equal(probs, logits * 2) and torch.equal(chosen, logits > 40)
            calls.clear()
            _, masked = tp_invariant._per_token_blocks(routing, None, (logits, 2), {"padding_mask": mask})
            assert torch.equal(masked[:, 0], mask) and len(calls) == 8
            calls.clear()
            tp_invariant._per_token_blocks(routing, None, (logits, 2), {"router_replay": object()})
            assert len(calls) == 1
    finally:
        megapatch.disable()
