"""``tp_invariant``'s loss scale, applied once: the loss gradient's seed is one FP32 value whatever
the layout (``tp_invariant.data_parallel`` sums what it seeds exactly).

Upstream (core_v0.16.1, ``pipeline_parallel/schedules.py``): ``forward_step_calc_loss`` divides
the micro-batch's summed loss by its token count and by the number of micro-batches, and DDP
divides the gradients by the DP size before its collective: three roundings whose values depend on
the layout. Under the mode the seed is ``fl32(1 / (tokens in the micro-batch x micro-batches x
DP))`` times the loss scale, rounded once (``tp_invariant.data_parallel`` leaves out DDP's
``1/DP``); the MTP-loss scale likewise ``fl32(1 / (micro-batches x DP))``, the MoE auxiliary-loss
scale ``fl32(1 / (micro-batches x DP x sequences per MoE call))``: an MoE layer runs a micro-batch
one sequence at a time under the mode (``tp_invariant.micro_batch``), each call's aux loss one
sequence's, so the scale is one over the global batch's sequences at every micro-batch size.
With ``--calculate-per-token-loss`` upstream already scales once (``finalize_model_grads``:
``1/total tokens``) and the seed stays upstream's. The per-micro-batch loss report (``'lm loss':
[sum, tokens]``) is handed on in FP64, where Megatron-LM's sums of it over micro-batches and
data-parallel ranks are exact for any realistic loss values, so the printed loss does not depend
on the layout either.
"""

from __future__ import annotations

import torch

from megapatch.core.call_args import argument, with_argument
from megapatch.core.registry import Target
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import gradient_terms
from megapatch.patches.tp_invariant._mode import tp_invariant_patch

SCHEDULES = "megatron.core.pipeline_parallel.schedules"


class _Seed(torch.autograd.Function):
    """Passes the loss on; its backward starts from ``seed`` whatever arrives (upstream's divisions
    by the token and micro-batch counts, rounded twice, are replaced by one value)."""

    @staticmethod
    def forward(ctx, loss, seed):
        ctx.seed = seed
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, ctx.seed), None


def _data_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


def _fp32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float64).float())


def _exact_report(report):
    """Megatron-LM sums ``[loss sum, tokens]`` over micro-batches and data-parallel ranks: in FP64
    those sums of FP32 values are exact (their bits span far less than 53), in FP32 they round in
    an order that follows the layout."""
    if not isinstance(report, dict):
        return report
    return {key: value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
            for key, value in report.items()}


def _forward_step_calc_loss(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    loss_func = argument(args, kwargs, 2, "loss_func")
    config = argument(args, kwargs, 3, "config")
    if loss_func is None or argument(args, kwargs, 5, "collect_non_loss_data"):
        return wrapped(*args, **kwargs)
    microbatches = int(argument(args, kwargs, 6, "num_microbatches"))
    cp = argument(args, kwargs, 8, "cp_group_size", None)
    if cp is None:
        from megatron.core import parallel_state

        cp = parallel_state.get_context_parallel_world_size()
    dp = _data_parallel_size()
    per_token = getattr(config, "calculate_per_token_loss", False)
    # the loss scale as upstream reads it (a tensor on the loss's device: on a GPU the scaler's is CUDA)
    device = argument(args, kwargs, 1, "output_tensor").device
    scale = (float(config.grad_scale_func(torch.ones(1, device=device)).item())
             if config.grad_scale_func is not None else 1.0)
    per_microbatch = _fp32(_fp32(cp / (microbatches * dp)) * scale)  # legacy losses

    def seeded(output_tensor):
        outputs = loss_func(output_tensor)
        if len(outputs) == 3:
            loss, tokens, report = outputs
            if per_token:
                return loss, tokens, _exact_report(report)
            seed = _fp32(1.0 / (max(int(tokens), 1) * microbatches * dp))
            return _Seed.apply(loss, _fp32(seed * scale)), tokens, _exact_report(report)
        loss, report = outputs
        return _Seed.apply(loss, per_microbatch), _exact_report(report)

    args, kwargs = with_argument(args, kwargs, 2, "loss_func", seeded)
    result = wrapped(*args, **kwargs)
    if not per_token:
        # an MoE layer run one sequence at a time (tp_invariant.micro_batch): each call's aux loss is
        # one sequence's, scaled as at micro-batch size 1 (the same integer count of the global batch)
        per_call = _fp32(_fp32(cp / (microbatches * dp * gradient_terms.moe_sequences_per_call())) * scale)
        _rescale_auxiliary_losses(config, per_call, _fp32(_fp32(1.0 / (microbatches * dp)) * scale))
    return result


def _rescale_auxiliary_losses(config, moe_scale: float, mtp_scale: float) -> None:
    """Upstream sets these scales to ``loss scale / micro-batches`` and DDP divides by DP later; the
    exact sum skips that division, so the scale carries it, as one FP32 value."""
    if getattr(config, "num_moe_experts", None) is not None:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([moe_scale]))
    if getattr(config, "mtp_num_layers", None) is not None:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        MTPLossAutoScaler.set_loss_scale(torch.tensor([mtp_scale]))


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.loss_scale",
        summary="the loss gradient's layout-dependent scale (1 / tokens x micro-batches x DP) applied "
                "once, as one FP32 value; the loss report summed exactly",
        hook=SCHEDULES,
        targets=(
            Target(SCHEDULES, "forward_step_calc_loss", _forward_step_calc_loss,
                   params=("model", "output_tensor", "loss_func", "config", "vp_stage",
                           "collect_non_loss_data", "num_microbatches", "forward_data_store",
                           "cp_group_size", "is_last_stage")),
        ),
    ),
)
