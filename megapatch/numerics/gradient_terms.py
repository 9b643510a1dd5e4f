"""Where a weight gradient's terms come from, for the exact data-parallel sum (``exact_sum``):
one term per sequence of a micro-batch (``by_sequence``: the micro-batch size does not move the sum)
and one per source data-parallel rank of an expert's tokens (``source_terms``: nor does the EP size).
Without DDP's exact sum an expert gradient's sources go through the fixed tree (``source_sum``)."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import torch

from megapatch.numerics import block_tree as tpi


#: on a parameter: a callable that deposits a list of gradients into the exact data-parallel sum,
#: each a term of its own (set by ``tp_invariant.data_parallel`` on the parameters DDP's hook
#: feeds). With it, a micro-batch of several sequences hands over one weight-gradient term per
#: sequence, each computed exactly as a micro-batch of that sequence alone computes its gradient:
#: the exact sum then gets the same terms at every micro-batch size.
SEQUENCE_TERMS = "_megapatch_sequence_terms"


def sequences(t: torch.Tensor) -> int:
    """The number of sequences in an activation of Megatron's ``[s, b, ...]`` layout."""
    return t.shape[1] if t.dim() >= 3 else 1


def cuts(t: torch.Tensor, packed) -> int:
    """The sequences a weight gradient over ``t``'s tokens is cut into: a packed bin's segments
    (``packed_bins.PackedBin``), else the micro-batch's sequences."""
    return packed.count() if packed is not None else sequences(t)


def cut(t: torch.Tensor, i: int, packed) -> torch.Tensor:
    """Sequence ``i`` of ``t`` as an unpacked micro-batch of it alone holds it: a packed bin's segment at
    the top of a zero frame of the bin's length, else column ``i`` of the ``[s, b, ...]`` layout."""
    return packed.frame(t, i) if packed is not None else tpi.sequence(t, i)


def tied(param) -> bool:
    """A weight two layers of one pipeline stage use (tied embeddings at PP 1: megatron-core marks
    it ``zero_out_wgrad``): autograd would add its two gradients in one ``.grad`` per micro-batch."""
    return bool(getattr(param, "zero_out_wgrad", False))


def by_sequence(param, batch: int, term, whole):
    """``param``'s gradient from a micro-batch of ``batch`` sequences: ``whole()`` (the micro-batch's
    sum) unless the parameter's gradient goes into the exact data-parallel sum; then ``term(i)``
    (sequence i's gradient, rounded as the returned gradient is) for every sequence, each but the
    first deposited there as a term of its own, the first returned for DDP's hook to deposit. A tied
    weight deposits every term, at every micro-batch size, and returns zeros: its other use's terms
    then stay terms of their own too, instead of meeting the first sequence's in one ``.grad``."""
    shared = tied(param)
    sink = getattr(param, SEQUENCE_TERMS, None) if (batch > 1 or shared) and tpi.active() else None
    if sink is None:
        return whole()
    return _hand_over(sink, [term(i) for i in range(batch)], shared)


def _hand_over(sink, terms: List[torch.Tensor], shared: bool) -> torch.Tensor:
    """The gradient to give autograd when ``terms`` are a parameter's terms of the exact sum: the
    first (DDP's hook deposits it), the others deposited through ``sink``; for a tied weight all of
    them through ``sink``, and zeros to autograd (so DDP's hook still runs for the parameter)."""
    if shared:
        sink(terms)
        return torch.zeros_like(terms[0])
    if len(terms) > 1:
        sink(terms[1:])
    return terms[0]


_moe_sequences = [1]


def note_moe_sequences_per_call(n: int) -> None:
    """Record that the MoE layer just run split its micro-batch into calls of one sequence each
    (``n`` sequences; 1: one call on the whole micro-batch)."""
    _moe_sequences[0] = n


def moe_sequences_per_call() -> int:
    """The last MoE layer's sequences run one at a time (1 when it ran the micro-batch whole):
    each of those calls' aux and z losses is one sequence's."""
    return _moe_sequences[0]


