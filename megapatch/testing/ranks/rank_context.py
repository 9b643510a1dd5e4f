"""Where a rank function of :func:`~megapatch.testing.ranks.harness.run_ranks` runs: its
:class:`RankContext` (global rank, megatron's parallel layout and groups, the job's scratch
directory), megatron's ``parallel_state`` initialised for it, and :func:`reinit_model_parallel`
to change the layout inside a running rank function."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping, Optional

__all__ = ["RankContext", "reinit_model_parallel"]


@dataclasses.dataclass
class RankContext:
    """Where a rank function runs: global rank and megatron's parallel layout.

    The groups are this process's live ``torch.distributed`` groups (``None``
    when megatron's parallel state was not initialised).  ``tmpdir`` is the
    job's scratch directory, shared by all ranks and removed afterwards.
    """

    rank: int
    world_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    vpp_size: Optional[int] = None
    dp_rank: int = 0
    dp_size: int = 1
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    tmpdir: str = ""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


# --- megatron parallel state ----------------------------------------------------


def _init_model_parallel(tp: int, pp: int, vpp: Optional[int], extra: Mapping[str, Any]) -> None:
    """Calls ``initialize_model_parallel`` with the arguments this version takes."""
    from megatron.core import parallel_state

    params = inspect.signature(parallel_state.initialize_model_parallel).parameters
    if vpp is not None and "virtual_pipeline_model_parallel_size" not in params:
        raise TypeError("this megatron-core's initialize_model_parallel takes no "
                        "virtual_pipeline_model_parallel_size")
    wanted = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp,
    }
    kwargs = {k: v for k, v in wanted.items() if k in params}
    kwargs.update(extra)
    parallel_state.initialize_model_parallel(**kwargs)


def _megatron_context(ctx: RankContext) -> RankContext:
    """``ctx`` with the ranks, sizes and groups of megatron's current parallel state."""
    from megatron.core import parallel_state as ps

    return dataclasses.replace(
        ctx,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
    )


def reinit_model_parallel(ctx: RankContext, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
                          **parallel_kwargs: Any) -> RankContext:
    """Re-initialises megatron's parallel state inside a running rank function.

    Every rank must call it with the same arguments (it creates process
    groups).  Destroys the current ``parallel_state`` and its process groups
    (models built under it hold destroyed groups: build new ones) and returns the context of the new
    layout.  Lets one job compare several TP/PP layouts without paying the
    start-up (import) cost of a job per layout.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    def groups(value):
        if isinstance(value, dist.ProcessGroup):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from groups(item)

    # megatron's destroy_model_parallel only drops its references: each gloo group lives on with its
    # threads (3 a group: 123 groups, ~370 threads a rank in the MoE tp_invariant job at TP 4).
    # Destroyed here, the 23 test files that start ranks took 293 s instead of 333 (results/test_time.md)
    def held():
        return {id(g): g for name, value in vars(parallel_state).items() if name.startswith("_")
                for g in groups(value)}

    before = held()
    parallel_state.destroy_model_parallel()
    kept = held()  # what megatron still refers to after its reset stays
    for key, group in before.items():
        if key not in kept and group is not dist.group.WORLD:
            try:
                dist.destroy_process_group(group)
            except ValueError:  # "Invalid process group": not in torch's registry (gone already)
                pass
    _init_model_parallel(tp, pp, vpp, parallel_kwargs)
    return _megatron_context(ctx)
