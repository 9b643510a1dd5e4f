"""Vocab-parallel cross entropy under the mode: the sum of exp(logits) over the vocabulary goes
through the fixed tree and is handed to upstream's all-reduce on TP rank 0 only (zeros elsewhere:
a sum of one value and zeros is exact). The logits max and the target-logit sum (one non-zero per
token) are exact in any order."""

from __future__ import annotations

from megapatch.numerics import block_tree as tpi


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
