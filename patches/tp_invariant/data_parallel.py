"""``tp_invariant``'s data-parallel sum: the summed gradient does not depend on the bucket layout,
the TP size, the data-parallel size, the pipeline depth or the collective's algorithm
(``megapatch.numerics.exact_sum``).

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
  flag for a gradient already accounted for. The gradient waits in its ``main_grad`` (an exact
  copy; the mode otherwise keeps the buffer zero) until every parameter of the bucket has one,
  then the bucket goes into the accumulator in one call: the same terms, element by element, as
  one call per parameter, at a fraction of the calls.
* Micro-batch size: every parameter DDP's hook feeds also gets a sink for per-sequence terms
  (``block_tree.SEQUENCE_TERMS``): the mode's layers compute a micro-batch's weight gradients one
  sequence at a time and deposit each as a term of its own, so the exact sum gets the same terms
  whether the global batch comes in micro-batches of 1, 2 or 4 sequences.
* ``_ParamAndGradBucketGroup.start_grad_sync``: each bucket's exact sum over the data-parallel group
  (MAX of the top bins, then an int64 all-reduce, or reduce-scatter for the distributed optimizer)
  written into the grad buffer in FP32, rounded once. No ``1/DP`` scaling here: it is in the seed.
* The loss gradient's ``1/DP`` is applied once, in the seed: ``tp_invariant.loss_scale``.
* Tied embeddings at PP > 1 (the first stage's lookup, the last stage's output layer: two copies,
  ``shared_embedding``): ``finalize_model_grads`` sums each stage's data-parallel sum over the
  embedding group in FP32 -- one rounding more than PP 1, where both uses' terms meet in one exact
  sum. Here the copy's exact terms are kept at the data-parallel sum and
  ``_allreduce_word_embedding_grads`` merges them over the embedding group (exactly) before their
  data-parallel sum is rounded once.
"""

from __future__ import annotations

import functools

import torch

from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import gradient_terms
from megapatch.numerics import exact_sum
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant, tp_invariant_patch

DDP = "megatron.core.distributed.distributed_data_parallel"
FINALIZE = "megatron.core.distributed.finalize_model_grads"
BUFFER = "megatron.core.distributed.param_and_grad_buffer"

_ACCUMULATOR = "_megapatch_exact_sum"  # on a bucket: its exact_sum.Accumulator
_DEPOSITED = "_megapatch_exact_hook"   # on a parameter: its DDP hook feeds the exact sum
_TIED_PENDING = "_megapatch_tied_terms"  # on a tied embedding at PP > 1: its terms, until summed across stages
_STAGED = "_megapatch_staged"  # on a bucket: the parameters whose gradient waits in main_grad


class _Done:
    """The handle ``finish_grad_sync`` waits on (overlapped reduction): the sum is already there."""

    def wait(self):
        return None


def _make_backward_post_hook(wrapped, instance, args, kwargs):
    upstream = wrapped(*args, **kwargs)
    param = argument(args, kwargs, 0, "param")
    setattr(param, _DEPOSITED, True)
    setattr(param, gradient_terms.SEQUENCE_TERMS, functools.partial(_deposit_term, instance, param))

    @functools.wraps(upstream)
    def hook(*unused):
        group = instance.param_to_bucket_group.get(param)
        if not tpi.active() or group is None or param.grad is None:
            return upstream(*unused)
        if getattr(param, "grad_added_to_main_grad", False):
            refuse_tp_invariant("a gradient written to main_grad directly (gradient-accumulation fusion; "
                                "Megatron-LM: --no-gradient-accumulation-fusion)",
                                "the data-parallel sum is exact only over the gradients DDP's hook hands it")
        _stage(group, param)
        param.grad_added_to_main_grad = True  # upstream's hook: skip its add, do the rest
        try:
            return upstream(*unused)
        finally:
            param.grad_added_to_main_grad = False

    return hook


