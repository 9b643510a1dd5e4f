"""RoPE of packed sequences under ``tp_invariant``: every sequence of a bin rotated from position 0,
as the rollout engine rotates it.

Megatron RL packs several sequences into one bin (``--rl-use-sequence-packing``) and passes
``PackedSeqParams`` whose ``cu_seqlens`` end at the bin's size, the size the rotary table is built
for. megatron-core's ``_apply_rotary_pos_emb_thd`` (core_v0.16.1 on) reads a table as long as the
bin as one of per-token positions and rotates a bin's second sequence from its offset in the bin
(its "exact mapping with offsets" case), while the rollout engine rotates each sequence from 0.
RoPE is relative, so the two give the same scores in exact arithmetic but not the same rounding:
trainer and rollout log-probs differed by ~3.5e-5 in bins of two sequences (0 in bins of one;
results/tp_invariant_long_context.md). Under the mode a plain position table (row p = p x row 1,
what ``RotaryEmbedding`` builds) is cut to the longest sequence, which takes upstream's own
per-sequence case: positions restart at each sequence. A table that is not the plain one (mRoPE
and other per-token positions, where the offsets carry meaning; a table built with
``seq_len_interpolation_factor``) is left to upstream, as is context parallelism, which the mode's
attention refuses.
"""

from __future__ import annotations

import torch

from megapatch.core.call_args import argument, with_argument
from megapatch.core.registry import Target
from megapatch.numerics import block_tree as tpi
from megapatch.patches.tp_invariant._mode import tp_invariant_patch

ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"


def is_position_table(freqs: torch.Tensor) -> bool:
    """Row p of the table is p times row 1 (and row 0 is zero): the table of positions 0..S-1 that
    ``RotaryEmbedding.forward`` builds (``outer(arange(S), inv_freq)``, exact at every integer p)."""
    if freqs.dim() < 1 or freqs.size(0) < 2 or not freqs.is_floating_point():
        return False
    positions = torch.arange(freqs.size(0), dtype=freqs.dtype, device=freqs.device)
    positions = positions.view(-1, *([1] * (freqs.dim() - 1)))
    return bool(torch.equal(freqs, positions * freqs[1:2]))


def rows_from_zero(cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int) -> torch.Tensor | None:
    """The table cut to the longest sequence where upstream would rotate a bin's later sequences
    from their offsets; ``None`` where upstream already starts each at 0 (or must keep its table)."""
    total = int(cu_seqlens[-1])
    if cp_size != 1 or freqs.dim() < 1 or freqs.size(0) != total:
        return None
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if longest >= total or not is_position_table(freqs):
        return None  # one sequence (offset 0 already), or a table of other positions
    return freqs[:longest]


def _thd_rope(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    cu_seqlens = argument(args, kwargs, 1, "cu_seqlens")
    freqs = argument(args, kwargs, 2, "freqs")
    cp_group = argument(args, kwargs, 6, "cp_group", None)
    cut = rows_from_zero(cu_seqlens, freqs, cp_group.size() if cp_group is not None else 1)
    if cut is None:
        return wrapped(*args, **kwargs)
    args, kwargs = with_argument(args, kwargs, 2, "freqs", cut)
    return wrapped(*args, **kwargs)


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.packed_rope",
        summary="packed sequences (THD) rotated from position 0 each, as the rollout engine rotates "
                "them, not from their offsets in the bin",
        hook=ROPE_UTILS,
        targets=(
            Target(ROPE_UTILS, "_apply_rotary_pos_emb_thd", _thd_rope, params=("t", "cu_seqlens", "freqs")),
        ),
    ),
)
