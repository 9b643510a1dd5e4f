"""The attributes the mode sets on upstream modules and parameters (expert sources and keys, the
dim TP splits, a gated fc1's halves), and the gated fc1 being called."""

from __future__ import annotations

import contextvars

from megapatch.numerics import expert_call
from megapatch.numerics import block_tree as tpi


SOURCES = expert_call.SOURCES  # on an expert MLP (or GroupedExpert): its rows' TokenSources (EP > 1)
EXPERTS = "_megapatch_local_experts"  # on a token dispatcher: its layer's local experts (MLPs, GroupedExperts)
EXPERT_KEY = "_megapatch_expert_key"  # on an expert parameter: (layer, global expert, parameter)
RESTORE = "_megapatch_restore"  # on a token dispatcher: the inverse of its EP-major row order
PARTITION_DIM = "_megapatch_partition_dim"  # on an expert's fc2 weight: the dim TP splits
GATED = tpi.GATED_HALVES


gated_fc1 = contextvars.ContextVar("megapatch_tp_invariant_gated_fc1", default=None)


def mark_gated_fc1(module) -> None:
    """The grad norm cuts a gated fc1's gradient as its dgrad tree does (``column_blocks``): it
    finds the parameters by this mark (and, for an optimizer's FP32 copies, through the optimizer)."""
    config = getattr(module, "config", None)
    fc1 = getattr(module, "linear_fc1", None)
    if fc1 is not None and getattr(config, "gated_linear_unit", False):
        for param in (getattr(fc1, "weight", None), getattr(fc1, "bias", None)):
            if param is not None:
                setattr(param, GATED, 2)
