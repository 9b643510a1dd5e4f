"""Which parallel layout the mode's layers are built with: the TP group where megatron's parallel
state is set up, the (EP, expert TP) sizes of a block's process groups, and each EP rank's
data-parallel rank."""

from __future__ import annotations

import torch

from megapatch.numerics import expert_call


def tp_group_if_initialised():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def collection_layout(pg_collection):
    """``(EP, expert TP)`` of the process groups a block is built with, where it is given its own
    (Megatron RL's rollout model at another TP/EP size than the trainer's parallel state)."""
    ep, etp = (getattr(pg_collection, name, None) for name in ("ep", "expt_tp"))
    if ep is None or etp is None:
        return None
    return ep.size(), etp.size()


def expert_layout():
    """``(EP, expert TP)`` of megatron's parallel state (what the layers are built with, whatever
    the config says), or None before it is initialised."""
    if tp_group_if_initialised() is None:
        return None
    from megatron.core import parallel_state

    return (parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size())


data_parallel = expert_call.data_parallel


def ep_data_parallel_ranks(dispatcher):
    """The data-parallel rank of each EP rank of the dispatcher's group, in EP rank order."""
    found = getattr(dispatcher, "_megapatch_ep_dp_ranks", None)
    if found is None:
        rank, _, _ = data_parallel()
        ranks = [torch.zeros(1, dtype=torch.long) for _ in range(dispatcher.ep_size)]
        torch.distributed.all_gather(ranks, torch.tensor([rank]), group=dispatcher.ep_group)
        found = dispatcher._megapatch_ep_dp_ranks = [int(r) for r in ranks]
    return found