def _deposit_term(ddp, param, terms) -> None:
    """Gradients of ``param`` each a term of the exact sum of its own, as DDP's hook deposits a
    micro-batch's: one per sequence (``block_tree.by_sequence``) or per source rank of an expert's
    tokens (``block_tree.source_terms``)."""
    group = ddp.param_to_bucket_group.get(param)
    if group is None:
        refuse_tp_invariant("a parameter outside every DDP bucket with a per-sequence gradient",
                            "its gradient terms have no exact sum to go to")
    _deposit(group, param, terms)


def _accumulator(bucket) -> exact_sum.Accumulator:
    found = getattr(bucket, _ACCUMULATOR, None)
    if found is None:
        found = exact_sum.Accumulator(bucket.grad_data.numel(), device=bucket.grad_data.device)
        setattr(bucket, _ACCUMULATOR, found)
    return found


def _bucket_view(bucket, param):
    main = param.main_grad
    if main.untyped_storage().data_ptr() != bucket.grad_data.untyped_storage().data_ptr():
        refuse_tp_invariant("a parameter whose main_grad is not a view of its DDP bucket",
                            "the exact sum is kept per bucket element")
    return main


def _deposit(bucket_group, param, grads) -> None:
    bucket = bucket_group.param_to_bucket[param]
    start = _bucket_view(bucket, param).storage_offset() - bucket.grad_data.storage_offset()
    _accumulator(bucket).add_terms(start, grads)


def _stage(bucket_group, param) -> None:
    """DDP's hook: ``param.grad`` into the exact sum. Copied into ``main_grad`` (exact: FP32 holds
    every BF16/FP16/FP32 value) to wait for the rest of its bucket, which then goes in as one term
    per element: a parameter's gradient coming again before that sends the bucket in first."""
    bucket = bucket_group.param_to_bucket[param]
    main = _bucket_view(bucket, param)
    if main.dtype != torch.float32 or param.grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        _deposit(bucket_group, param, [param.grad])  # a copy would round: deposit it now
        return
    staged = getattr(bucket, _STAGED, None)
    if staged is None:
        staged = set()
        setattr(bucket, _STAGED, staged)
    if param in staged:
        _flush(bucket)
    main.copy_(param.grad)
    staged.add(param)
    if len(staged) == len(bucket.params_list):
        _flush(bucket)


def _flush(bucket) -> None:
    """The gradients waiting in ``bucket``'s main_grad views into its exact sum (the others' elements
    hold zeros: no contribution); the buffer zero again."""
    staged = getattr(bucket, _STAGED, None)
    if staged:
        _accumulator(bucket).add(0, bucket.grad_data)
        bucket.grad_data.zero_()
        staged.clear()