@dataclasses.dataclass(frozen=True)
class TokenSources:
    """Where a routed expert's input rows come from, for the GEMMs on them and the sum of its weight
    gradient over them: ``counts[i]`` consecutive rows from data-parallel rank ``leaves[i]`` (that
    rank's tokens routed to this expert, in sequence order), in this rank's row order; ``group``:
    the ranks that hold the same expert weights and receive the other data-parallel ranks' rows
    (expert data parallel); ``total``: the data-parallel size, the number of leaves of the tree."""

    counts: Tuple[int, ...]
    leaves: Tuple[int, ...]
    group: Any
    total: int

    def segments(self) -> List[slice]:
        found, start = [], 0
        for n in self.counts:
            found.append(slice(start, start + n))
            start += n
        return found


def _segments(sources: Optional[TokenSources], rows: int) -> List[slice]:
    return [slice(0, rows)] if sources is None else sources.segments()


def by_source(f, sources: Optional[TokenSources], rows: int) -> torch.Tensor:
    """``f(rows)`` over each source's rows (all rows without sources), concatenated: every GEMM on an
    expert's tokens sees one data-parallel rank's tokens, however many ranks' an EP rank received."""
    parts = [f(rows_) for rows_ in _segments(sources, rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def source_terms(param, parts: Sequence[torch.Tensor], sources: TokenSources, dtype) -> torch.Tensor:
    """An expert weight gradient from its per-source FP32 partials. Where the parameter's gradient
    goes into the exact data-parallel sum (``SEQUENCE_TERMS``), each source's partial is rounded to
    ``dtype`` and is a term of that sum of its own -- as a dense layer's micro-batch gradient is: a
    source's tokens give the same term whichever EP rank computed them, and whether they arrive as
    another data-parallel rank's micro-batch or as this rank's next one, so the sum is independent
    of the EP size and of the data-parallel size. Elsewhere (no DDP) the fixed tree over the sources
    (``source_sum``)."""
    sink = getattr(param, SEQUENCE_TERMS, None) if tpi.active() else None
    if sink is None:
        return source_sum(parts, sources).to(dtype)
    return _hand_over(sink, [part.to(dtype) for part in parts], tied(param))


def source_sum(parts: Sequence[torch.Tensor], sources: TokenSources) -> torch.Tensor:
    """An expert weight gradient from its per-source FP32 partials (one per entry of
    ``sources.counts``): the partials of every data-parallel rank's tokens, gathered over the
    expert-data-parallel ``group``, added in one fixed tree in data-parallel rank order, kept on the
    group's rank 0 (``on_root``: upstream's DDP then all-reduces expert gradients over that group).
    The same bits whichever EP rank received which data-parallel rank's tokens."""
    if sources.total & (sources.total - 1):
        from megapatch.core.errors import UnsupportedConfigurationError

        raise UnsupportedConfigurationError(
            f"megapatch tp_invariant: an expert weight gradient over {sources.total} data-parallel ranks "
            f"without DDP's exact sum: the fixed tree over the ranks needs a power-of-two data-parallel size. "
            f"Wrap the model in megatron-core's DistributedDataParallel (its exact sum takes any size), or "
            f"run a power-of-two data-parallel size")
    local = torch.stack(list(parts))
    leaves = torch.tensor(sources.leaves, dtype=torch.long)
    n = tpi.group_size(sources.group)
    if n > 1:
        gathered = torch.empty((n * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
        tpi.all_gather_single(gathered, local.contiguous(), group=sources.group)
        every = torch.empty(n * leaves.numel(), dtype=torch.long)
        tpi.all_gather_single(every, leaves, group=sources.group)
        local, leaves = gathered, every
    order = sorted(range(leaves.numel()), key=lambda i: int(leaves[i]))
    if [int(leaves[i]) for i in order] != list(range(sources.total)):
        raise ValueError(f"expert gradient sources {sorted(leaves.tolist())} do not cover the "
                         f"{sources.total} data-parallel ranks once each")
    return tpi.on_root(tpi.tree_sum([local[i] for i in order]), sources.group)
