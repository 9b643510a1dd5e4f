"""Vocab-parallel cross entropy under the mode: the sum of exp(logits) over the vocabulary goes
through the fixed tree and is handed to upstream's all-reduce on TP rank 0 only (zeros elsewhere:
a sum of one value and zeros is exact). The logits max and the target-logit sum (one non-zero per
token) are exact in any order.

Label smoothing at TP > 1 is refused: upstream's smoothing term is the mean log-prob over the rank's
own vocabulary shard (``exp_logits.size(-1)``), another function of the logits at every TP size and
on every TP rank; Megatron-LM never passes it (direct callers of ``vocab_parallel_cross_entropy``
do)."""

from __future__ import annotations

from megapatch.core.call_args import argument
from megapatch.numerics import block_tree as tpi
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant


CROSS_ENTROPY = "megatron.core.tensor_parallel.cross_entropy"


def predicted_logits(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if not tpi.active():
        return result
    from megatron.core import parallel_state

    target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = result
    group = parallel_state.get_tensor_model_parallel_group()
    nb = tpi.blocks_per_rank(group)
    tpi.check_divisible("the vocabulary (cross entropy)", exp_logits.shape[-1] * tpi.group_size(group),
                        exp_logits.shape[-1], group)
    # handed to upstream's all-reduce on rank 0 only
    total = tpi.on_root(tpi.invariant_sum(tpi.sum_exp_partials(exp_logits, nb), group), group).view_as(sum_exp_logits)
    return target_mask, masked_target_1d, predicted_logits, total.to(sum_exp_logits.dtype), exp_logits


def refuse_sharded_smoothing(wrapped, instance, args, kwargs):
    """``_VocabParallelCrossEntropy.forward(ctx, logits, target, label_smoothing=0.0[, tp_group])``."""
    if tpi.active():
        smoothing = argument(args, kwargs, 3, "label_smoothing", 0.0)
        group = argument(args, kwargs, 4, "tp_group", None)
        if group is None:
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
        if smoothing and smoothing > 0 and tpi.group_size(group) > 1:
            refuse_tp_invariant(
                f"vocab_parallel_cross_entropy(label_smoothing={smoothing}) at TP size {tpi.group_size(group)}",
                "upstream smooths with the mean log-prob over each rank's vocabulary shard, so the loss would "
                "depend on the TP size and differ between TP ranks; label_smoothing=0.0 or TP size 1 run")
    return wrapped(*args, **kwargs)
