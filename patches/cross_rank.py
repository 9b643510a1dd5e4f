"""Publish this rank's megapatch settings when megatron-core sets up model parallelism -- on every
rank where megapatch is enabled, native settings included -- and verify the tensor-parallel group
there (see ``megapatch.core.cross_rank``). Megatron-LM imports megatron before the process group exists,
so this is the first moment a rank explicitly set to ``native`` can tell its peers."""

from __future__ import annotations

from megapatch.core import cross_rank, state
from megapatch.core.registry import Patch, Target
from megapatch.patches._common import MEGATRON_CORE_TESTED


def _initialize_model_parallel(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    cross_rank.model_parallel_initialized(state.current())
    return result


PATCHES = (
    Patch(
        name="cross_rank.publish_settings",
        supports=MEGATRON_CORE_TESTED,
        option=None,
        summary="publish this rank's settings and check its TP group at model-parallel initialisation",
        hook="megatron.core.parallel_state",
        applies=lambda s: True,
        announces=True,
        targets=(Target("megatron.core.parallel_state", "initialize_model_parallel",
                        _initialize_model_parallel),),
    ),
)
