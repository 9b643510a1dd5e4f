"""``tp_invariant``'s data-parallel sum and loss scaling: the summed gradient does not depend on the
bucket layout, the TP size, the data-parallel size, the pipeline depth or the collective's
algorithm (``megapatch.numerics.exact_sum``).

Upstream (core_v0.16.1, ``distributed/``): DDP's backward hook adds each micro-batch's gradient to
the FP32 ``main_grad`` buffer (``main_grad.add_(grad)``), and when a bucket is ready its
``_ParamAndGradBucketGroup.start_grad_sync`` scales it by ``1/DP`` and all-reduces it (or
reduce-scatters it for the distributed optimizer). Both sums round in an order that follows the
micro-batch count, the bucket layout (which the TP size changes) and the ring. The loss is divided
by the micro-batch's token count and by the micro-batch count in ``forward_step_calc_loss``, and
the gradients by the DP size before the collective: three roundings whose values depend on the
layout.

Under the mode:

* ``DistributedDataParallel._make_backward_post_hook``: the hook adds each micro-batch's gradient to
  the bucket's exact accumulator instead of ``main_grad`` (upstream's hook still runs for the rest:
  ``grad = None``, the bucket's readiness), through ``grad_added_to_main_grad``, upstream's own
  flag for a gradient already accounted for.
* ``_ParamAndGradBucketGroup.start_grad_sync``: each bucket's exact sum over the data-parallel group
  (MAX of the top bins, then an int64 all-reduce, or reduce-scatter for the distributed optimizer)
  written into the grad buffer in FP32, rounded once. No ``1/DP`` scaling here: it is in the seed.
* ``schedules.forward_step_calc_loss``: the loss gradient's seed is one value,
  ``fl32(1 / (tokens in the micro-batch x micro-batches x DP))`` times the loss scale, rounded once
  (upstream's two divisions and DDP's ``1/DP`` give a value whose last bit depends on the layout);
  the MoE auxiliary- and MTP-loss scales likewise ``fl32(1 / (micro-batches x DP))``. With
  ``--calculate-per-token-loss`` upstream already scales once (``finalize_model_grads``: ``1/total
  tokens``) and nothing changes. The per-micro-batch loss report (``'lm loss': [sum, tokens]``) is
  handed on in FP64, where Megatron-LM's sums of it over micro-batches and data-parallel ranks are
  exact for any realistic loss values, so the printed loss does not depend on the layout either.
"""

from __future__ import annotations

import functools

import torch

from megapatch.core.call_args import argument
from megapatch.core.registry import Patch, Target
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import exact_sum
from megapatch.patches._common import MEGATRON_CORE_TP_INVARIANT_TESTED, refuse_tp_invariant, when

DDP = "megatron.core.distributed.distributed_data_parallel"
BUFFER = "megatron.core.distributed.param_and_grad_buffer"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"

_ACCUMULATOR = "_megapatch_exact_sum"  # on a bucket: its exact_sum.Accumulator
_DEPOSITED = "_megapatch_exact_hook"   # on a parameter: its DDP hook feeds the exact sum


class _Done:
    """The handle ``finish_grad_sync`` waits on (overlapped reduction): the sum is already there."""

    def wait(self):
        return None


def _make_backward_post_hook(wrapped, instance, args, kwargs):
    upstream = wrapped(*args, **kwargs)
    param = argument(args, kwargs, 0, "param")
    setattr(param, _DEPOSITED, True)

    @functools.wraps(upstream)
    def hook(*unused):
        group = instance.param_to_bucket_group.get(param)
        if not tpi.active() or group is None or param.grad is None:
            return upstream(*unused)
        if getattr(param, "grad_added_to_main_grad", False):
            refuse_tp_invariant("a gradient written to main_grad directly (gradient-accumulation fusion; "
                                "Megatron-LM: --no-gradient-accumulation-fusion)",
                                "the data-parallel sum is exact only over the gradients DDP's hook hands it")
        _deposit(group, param, param.grad)
        param.grad_added_to_main_grad = True  # upstream's hook: skip its add, do the rest
        try:
            return upstream(*unused)
        finally:
            param.grad_added_to_main_grad = False

    return hook


def _accumulator(bucket) -> exact_sum.Accumulator:
    found = getattr(bucket, _ACCUMULATOR, None)
    if found is None:
        found = exact_sum.Accumulator(bucket.grad_data.numel(), device=bucket.grad_data.device)
        setattr(bucket, _ACCUMULATOR, found)
    return found


