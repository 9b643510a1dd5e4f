"""Megatron RL's trainer-side log-probs (Megatron-LM's ``megatron/rl/rl_utils.py``, what
``train_rl.py`` runs), under FP32 logits and under ``tp_invariant``.

Upstream computes the trainer's log-probs in ``selective_log_softmax``: for FP32 logits as
``x - logsumexp(x)`` per row, for BF16 logits as a BF16 ``log_softmax`` per row. The rollout engine
computes its log-probs as ``log_softmax(logits.float())`` (``DynamicInferenceContext.calculate_log_probs``).
``update_inference_logprobs_group_stats`` then logs the difference between the two.

- ``logits.fp32_rl_logprobs`` (``logits_dtype="fp32"``): upstream computes the old-policy log-probs
  in ``_compute_logprobs_batch`` (``compute_logprobs_batch`` on main) and asserts they come out in
  the training dtype (``assert logprobs.dtype == dtype``, BF16 under ``--bf16``): FP32 logits give
  FP32 log-probs and the job stopped there. The patch hands that function FP32 as its dtype, so the
  old-policy log-probs (and the pipeline broadcast of them, on every stage alike) stay FP32, as the
  FP32 logits they come from; the inference log-probs compared with them are aligned into a copy of
  them, so the logged mismatch is taken in FP32 too.
- ``tp_invariant.rl_logprobs`` (``tp_invariant=True``): the trainer's log-probs take the engine's
  arithmetic -- each row's logits upcast to FP32, ``log_softmax`` over the vocabulary, the label's
  entry gathered, returned in the logits' dtype -- so that a rollout and the trainer that see the
  same logits log the same log-probs bit for bit, not "the same up to the formula". Rows stay one
  at a time, as upstream loops them (peak memory).
"""

from __future__ import annotations

import torch

from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.core.registry import Patch, Target
from megapatch.patches._common import MEGATRON_CORE_TESTED, tp_invariant_patch, when

RL_UTILS = "megatron.rl.rl_utils"


def _old_logprobs_in_fp32(wrapped, instance, args, kwargs):
    if "dtype" not in kwargs or state.current().logits_dtype != "fp32":
        return wrapped(*args, **kwargs)
    return wrapped(*args, **dict(kwargs, dtype=torch.float32))


def _old_logprobs_probe():
    from megatron.rl import rl_utils

    names = ("_compute_logprobs_batch", "compute_logprobs_batch")
    if not any(hasattr(rl_utils, name) for name in names):
        return (f"{RL_UTILS} has neither {' nor '.join(names)}: the old-policy log-prob computation "
                f"moved, and FP32 logits would meet its BF16 assertion")
    return None


def engine_log_probs(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The log-probs of ``index`` under ``logits`` [..., vocab] with the rollout engine's arithmetic
    (an FP32 ``log_softmax`` over the vocabulary), one leading row at a time, in ``logits.dtype``."""
    rows = [torch.nn.functional.log_softmax(row.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            for row, labels in zip(logits, index)]
    return torch.stack(rows).to(logits.dtype)


def _selective_log_softmax(wrapped, instance, args, kwargs):
    if not state.current().tp_invariant:
        return wrapped(*args, **kwargs)
    return engine_log_probs(argument(args, kwargs, 0, "logits"), argument(args, kwargs, 1, "index"))


PATCHES = (
    Patch(
        name="logits.fp32_rl_logprobs",
        supports=MEGATRON_CORE_TESTED,
        option="logits_dtype",
        summary="Megatron RL's old-policy log-probs stay FP32 under FP32 logits (upstream asserted BF16)",
        hook=RL_UTILS,
        applies=when("logits_dtype", "fp32"),
        probe=_old_logprobs_probe,
        targets=(
            Target(RL_UTILS, "_compute_logprobs_batch", _old_logprobs_in_fp32, optional=True),  # <= 0.16.1
            Target(RL_UTILS, "compute_logprobs_batch", _old_logprobs_in_fp32, optional=True),   # main
        ),
    ),
    tp_invariant_patch(
        name="tp_invariant.rl_logprobs",
        summary="Megatron RL's trainer log-probs take the rollout engine's arithmetic (FP32 log_softmax)",
        hook=RL_UTILS,
        targets=(Target(RL_UTILS, "selective_log_softmax", _selective_log_softmax, params=("logits", "index")),),
    ),
)
