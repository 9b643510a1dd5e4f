"""Packed (THD) bins under ``tp_invariant``: where each sequence of a bin sits, so that a weight
gradient's sum over tokens cuts at sequence boundaries inside the bin.

A micro-batch of several sequences hands the exact data-parallel sum one weight-gradient term per
sequence (``gradient_terms.by_sequence``). A packed bin is one row of ``[t, 1, ...]`` holding several
sequences; here each of its segments gives the term an unpacked micro-batch of that sequence alone
gives: the segment's rows at the top of a zero frame as long as the bin (an unpacked micro-batch is
a sequence padded to the same length, whose padding rows carry zero gradients), so the GEMMs and the
token blocks have the shapes of the unpacked run. Rows no sequence covers (the padding between
``cu_seqlens_*_padded`` slots, or after the last sequence) are segments of their own: every row's
gradient reaches the sum once.

The bin is known where megatron-core runs the model's parts with ``packed_seq_params``
(``tp_invariant.packed_bins``: the embedding, the block and each layer, the output layer) and read by the
mode's autograd Functions when their forward runs (``current``), which keep it for their backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, List, Optional, Tuple

import torch

_BIN = contextvars.ContextVar("megapatch_packed_bin", default=None)


@dataclasses.dataclass(frozen=True)
class PackedBin:
    """``segments``: ``(start, rows)`` of every sequence and every uncovered run of rows, in row order;
    ``rows``: the bin's length (the sequence dimension before sequence parallelism splits it)."""

    segments: Tuple[Tuple[int, int], ...]
    rows: int

    def count(self) -> int:
        return len(self.segments)

    def frame(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Segment ``i`` of ``t`` (``[rows, ...]``) at the top of a zero tensor of ``t``'s shape."""
        if t.shape[0] != self.rows:
            raise ValueError(f"megapatch tp_invariant: a packed bin of {self.rows} rows, a tensor of {t.shape[0]}")
        start, n = self.segments[i]
        out = t.new_zeros(t.shape)
        out[:n] = t[start:start + n]
        return out


def bounds(packed, which: str = "q") -> Optional[Tuple[List[int], List[int]]]:
    """``(starts, lengths)`` of a THD bin's sequences on the query (``"q"``) or key (``"kv"``) side: each
    sequence's first row (``cu_seqlens_*_padded`` where given, else ``cu_seqlens_*``) and its token count;
    None without ``cu_seqlens_*``."""
    actual = getattr(packed, f"cu_seqlens_{which}", None)
    if actual is None:
        return None
    ends = [int(v) for v in actual.tolist()]
    padded = getattr(packed, f"cu_seqlens_{which}_padded", None)
    starts = [int(v) for v in padded.tolist()] if padded is not None else ends
    return starts, [end - start for start, end in zip(ends, ends[1:])]


def from_params(packed) -> Optional[PackedBin]:
    """The bin ``packed_seq_params`` describes (its query side), or None where it is not a THD bin of
    two or more segments (one sequence filling the bin is an unpacked micro-batch already)."""
    if packed is None or getattr(packed, "qkv_format", None) != "thd":
        return None
    found = bounds(packed)
    if found is None:
        return None
    starts, lengths = found
    segments: List[Tuple[int, int]] = []
    row = 0
    for start, length in zip(starts, lengths):
        if length <= 0:
            continue
        if start > row:
            segments.append((row, start - row))
        segments.append((start, length))
        row = start + length
    return _with_tail(tuple(segments), row, max(starts[-1], row))


def _with_tail(segments: Tuple[Tuple[int, int], ...], covered: int, rows: int) -> Optional[PackedBin]:
    """The bin of ``segments`` (covering rows up to ``covered``) over ``rows`` rows: the rows past them a
    segment of their own; None for one segment."""
    if rows > covered:
        segments += ((covered, rows - covered),)
    return PackedBin(segments, rows) if len(segments) > 1 else None


def _for_rows(rows: int) -> Optional[PackedBin]:
    """The running bin, for a tensor whose sequence dimension holds ``rows`` of it: None outside a packed
    forward or for fewer rows; rows past the last ``cu_seqlens`` entry (a bin padded further) are one
    more segment."""
    found = _running_bin()
    if found is None or rows < found.rows:
        return None
    return found if rows == found.rows else _with_tail(found.segments, found.rows, rows)


def current(t: torch.Tensor, split: int = 1) -> Optional[PackedBin]:
    """The bin the model is running on, for an activation ``t`` of the ``[s, 1, ...]`` layout whose
    sequence dimension holds the bin (``split``: 1/split of it, sequence parallelism's share): None
    outside a packed forward and for tensors of other rows (an expert's routed tokens), whose callers
    cut them otherwise or not at all."""
    if t.dim() < 3 or t.shape[1] != 1:
        return None
    return _for_rows(t.shape[0] * split)


def for_tokens(tokens: torch.Tensor) -> Optional[PackedBin]:
    """The bin, for the model's input ids (``[1, rows]``: a packed bin is one row)."""
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        return None
    return _for_rows(tokens.shape[1])


def _running_bin() -> Optional[PackedBin]:
    running_ = _BIN.get()
    return None if running_ is None else running_[1]


def running_for(packed) -> bool:
    """Whether the running bin was made from this ``packed_seq_params`` object (by an enclosing call:
    a layer inside its block reuses the block's bin instead of reading ``cu_seqlens`` again)."""
    running_ = _BIN.get()
    return running_ is not None and running_[0] is packed


@contextlib.contextmanager
def running(bin_: PackedBin, packed=None) -> Iterator[None]:
    """``bin_`` is the running bin inside the block (made from ``packed``, the ``packed_seq_params``)."""
    token = _BIN.set((packed, bin_))
    try:
        yield
    finally:
        _BIN.reset(token)
