"""RoPE of packed (THD) sequences under the mode (issue 49, ``tp_invariant.packed_rope``): each sequence
of a bin gets the bits the rollout engine gives it alone, rotated from position 0, where upstream rotates
a bin's later sequences from their offsets (same values in exact arithmetic, other rounding)."""

from __future__ import annotations

import pytest
import torch

HEADS, DIM = 3, 32


class _OneRank:
    """The two calls upstream's THD RoPE makes on its context-parallel group (no CP: one rank)."""

    def size(self):
        return 1

    def rank(self):
        return 0


def _table(seq: int):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds

    with cpu_workarounds():  # upstream builds the table on the current CUDA device
        return RotaryEmbedding(kv_channels=DIM, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)(seq)


def _tokens(total: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # position-dependent values: a token's bits differ with where it sits
    return (torch.randn(total, HEADS, DIM, generator=gen) * (1 + torch.arange(total).view(-1, 1, 1) / 7)).bfloat16()


def _thd(t, cu_seqlens, freqs, mode: bool):
    """megatron-core's ``_apply_rotary_pos_emb_thd`` through the patch's wrapper, the mode on or off."""
    from megatron.core.models.common.embeddings import rope_utils

    from megapatch.core import options, state
    from megapatch.patches.tp_invariant import packed_rope

    saved = state._current
    state._current = options.Settings(tp_invariant=mode)
    try:
        return packed_rope._thd_rope(rope_utils._apply_rotary_pos_emb_thd, None, (t, cu_seqlens, freqs),
                                     {"cp_group": _OneRank()})
    finally:
        state._current = saved


def _alone(t, cu_seqlens, freqs):
    """The oracle: each sequence rotated on its own from position 0, as the rollout engine's prefill
    rotates it (upstream's BSHD RoPE over that sequence's rows of the table)."""
    from megatron.core.models.common.embeddings import rope_utils

    bounds = cu_seqlens.tolist()
    return torch.cat([rope_utils._apply_rotary_pos_emb_bshd(t[a:b].unsqueeze(1), freqs[:b - a]).squeeze(1)
                      for a, b in zip(bounds, bounds[1:])])


@pytest.mark.quick("tp_invariant.packed_rope")
@pytest.mark.parametrize("lengths", [(37, 63, 28), (1, 99, 28), (64, 64)])
def test_each_packed_sequence_gets_the_bits_it_has_alone(lengths):
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    freqs, t = _table(total), _tokens(total)  # a table as long as the bin: upstream's offsets case
    oracle = _alone(t, cu_seqlens, freqs)
    assert torch.equal(_thd(t, cu_seqlens, freqs, mode=True), oracle)
    native = _thd(t, cu_seqlens, freqs, mode=False)
    first = lengths[0]
    assert torch.equal(native[:first], oracle[:first])  # the first sequence starts at 0 either way
    assert not torch.equal(native[first:], oracle[first:]), "upstream rotates later sequences from their offsets"
    # another rotation of each token, but the same scores within a sequence (RoPE is relative): upstream's
    # function in exact arithmetic, a rounding difference only
    a, b = first, first + lengths[1]
    scores = [torch.einsum("ihd,jhd->hij", x[a:b].double(), x[a:b].double()) for x in (native, oracle)]
    assert torch.allclose(scores[0], scores[1], rtol=0, atol=0.02 * scores[1].abs().max().item())


def test_what_upstream_already_starts_at_zero_or_must_keep_is_left_to_it():
    from megapatch.patches.tp_invariant.packed_rope import is_position_table, rows_from_zero

    cu_seqlens = torch.tensor([0, 40, 100], dtype=torch.int32)
    freqs = _table(100)
    assert is_position_table(freqs)
    assert rows_from_zero(cu_seqlens, freqs, cp_size=1).shape[0] == 60
    assert rows_from_zero(cu_seqlens, _table(128), cp_size=1) is None  # longer table: upstream starts at 0
    assert rows_from_zero(torch.tensor([0, 100], dtype=torch.int32), freqs, cp_size=1) is None  # one sequence
    assert rows_from_zero(cu_seqlens, freqs, cp_size=2) is None  # context parallelism: not this patch's
    per_token = freqs[torch.randperm(100, generator=torch.Generator().manual_seed(1))]  # mRoPE-like positions
    assert not is_position_table(per_token) and rows_from_zero(cu_seqlens, per_token, cp_size=1) is None
    t = _tokens(100)
    assert torch.equal(_thd(t, cu_seqlens, per_token, mode=True), _thd(t, cu_seqlens, per_token, mode=False))
