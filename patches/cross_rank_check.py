"""Publish this rank's megapatch settings when megatron-core sets up model parallelism, so the
first patched collective of any peer can verify that its whole TP group agrees
(see ``megapatch.consistency``)."""

from __future__ import annotations

from megapatch import consistency, state
from megapatch.registry import Patch, Target


def _initialize_model_parallel(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    consistency.publish(state.current())
    return result


PATCHES = (
    Patch(
        name="cross_rank.publish_settings",
        option=None,
        summary="publish this rank's settings for the cross-rank agreement check",
        hook="megatron.core.parallel_state",
        applies=lambda s: bool(s.requested()),
        targets=(Target("megatron.core.parallel_state", "initialize_model_parallel",
                        _initialize_model_parallel),),
    ),
)
