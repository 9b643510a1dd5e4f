"""Megatron RL's train-vs-rollout mismatch in the job log: one line per RL step, rank 0.

Megatron-LM's ``train_rl.py`` compares, each time it collects rollouts, the trainer's old-policy
log-probs with the log-probs the rollout engine reported for the same tokens, in
``megatron.rl.rl_utils.update_inference_logprobs_group_stats(old_logprobs, inference_logprobs, mask,
group_stats)`` (core_v0.16.1 and main alike; both its unpacked path, ``align_unpacked_inference_logprobs``,
and its packed one, ``sequence_packing_utils.compute_packed_inference_logprobs_stats``, call it with
the two tensors aligned and the mask of generated tokens). It fills ``RolloutStats``
(``*_inf_train_prob_abs_diff``, ``*_piold_to_inf_prob``) and hands them to its W&B writer only (on the
last rank; TensorBoard gets the mean reward alone): without W&B no one sees them.

The patch lets upstream compute them, unchanged, then rank 0 writes one line through megapatch's job
log (the ``"megapatch"`` logger at INFO, as the activation line): upstream's own figures read back
from its ``RolloutStats`` (max and mean |p_train - p_inf|, min and max p_old / p_inf), and the share of
the same masked tokens whose two log-probs are bit-identical (compared in the dtype upstream compares
them in: the promotion of the two tensors' dtypes), which upstream does not compute. The figures are
rank 0's data-parallel share of the rollouts (upstream's W&B figures are the last rank's).

Cost: nothing measurable. Ranks other than 0 pass straight through; rank 0 compares two
[sequences, tokens] tensors once per collection (one host sync, beside upstream's nine). So it needs
no option: it is on wherever megapatch is enabled (``MEGAPATCH_SKIP_PATCHES=rl_report.mismatch`` leaves
it out).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from megapatch.core import report
from megapatch.core.call_args import argument
from megapatch.core.registry import Patch, Target
from megapatch.patches._common import MEGATRON_CORE_TESTED

RL_UTILS = "megatron.rl.rl_utils"
STATS = "update_inference_logprobs_group_stats"
NAME = "rl_report.mismatch"
#: upstream's RolloutStats fields the line states, in its order
FIELDS = ("max_inf_train_prob_abs_diff", "mean_inf_train_prob_abs_diff", "min_piold_to_inf_prob",
          "max_piold_to_inf_prob")
_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def bit_identical(old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor,
                  mask: torch.Tensor) -> Tuple[int, int]:
    """``(identical, compared)``: of the ``mask``-ed tokens, how many have bit-identical log-probs,
    compared in the dtype upstream's arithmetic promotes the two to (a BF16 trainer log-prob against
    an FP32 engine one is compared as FP32). Bits, not values: -0.0 and 0.0 differ, a NaN equals the
    same NaN."""
    dtype = torch.promote_types(old_logprobs.dtype, inference_logprobs.dtype)
    a = old_logprobs.detach().to(dtype).contiguous()
    b = inference_logprobs.detach().to(dtype).contiguous().to(a.device)
    ints = _INTS[a.element_size()]
    mask = mask.to(device=a.device, dtype=torch.bool)
    same = (a.view(ints) == b.view(ints)) & mask
    return int(same.sum().item()), int(mask.sum().item())


def _number(value) -> str:
    return "n/a" if value is None else repr(float(value))


def _share(identical: int, compared: int) -> str:
    # floored: 99.999% of the tokens never reads as 100%
    return f"{math.floor(10000 * identical / compared) / 100:.2f}%"


def mismatch_line(stats, identical: int, compared: int, dtype: torch.dtype,
                  iteration: Optional[int] = None) -> str:
    """The job-log line for one RL step: ``stats`` is upstream's ``RolloutStats`` after
    ``update_inference_logprobs_group_stats`` filled it; ``iteration`` Megatron-LM's own numbering of
    the training iteration these rollouts feed (its ``iteration N/M`` log lines)."""
    when = f"iteration {iteration}: " if iteration is not None else ""
    head = f"megapatch {NAME}: {when}train vs rollout log-probs"
    if compared == 0:
        return f"{head}: no generated tokens to compare (rank 0)"
    figure = {name: _number(getattr(stats, name, None)) for name in FIELDS}
    kind = str(dtype).replace("torch.", "")
    return (f"{head} of {compared} generated tokens (rank 0, {kind}): "
            f"max |p_train - p_inf| {figure['max_inf_train_prob_abs_diff']}, "
            f"mean {figure['mean_inf_train_prob_abs_diff']}; "
            f"p_old/p_inf min {figure['min_piold_to_inf_prob']}, max {figure['max_piold_to_inf_prob']}; "
            f"bit-identical {identical}/{compared} ({_share(identical, compared)})")


def _iteration() -> Optional[int]:
    """The training iteration these rollouts feed, as Megatron-LM's log numbers it: upstream collects
    them with ``args.curr_iteration`` at the iterations done so far (its W&B step), and logs the step
    that trains on them as that + 1."""
    try:
        from megatron.training.global_vars import get_args

        done = getattr(get_args(), "curr_iteration", None)
    except Exception:  # noqa: BLE001 -- no Megatron-LM arguments (a script of its own): no number
        return None
    return done + 1 if isinstance(done, int) else None


def _report_stats(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if report.job_rank() != 0:
        return result
    try:
        old = argument(args, kwargs, 0, "old_logprobs")
        inference = argument(args, kwargs, 1, "inference_logprobs")
        mask = argument(args, kwargs, 2, "mask")
        stats = argument(args, kwargs, 3, "group_stats")
        identical, compared = bit_identical(old, inference, mask)
        dtype = torch.promote_types(old.dtype, inference.dtype)
        line = mismatch_line(stats, identical, compared, dtype, _iteration())
    except Exception as exc:  # noqa: BLE001 -- a report never stops the training it reports on
        report.once(f"{NAME}:failed:{type(exc).__name__}", "warning",
                    f"megapatch {NAME}: could not report this step's mismatch ({type(exc).__name__}: {exc})")
        return result
    report.job_line("info", line)
    return result


PATCHES = (
    Patch(
        name=NAME,
        supports=MEGATRON_CORE_TESTED,
        option=None,
        summary="Megatron RL's train-vs-rollout log-prob mismatch, one job-log line per RL step on rank 0 "
                "(upstream's figures and the share of bit-identical log-probs)",
        hook=RL_UTILS,
        applies=lambda settings: True,  # reporting only, at no cost: wherever megapatch is enabled
        targets=(Target(RL_UTILS, STATS, _report_stats,
                        params=("old_logprobs", "inference_logprobs", "mask", "group_stats")),),
    ),
)
