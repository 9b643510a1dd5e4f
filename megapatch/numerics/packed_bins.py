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

The bin is known where the model is called (``GPTModel.forward``'s ``packed_seq_params``) and read by
the mode's autograd Functions when their forward runs (``current``), which keep it for their backward.
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


def from_params(packed) -> Optional[PackedBin]:
    """The bin ``packed_seq_params`` describes (its query side), or None where it is not a THD bin of
    two or more segments (one sequence filling the bin is an unpacked micro-batch already)."""
    if packed is None or getattr(packed, "qkv_format", None) != "thd":
        return None
    cu = getattr(packed, "cu_seqlens_q", None)
    if cu is None:
        return None
    bounds = [int(v) for v in cu.tolist()]
    padded = getattr(packed, "cu_seqlens_q_padded", None)
    starts = [int(v) for v in padded.tolist()] if padded is not None else bounds
    rows = max(starts[-1], bounds[-1])
    segments: List[Tuple[int, int]] = []
    row = 0
    for start, begin, end in zip(starts, bounds, bounds[1:]):
        length = end - begin
        if length <= 0:
            continue
        if start > row:
            segments.append((row, start - row))
        segments.append((start, length))
        row = start + length
    if rows > row:
        segments.append((row, rows - row))
    return PackedBin(tuple(segments), rows) if len(segments) > 1 else None


def current(t: torch.Tensor, split: int = 1) -> Optional[PackedBin]:
    """The bin the model is running on, for an activation ``t`` of the ``[s, 1, ...]`` layout whose
    sequence dimension holds the bin (``split``: 1/split of it, sequence parallelism's share): None
    outside a packed forward and for tensors of other rows (an expert's routed tokens), whose callers
    cut them otherwise or not at all."""
    found = _BIN.get()
    rows = t.shape[0] * split
    if found is None or t.dim() < 3 or t.shape[1] != 1 or rows < found.rows:
        return None
    if rows > found.rows:  # rows past the last cu_seqlens entry (a bin padded further): one more segment
        return PackedBin(found.segments + ((found.rows, rows - found.rows),), rows)
    return found


def for_tokens(tokens: torch.Tensor) -> Optional[PackedBin]:
    """The bin, for the model's input ids (``[1, rows]``: a packed bin is one row)."""
    found = _BIN.get()
    if found is None or tokens.dim() != 2 or tuple(tokens.shape) != (1, found.rows):
        return None
    return found


@contextlib.contextmanager
def running(bin_: Optional[PackedBin]) -> Iterator[None]:
    token = _BIN.set(bin_)
    try:
        yield
    finally:
        _BIN.reset(token)
