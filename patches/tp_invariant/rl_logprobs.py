"""Megatron RL's trainer-side log-probs under ``tp_invariant`` (Megatron-LM's ``megatron/rl/rl_utils.py``,
what ``train_rl.py`` runs).

Upstream computes them in ``selective_log_softmax``: for FP32 logits as ``x - logsumexp(x)`` per row,
for BF16 logits as a BF16 ``log_softmax`` per row. The rollout engine computes its log-probs as
``log_softmax(logits.float())`` (``DynamicInferenceContext.calculate_log_probs``), and
``update_inference_logprobs_group_stats`` logs the difference. Under the mode the trainer's log-probs
take the engine's arithmetic -- each row's logits upcast to FP32, ``log_softmax`` over the vocabulary,
the label's entry gathered, returned in the logits' dtype -- so that a rollout and the trainer that
see the same logits log the same log-probs bit for bit, not "the same up to the formula". Rows stay
one at a time, as upstream loops them (peak memory).
"""

from __future__ import annotations

import torch

from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.patches.tp_invariant._mode import tp_invariant_patch

RL_UTILS = "megatron.rl.rl_utils"


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
    tp_invariant_patch(
        name="tp_invariant.rl_logprobs",
        summary="Megatron RL's trainer log-probs take the rollout engine's arithmetic (FP32 log_softmax)",
        hook=RL_UTILS,
        targets=(Target(RL_UTILS, "selective_log_softmax", _selective_log_softmax, params=("logits", "index")),),
    ),
)
