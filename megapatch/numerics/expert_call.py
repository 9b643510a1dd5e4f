"""One routed expert's forward under ``tp_invariant``: which expert MLP runs, its tokens' routing
probabilities and where its rows come from (``gradient_terms.TokenSources``).

The mode's MLP wrapper opens the call for the length of the expert's forward; the linear wrappers
of both implementations -- megatron-core's local layers and Transformer Engine's -- read it, so an
expert built from either takes the same arithmetic (fc2's input scaled by the probabilities inside
the fixed tree, each source's rows one block).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Optional

from megapatch.core.scope import scoped


@dataclass(frozen=True)
class ExpertCall:
    mlp: Any  # the expert's MLP: its linear_fc1 and linear_fc2 are the call's layers
    probabilities: Any  # [rows] routing probabilities, scaling fc2's input
    sources: Any  # gradient_terms.TokenSources of the rows, or None (one data-parallel rank)
    index: Optional[int] = None  # grouped-GEMM experts: which of the layer's experts (its weight<index>)


_current: contextvars.ContextVar[Optional[ExpertCall]] = contextvars.ContextVar(
    "megapatch_tp_invariant_expert_call", default=None)


def running(call: ExpertCall):
    """Context manager: ``call`` is the expert call being run on this thread."""
    return scoped(_current, call)


def of(layer) -> Optional[ExpertCall]:
    """The running expert call whose fc1 or fc2 ``layer`` is, else None (shared experts and dense
    MLPs run no expert call)."""
    call = _current.get()
    if call is None or not (layer is call.mlp.linear_fc1 or layer is call.mlp.linear_fc2):
        return None
    return call


def sources(layer):
    """The rows' ``TokenSources`` if ``layer`` is a running expert's fc1/fc2, else None."""
    call = of(layer)
    return call.sources if call is not None else None


def scale(layer):
    """The routing probabilities that scale ``layer``'s input (a running expert's fc2), else None."""
    call = of(layer)
    return call.probabilities if call is not None and layer is call.mlp.linear_fc2 else None


# -- where an expert's rows come from ----------------------------------------------------------

#: on an expert MLP (or a grouped-GEMM layer's ``GroupedExpert``): its rows' ``TokenSources``, set by
#: the alltoall dispatcher with expert parallelism
SOURCES = "_megapatch_token_sources"
#: on a grouped-GEMM experts layer (``TEGroupedMLP``): its ``GroupedExpert`` per local expert
_GROUPED = "_megapatch_grouped_experts"


class GroupedExpert:
    """One expert of a grouped-GEMM layer (which has no module per expert): what the dispatcher
    records the expert's token sources on, as it does on a ``SequentialMLP``'s expert MLP."""

    def __init__(self, layer, index: int):
        self.layer, self.index = layer, index

    def __repr__(self) -> str:
        return f"GroupedExpert({type(self.layer).__name__}, {self.index})"


def grouped_experts(layer, make: bool = True) -> Optional[list]:
    """The ``GroupedExpert`` of each of a grouped-GEMM layer's local experts (made once; ``make=False``:
    None where they were not made)."""
    found = layer.__dict__.get(_GROUPED)
    if found is None and make:
        found = [GroupedExpert(layer, i) for i in range(layer.num_local_experts)]
        object.__setattr__(layer, _GROUPED, found)  # a plain attribute: no submodule, no state dict entry
    return found


def data_parallel():
    """``(rank, size, expert-data-parallel group)``. Any size: each source rank's expert weight
    gradient is a term of the exact data-parallel sum (``gradient_terms.source_terms``)."""
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
            parallel_state.get_expert_data_parallel_group())


def token_sources(expert, rows: int):
    """Where ``expert``'s ``rows`` come from: what the dispatcher recorded (expert parallelism), else
    this data-parallel rank's tokens only, one source (None: one rank)."""
    recorded = getattr(expert, SOURCES, None)
    if recorded is not None:
        return recorded
    from megapatch.numerics import gradient_terms

    rank, size, group = data_parallel()
    return None if size == 1 else gradient_terms.TokenSources((rows,), (rank,), group, size)