def _start_grad_sync(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    if instance.grad_reduce_handle is not None:  # already summed (overlap: the last grad was ready)
        return None
    if not all(getattr(p, _DEPOSITED, False) for p in instance.params):
        refuse_tp_invariant("a DistributedDataParallel model built before tp_invariant was switched on",
                            "its backward hooks add gradients in upstream's order; switch the mode on "
                            "before the model is wrapped (MEGAPATCH_TP_INVARIANT=1 always is)")
    config = instance.ddp_config
    if getattr(config, "num_distributed_optimizer_instances", 1) > 1:
        refuse_tp_invariant("several distributed-optimizer instances (Megatron-LM: "
                            "--num-distributed-optimizer-instances)",
                            "their gradient all-reduce is not under the exact sum")
    force_all_reduce = bool(argument(args, kwargs, 0, "force_all_reduce", False))
    if config.use_distributed_optimizer:
        group = instance.intra_distributed_optimizer_instance_group
        rank, size = instance.intra_distributed_optimizer_instance_rank, instance.intra_distributed_optimizer_instance_size
    else:
        group = instance.data_parallel_group
        rank, size = group.rank(), group.size()
    shard = (rank, size) if config.use_distributed_optimizer and not force_all_reduce else None
    for bucket in instance.buckets:
        _flush(bucket)
        exact = _accumulator(bucket)
        pending = [_defer_tied(bucket, p, exact, group, shard) for p in bucket.params_list if _tied_across_stages(p)]
        _write_sum(exact, bucket.grad_data, group, shard)
        for param in pending:
            param.main_grad.zero_()  # its sum comes with the other stage's terms (_word_embedding_grads)
        exact.reset()
    overlapped = config.overlap_grad_reduce
    instance.grad_reduce_handle = _Done() if overlapped else None
    return None


def _write_sum(exact, target, group, shard) -> None:
    """``exact``'s sum over ``group`` rounded once into ``target`` -- only this rank's piece of it
    when ``shard=(rank, size)`` (the distributed optimizer's reduce-scatter)."""
    if shard is None:
        target.copy_(exact.total(group))
        return
    rank, size = shard
    piece = target.numel() // size
    target[rank * piece:(rank + 1) * piece].copy_(exact.total(group, shard=shard))


def _tied_across_stages(param) -> bool:
    """A weight whose copy on another pipeline stage is summed with it after the data-parallel
    sum (tied embeddings at PP > 1: megatron-core marks both copies ``shared_embedding``)."""
    return bool(getattr(param, "shared_embedding", False))


def _defer_tied(bucket, param, exact, group, shard):
    """Keep ``param``'s exact terms for the sum across stages: upstream all-reduces the two stages'
    FP32 sums there (rounded twice, where PP 1 rounds once over both uses' terms)."""
    if getattr(param, _TIED_PENDING, None) is not None:
        refuse_tp_invariant("a tied embedding whose gradient was not summed across pipeline stages after the "
                            "last step (finalize_model_grads not called)",
                            "its gradient would lack the other stage's terms")
    if shard is not None:
        if len(bucket.params_list) != 1:  # upstream gives it a bucket of its own under the distributed optimizer
            refuse_tp_invariant("a tied embedding sharing its bucket under the distributed optimizer",
                                "its shard of the sum across stages must be the same on both stages")
        terms, target = exact.piece(0, bucket.grad_data.numel()), bucket.grad_data
    else:
        start = param.main_grad.storage_offset() - bucket.grad_data.storage_offset()
        terms, target = exact.piece(start, start + param.numel()), param.main_grad.view(-1)
    setattr(param, _TIED_PENDING, (terms, target, group, shard))
    return param


def _word_embedding_grads(wrapped, instance, args, kwargs):
    """The tied embedding's gradient: the two stages' exact terms merged over the embedding group,
    then the data-parallel sum of them all rounded once (PP 1's arithmetic), in place of upstream's
    FP32 all-reduce of the two stages' sums."""
    model = argument(args, kwargs, 0, "model")
    pending = [p for chunk in model for p in chunk.parameters() if getattr(p, _TIED_PENDING, None) is not None]
    if not pending:
        return wrapped(*args, **kwargs)
    embd_group = argument(args, kwargs, 2, "embd_group", None)  # megatron-core < 0.14: no argument
    if embd_group is None:
        from megatron.core import parallel_state

        embd_group = parallel_state.get_embedding_group()
    for param in pending:
        terms, target, group, shard = getattr(param, _TIED_PENDING)
        delattr(param, _TIED_PENDING)
        terms.merge(embd_group)
        _write_sum(terms, target, group, shard)
    return None


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.data_parallel",
        summary="exact data-parallel gradient sum (integer bins, order-independent): summed gradients "
                "independent of the DP size, the bucket layout, the pipeline depth and the collective",
        hook=DDP,
        targets=(
            Target(DDP, "DistributedDataParallel._make_backward_post_hook", _make_backward_post_hook,
                   kind="method", params=("self", "param")),
            Target(BUFFER, "_ParamAndGradBucketGroup.start_grad_sync", _start_grad_sync, kind="method",
                   params=("self", "force_all_reduce")),
            Target(FINALIZE, "_allreduce_word_embedding_grads", _word_embedding_grads,
                   params=("model", "config")),
        ),
    ),
)
