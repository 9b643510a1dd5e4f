"""Publish this rank's megapatch settings when megatron-core sets up model parallelism -- on every
rank where megapatch is enabled, native settings included -- and verify the tensor-parallel group
there (see ``megapatch.consistency``). Megatron-LM imports megatron before the process group exists,
so this is the first moment a rank explicitly set to ``native`` can tell its peers."""

from __future__ import annotations

from megapatch import consistency, state
from megapatch.registry import Patch, Target


def _initialize_model_parallel(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    consistency.model_parallel_initialized(state.current())
    return result


PATCHES = (
    Patch(
        name="cross_rank.publish_settings",
        supports={"megatron-core": ">=0.12,<0.21"},  # tested: results/matrix, README "Supported versions"
        option=None,
        summary="publish this rank's settings and check its TP group at model-parallel initialisation",
        hook="megatron.core.parallel_state",
        applies=lambda s: True,
        targets=(Target("megatron.core.parallel_state", "initialize_model_parallel",
                        _initialize_model_parallel),),
    ),
)
