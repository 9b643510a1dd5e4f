"""One routed expert's forward under ``tp_invariant``: which expert MLP runs, its tokens' routing
probabilities and where its rows come from (``block_tree.TokenSources``).

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
    sources: Any  # block_tree.TokenSources of the rows, or None (one data-parallel rank)


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