def _deposit(bucket_group, param, grad) -> None:
    bucket = bucket_group.param_to_bucket[param]
    main = param.main_grad
    if main.untyped_storage().data_ptr() != bucket.grad_data.untyped_storage().data_ptr():
        refuse_tp_invariant("a parameter whose main_grad is not a view of its DDP bucket",
                            "the exact sum is kept per bucket element")
    start = main.storage_offset() - bucket.grad_data.storage_offset()
    _accumulator(bucket).add(start, grad)


def _start_grad_sync(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    if instance.grad_reduce_handle is not None:  # already summed (overlap: the last grad was ready)
        return None
    missing = [p for p in instance.params if not getattr(p, _DEPOSITED, False)]
    if missing:
        refuse_tp_invariant("a DistributedDataParallel model built before tp_invariant was switched on",
                            "its backward hooks add gradients in upstream's order; switch the mode on "
                            "before the model is wrapped (MEGAPATCH_TP_INVARIANT=1 always is)")
    config = instance.ddp_config
    if getattr(config, "num_distributed_optimizer_instances", 1) > 1:
        refuse_tp_invariant("several distributed-optimizer instances (Megatron-LM: "
                            "--num-distributed-optimizer-instances)",
                            "their gradient all-reduce is not under the exact sum")
    force_all_reduce = bool(argument(args, kwargs, 0, "force_all_reduce", False))
    sharded = config.use_distributed_optimizer and not force_all_reduce
    if config.use_distributed_optimizer:
        group = instance.intra_distributed_optimizer_instance_group
        rank, size = instance.intra_distributed_optimizer_instance_rank, instance.intra_distributed_optimizer_instance_size
    else:
        group = instance.data_parallel_group
        rank, size = group.rank(), group.size()
    for bucket in instance.buckets:
        exact = _accumulator(bucket)
        if sharded:
            piece = bucket.grad_data.numel() // size
            bucket.grad_data[rank * piece:(rank + 1) * piece].copy_(exact.total(group, shard=(rank, size)))
        else:
            bucket.grad_data.copy_(exact.total(group))
        exact.reset()
    overlapped = config.overlap_grad_reduce
    instance.grad_reduce_handle = _Done() if overlapped else None
    return None


# -- the loss's scale, applied once ---------------------------------------------------------------

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
    scale = (float(config.grad_scale_func(torch.ones(1)).item()) if config.grad_scale_func is not None else 1.0)

    def seeded(output_tensor):
        outputs = loss_func(output_tensor)
        if len(outputs) == 3:
            loss, tokens, report = outputs
            if per_token:
                return loss, tokens, _exact_report(report)
            seed = _fp32(1.0 / (max(int(tokens), 1) * microbatches * dp))
            return _Seed.apply(loss, _fp32(seed * scale)), tokens, _exact_report(report)
        loss, report = outputs
        return _Seed.apply(loss, _fp32(_fp32(cp / (microbatches * dp)) * scale)), _exact_report(report)

    if len(args) > 2:
        args = args[:2] + (seeded,) + args[3:]
    else:
        kwargs = {**kwargs, "loss_func": seeded}
    result = wrapped(*args, **kwargs)
    if not per_token:
        _rescale_auxiliary_losses(config, _fp32(_fp32(cp / (microbatches * dp)) * scale),
                                  _fp32(_fp32(1.0 / (microbatches * dp)) * scale))
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


_invariant_patch = functools.partial(Patch, option="tp_invariant", applies=when("tp_invariant", True),
                                     guarantee=True, supports=MEGATRON_CORE_TP_INVARIANT_TESTED)

PATCHES = (
    _invariant_patch(
        name="tp_invariant.data_parallel",
        summary="exact data-parallel gradient sum (integer bins, order-independent): summed gradients "
                "independent of the DP size, the bucket layout, the pipeline depth and the collective",
        hook=DDP,
        targets=(
            Target(DDP, "DistributedDataParallel._make_backward_post_hook", _make_backward_post_hook,
                   kind="method", params=("self", "param")),
            Target(BUFFER, "_ParamAndGradBucketGroup.start_grad_sync", _start_grad_sync, kind="method",
                   params=("self", "force_all_reduce")),
        ),
    ),
    _invariant_patch(
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
