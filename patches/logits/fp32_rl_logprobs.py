"""Megatron RL's old-policy log-probs under FP32 logits (Megatron-LM's ``megatron/rl/rl_utils.py``,
what ``train_rl.py`` runs).

Upstream computes them in ``_compute_logprobs_batch`` (``compute_logprobs_batch`` on main) and asserts
they come out in the training dtype (``assert logprobs.dtype == dtype``, BF16 under ``--bf16``): FP32
logits give FP32 log-probs and the job stopped there. With ``logits_dtype="fp32"`` the patch hands that
function FP32 as its dtype, so the old-policy log-probs (and the pipeline broadcast of them, on every
stage alike) stay FP32, as the logits they come from; the inference log-probs compared with them are
aligned into a copy of them, so Megatron RL's logged mismatch is taken in FP32 too.
"""

from __future__ import annotations

import torch

from megapatch.core import state
from megapatch.core.registry import Patch, Target
from megapatch.patches._common import MEGATRON_CORE_TESTED, when

RL_UTILS = "megatron.rl.rl_utils"
NAMES = ("_compute_logprobs_batch", "compute_logprobs_batch")  # <= 0.16.1, main


def _old_logprobs_in_fp32(wrapped, instance, args, kwargs):
    if "dtype" not in kwargs or state.current().logits_dtype != "fp32":
        return wrapped(*args, **kwargs)
    return wrapped(*args, **dict(kwargs, dtype=torch.float32))


def _probe():
    from megatron.rl import rl_utils

    if not any(hasattr(rl_utils, name) for name in NAMES):
        return (f"{RL_UTILS} has neither {' nor '.join(NAMES)}: the old-policy log-prob computation "
                f"moved, and FP32 logits would meet its BF16 assertion")
    return None


PATCHES = (
    Patch(
        name="logits.fp32_rl_logprobs",
        supports=MEGATRON_CORE_TESTED,
        option="logits_dtype",
        summary="Megatron RL's old-policy log-probs stay FP32 under FP32 logits (upstream asserted BF16)",
        hook=RL_UTILS,
        applies=when("logits_dtype", "fp32"),
        probe=_probe,
        targets=tuple(Target(RL_UTILS, name, _old_logprobs_in_fp32, optional=True) for name in NAMES),
    ),
)
