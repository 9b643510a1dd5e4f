"""The refit of ``SequentialMLP`` experts between a trainer and a rollout model at expert parallelism,
under ``tp_invariant`` (megatron-core's ``resharding``, which Megatron RL's ``swap_model_weights`` runs
before each step's rollouts).

Upstream (core_v0.16.1 and main d98e8a6, ``resharding/utils.py``): the planner matches each destination
parameter to the source parameters of the same *resolved name*, and ``assign_ep_resolved_name_inplace``
rewrites a rank's local expert index into the global one -- but only in TEGroupedMLP's ``weightK`` /
``biasK`` names. megatron-core's ``SequentialMLP`` names its experts ``local_experts.K`` on every EP
rank, so at EP 2 with 4 experts global experts 0 and 2 share a name, the planner takes whichever source
comes first, and a rollout's EP rank 1 receives EP rank 0's experts (at an EP change the planner stops:
"Destination parameter ... not found"). Nothing fails where the two models hold the same experts per
rank name, e.g. before training has moved experts that one seed initialised alike; after that the
rollout runs part of its tokens through the wrong experts, and the train-vs-rollout mismatch the mode
promises to be 0 is not.

Under the mode the same function also rewrites ``local_experts.K`` of an expert-parallel parameter into
``local_experts.<global index>`` (EP rank x experts per rank + K, as upstream computes it for
``weightK``), so a destination expert is sourced from the trainer's rank that holds that global expert.
"""

from __future__ import annotations

from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.patches.tp_invariant._mode import tp_invariant_patch

RESHARDING = "megatron.core.resharding.utils"
LOCAL_EXPERTS = "local_experts"


def global_expert_name(name: str, ep_ranks, owner_rank: int, num_experts: int):
    """``(name with local_experts.K rewritten to the global index, that index)``, or ``(name, None)``
    where ``name`` holds no ``local_experts.K``."""
    parts = name.split(".")
    found = [i for i in range(len(parts) - 1) if parts[i] == LOCAL_EXPERTS and parts[i + 1].isdigit()]
    if not found:
        return name, None
    slot = found[-1] + 1
    index = list(ep_ranks).index(owner_rank) * (num_experts // len(ep_ranks)) + int(parts[slot])
    parts[slot] = str(index)
    return ".".join(parts), index


def _assign_ep_resolved_name(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    meta = argument(args, kwargs, 0, "meta")
    if (not state.current().tp_invariant or not meta.is_ep or meta.global_expert_index is not None
            or not meta.expert_parallel_group_ranks or not meta.num_experts):
        return result
    name, index = global_expert_name(meta.resolved_name, meta.expert_parallel_group_ranks, meta.owner_rank,
                                     meta.num_experts)
    if index is not None:
        meta.resolved_name, meta.global_expert_index = name, index
    return result


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.rl_refit",
        summary="the trainer-to-rollout refit matches SequentialMLP experts by their global index at EP > 1 "
                "(upstream matches them by their local index only)",
        hook=RESHARDING,
        targets=(Target(RESHARDING, "assign_ep_resolved_name_inplace", _assign_ep_resolved_name,
                        params=("meta", "base_name")),),
    ),
)
