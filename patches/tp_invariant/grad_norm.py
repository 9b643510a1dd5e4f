"""``tp_invariant.grad_norm``: the 2-norm for clipping, invariant across layouts: each parameter's
sum of squares through the fixed tree along its partition dim, parameters added in their fixed
order (expert parameters gathered over EP, in (layer, global expert) order), pipeline stages' totals
added exactly. Norms over other ranks than TP x PP (x DP with the distributed optimizer) are refused."""

from __future__ import annotations

import contextvars
import math

import torch

from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.core.scope import scoped
from megapatch.numerics import exact_sum
from megapatch.numerics import block_tree as tpi
from megapatch.patches.tp_invariant._marks import EXPERT_KEY, GATED, PARTITION_DIM
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant, tp_invariant_patch


OPTIMIZER = "megatron.core.optimizer.optimizer"
CLIP_GRADS = "megatron.core.optimizer.clip_grads"
_norm_owner = contextvars.ContextVar("megapatch_tp_invariant_norm_owner", default=None)


def _norm_owner_scope(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    with scoped(_norm_owner, instance):
        return wrapped(*args, **kwargs)


def _grad_norm_fp32(wrapped, instance, args, kwargs):
    norm_type = float(argument(args, kwargs, 1, "norm_type", 2))
    if not tpi.active() or norm_type == float("inf"):  # a max is order-independent
        return wrapped(*args, **kwargs)
    owner = _norm_owner.get()
    if owner is None:
        refuse_tp_invariant("get_grad_norm_fp32 outside an optimizer's get_grad_norm/clip_grad_norm",
                "the invariant norm needs the parameters' partition dims")
    if norm_type != 2.0:
        refuse_tp_invariant(f"a grad norm of type {norm_type}", "only the 2-norm (and inf) is invariant")
    return _invariant_grad_norm(owner, argument(args, kwargs, 2, "grad_stats_parallel_group", None))


def _chained_grad_norm(wrapped, instance, args, kwargs):
    """A chained optimizer's norm (dense and expert parameters), computed over all its optimizers
    at once: upstream adds the optimizers' norms as ``sqrt(a^2 + b^2)`` where their reduction
    groups differ (expert parallelism), and sums them as one where they do not."""
    if not tpi.active():
        return wrapped(*args, **kwargs)
    with scoped(_norm_owner, instance):
        return _invariant_grad_norm(instance, instance.chained_optimizers[0].get_grad_stats_parallel_group())


def _invariant_grad_norm(owner, stats_group) -> float:
    """The 2-norm of every gradient the ``owner``'s optimizers step: each parameter's sum of squares
    through the fixed tree along its partition dim (expert parameters gathered over the EP ranks,
    which hold other experts), the squares of every parameter of every pipeline stage added exactly
    (``exact_sum.scalar_sum``: correctly rounded whatever the order and the stages' cut)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import param_is_not_shared

    optimizers = _optimizers(owner)
    distributed = any(_is_distributed(o) for o in optimizers)
    tp_group = getattr(owner, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    stages = _pipeline_stages(stats_group, tp_group, distributed)
    grads, dims, halves, keys = [], [], [], []
    for optimizer in optimizers:
        model_of = _model_params(optimizer)
        if _is_distributed(optimizer):
            pairs = _distributed_grads(optimizer)
        else:
            decoupled = getattr(optimizer.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
            pairs = ((p, getattr(p, "decoupled_grad", None) if decoupled else p.grad)
                     for p in optimizer.get_parameters())
        for param, grad in pairs:
            if grad is None or not param_is_not_shared(param):
                continue
            model = model_of.get(id(param), param)
            grads.append(grad)
            dim = getattr(model, PARTITION_DIM, None)  # (TE's grouped expert weights: no TP attributes)
            if dim is None and getattr(param, "tensor_model_parallel", False):
                dim = param.partition_dim
            dims.append(dim)
            halves.append(getattr(model, GATED, 1))
            keys.append(getattr(model, EXPERT_KEY, None))
    squares = tpi.squared_norms(grads, dims, tp_group, halves)
    values = [value for value, key in zip(squares.tolist(), keys) if key is None]
    values += [float(value) for value in _expert_squares(squares, keys)]
    # every TP rank of a stage holds the same values; the sum over the stages is exact (correctly
    # rounded), so it does not depend on how the pipeline cuts the parameters into stages
    return math.sqrt(exact_sum.scalar_sum(values, stages))


def _expert_squares(squares, keys):
    """The expert parameters' sums of squares of every EP rank, in key order."""
    mine = [i for i, key in enumerate(keys) if key is not None]
    if not mine:
        return []
    from megatron.core import parallel_state

    values, key_rows = squares[mine], torch.tensor([keys[i] for i in mine], dtype=torch.long)
    group = parallel_state.get_expert_model_parallel_group()
    if tpi.group_size(group) > 1:
        every_value = [torch.empty_like(values) for _ in range(group.size())]
        every_key = [torch.empty_like(key_rows) for _ in range(group.size())]
        torch.distributed.all_gather(every_value, values.contiguous(), group=group)
        torch.distributed.all_gather(every_key, key_rows, group=group)
        values, key_rows = torch.cat(every_value), torch.cat(every_key)
    order = sorted(range(len(values)), key=lambda i: tuple(key_rows[i].tolist()))
    return [values[i] for i in order]


def _pipeline_stages(stats_group, tp_group, distributed: bool):
    """The pipeline group whose stage totals the norm adds (None: the norm spans TP only); refuses a
    norm over any other ranks (expert, or data-parallel without the distributed optimizer), which
    this mode does not make invariant. The distributed optimizer's norm spans its data-parallel
    shards too: ``_distributed_grads`` gathers them, so every data-parallel rank adds the same total."""
    tp = tpi.group_size(tp_group)
    if stats_group is None or stats_group.size() == tp:
        return None
    from megatron.core import parallel_state

    stages = parallel_state.get_pipeline_model_parallel_group()
    expected, shape = tp * stages.size(), f"TP {tp} x PP {stages.size()}"
    if distributed:
        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        expected, shape = expected * dp, f"{shape} x DP {dp}"
    if stats_group.size() != expected:
        refuse_tp_invariant(f"a grad norm over {stats_group.size()} ranks ({shape} expected)",
                "only the tensor- and pipeline-parallel sums are made invariant")
    return stages if stages.size() > 1 else None


def _is_distributed(optimizer) -> bool:
    return type(optimizer).__name__ == "DistributedOptimizer"


def _distributed_grads(optimizer):
    """``(model parameter, full-shaped gradient)`` for every parameter of a distributed optimizer,
    in buffer order (the same at every TP size). Its main-parameter shards are flat slices with no
    partition dim; the model parameters' ``main_grad`` views of the grad buffers have one. Each
    data-parallel rank holds only its own shard reduced, so with DP > 1 the shards are first
    all-gathered into a copy (the volume of the optimizer's own parameter all-gather)."""
    for buffer in optimizer.buffers:
        data = buffer.grad_data
        group = buffer.data_parallel_group
        if group.size() > 1:
            gathered = torch.empty_like(data)
            for (start, end), bucket in zip(buffer.bucket_indices, buffer.buckets):
                shards = list(gathered[start:end].chunk(group.size()))
                mine = bucket.grad_data.chunk(group.size())[group.rank()]
                torch.distributed.all_gather(shards, mine.contiguous(), group=group)
            data = gathered
        for param, (start, end, _bucket) in sorted(buffer.param_index_map.items(), key=lambda kv: kv[1][0]):
            yield param, data[start:end].view(param.shape)


def _optimizers(owner):
    return list(getattr(owner, "chained_optimizers", None) or [owner])


def _model_params(optimizer) -> dict:
    """``{id(parameter the optimizer steps): model parameter}`` for the FP32 main copies a
    mixed-precision optimizer made of model parameters (the marks -- gated fc1, expert key -- stay
    on the model parameter)."""
    import itertools

    model = itertools.chain.from_iterable(getattr(optimizer, "float16_groups", ()) or ())
    main = itertools.chain.from_iterable(getattr(optimizer, "fp32_from_float16_groups", ()) or ())
    return {id(main_param): model_param for model_param, main_param in zip(model, main)}


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.grad_norm",
        summary="TP-invariant gradient norm for clipping (fixed-tree FP32 sum of squares)",
        hook=OPTIMIZER,
        targets=(
            Target(CLIP_GRADS, "get_grad_norm_fp32", _grad_norm_fp32,
                   params=("grads_for_norm", "norm_type", "grad_stats_parallel_group")),
            Target(OPTIMIZER, "MegatronOptimizer.get_grad_norm", _norm_owner_scope, kind="method",
                   params=("self",)),
            Target(OPTIMIZER, "MegatronOptimizer.clip_grad_norm", _norm_owner_scope, kind="method",
                   params=("self", "clip_grad")),
            Target(OPTIMIZER, "ChainedOptimizer.get_grad_norm", _chained_grad_norm, kind="method",
                   params=("self",)),
        ),
    ),
)
