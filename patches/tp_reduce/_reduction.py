"""What the ``tp_reduce`` records share: whether a TP sum runs in FP32, and the mark by which an MoE
layer's expert fc2 hands on its FP32 accumulator."""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed import distributed_c10d as c10d

from megapatch.core import cross_rank, state
from megapatch.numerics.dtypes import LOW_PRECISION

#: on a RowParallelLinear of an MoE layer's experts (``tp_reduce.moe``): under fp32 it hands
#: on its FP32 accumulator unrounded, for the MoE layer to sum on and round once
MOE_FP32_SUM = "_megapatch_moe_fp32_sum"


def reduction_mode(tensor: torch.Tensor, group) -> Optional[str]:
    """The megapatch mode for summing ``tensor`` over ``group``, or None to run upstream's own
    collective (megapatch off, a group of one, or a tensor that is not BF16/FP16). The first call
    on a group verifies that every rank of the group runs the same settings."""
    settings = state.current()
    if settings.tp_reduce_dtype == "native":
        return None
    if group is None:
        group = c10d.group.WORLD
    if group.size() == 1:
        return None
    cross_rank.ensure_group_agrees(group, settings)
    if tensor.dtype not in LOW_PRECISION:
        return None
    return settings.tp_reduce_dtype
