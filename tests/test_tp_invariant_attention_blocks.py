"""The mode's blocked core attention (issue 49): sequences over several key blocks within a BF16 bound of
an FP64 oracle and of upstream's own local attention, every row's bits independent of the query count,
the key padding, the batch and the engine's paging, packed (THD) sequences each with the bits it gets
alone (forward and gradients), and memory that grows with S x block, not S x S."""

from __future__ import annotations

import math

import pytest
import torch

from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds
from megapatch.testing.memory import LiveBytes
from tests.test_tp_invariant_fidelity import _module

BATCH, HEADS, GROUPS, DIM = 2, 4, 2, 32
#: a BF16 bound for outputs of magnitude ~1 computed in other orders: a few BF16 ulps
BF16_BOUND = 2 ** -6


def _qkv(seed: int, seq: int, batch: int = BATCH, dim: int = DIM):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, HEADS, dim, generator=gen).bfloat16()
    k = torch.randn(seq, batch, GROUPS, dim, generator=gen).bfloat16()
    v = torch.randn(seq, batch, GROUPS, dim, generator=gen).bfloat16()
    return q, k, v


def _local(q, k, v, mode: bool, mask=None, mask_type="causal", packed=None):
    """megatron-core's local ``DotProductAttention.forward`` through the patch's wrapper, the mode on or
    off (upstream's own forward); ``q`` [s, b, heads, dim] (or THD [t, heads, dim] with ``packed``)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megapatch.core import options, state
    from megapatch.patches.tp_invariant import attention as patch

    attention = _module(q.shape[-2], k.shape[-2], q.shape[-1], mask_type)
    saved = state._current
    state._current = options.Settings(tp_invariant=mode)
    try:
        with cpu_workarounds():  # upstream's attention buffer is a CUDA allocation
            kwargs = {"packed_seq_params": packed} if packed is not None else {}
            context = patch._local_attention(DotProductAttention.forward.__get__(attention), attention,
                                             (q, k, v, mask), kwargs)
    finally:
        state._current = saved
    return context.view(q.shape)


def _fp64(q, k, v, masked):
    """softmax(q kᵀ / √d, masked scores at upstream's -10000) v in FP64; ``masked`` [b|1, 1, sq, sk]."""
    heads, dim = q.shape[2], q.shape[3]
    k, v = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (k, v))
    qd, kd, vd = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    scores = ((qd @ kd.transpose(-1, -2)) / math.sqrt(dim)).masked_fill(masked, -10000.0)
    return (scores.softmax(-1) @ vd).permute(2, 0, 1, 3)


# -- fidelity ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seq", [200, 300])
def test_blocked_attention_is_upstreams_function_within_a_bf16_bound_over_several_key_blocks(seq):
    """Causal, and a padding mask whose last rows see no key (they average the values, as upstream's
    do): the mode's blocked attention against FP64 and against upstream's local attention (mode off),
    from which (rounding scores and probabilities where upstream does, only the sums' order differs)
    at most 1% of the outputs differ (0.03% seen)."""
    q, k, v = _qkv(seq, seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    mode, upstream = _local(q, k, v, True), _local(q, k, v, False)
    oracle = _fp64(q, k, v, causal)
    assert (mode.double() - oracle).abs().max() < BF16_BOUND
    assert (mode.double() - upstream.double()).abs().max() < 2 * BF16_BOUND
    assert (mode != upstream).sum() <= mode.numel() // 100  # rounded where upstream rounds: few ulps apart
    mask = torch.zeros(BATCH, 1, seq, seq, dtype=torch.bool)
    mask[0, :, :, seq - 70:] = True     # padded keys of sequence 0 (more than one block)
    mask[:, :, seq - 10:, :] = True     # rows that see no key at all
    mode, upstream = _local(q, k, v, True, mask, "padding"), _local(q, k, v, False, mask, "padding")
    assert not mode.isnan().any()
    oracle = _fp64(q, k, v, mask)
    assert (mode.double() - oracle).abs().max() < BF16_BOUND
    assert (mode.double() - upstream.double()).abs().max() < 2 * BF16_BOUND
    assert (mode != upstream).sum() <= mode.numel() // 100  # rounded where upstream rounds: few ulps apart
    mean = v.double().repeat_interleave(HEADS // GROUPS, dim=2).mean(0)
    assert (mode[seq - 10:].double() - mean).abs().max() < BF16_BOUND


def test_probabilities_reach_the_value_products_rounded_to_the_activation_dtype(monkeypatch):
    """The probabilities the P @ V products receive are BF16 values (upstream's BF16 softmax output),
    over every key block."""
    from megapatch.numerics import attention

    seen, matmul = [], torch.matmul
    monkeypatch.setattr(attention.torch, "matmul", lambda a, b: (seen.append(a), matmul(a, b))[1])
    q, k, v = _qkv(3, 200)
    _local(q, k, v, True)
    probs = seen[1::2]  # scores, then probabilities, per query chunk
    assert probs and all(p.shape[-1] == attention.KEY_BLOCK for p in probs)
    assert all(torch.equal(p, p.bfloat16().float()) for p in probs)
    assert torch.cat([p.flatten() for p in probs]).unique().numel() > 1000  # (not a handful of values)


# -- row invariance -----------------------------------------------------------------------------------

def _attend(q, k, v, **kwargs):
    from megapatch.numerics.attention import row_invariant_attention

    return row_invariant_attention(q, k, v, DIM ** -0.5, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_bits_do_not_depend_on_the_query_count_key_padding_or_batch(dtype):
    """Each row of a 300-key causal attention (5 key blocks, 3 query chunks) has the bits it gets as one
    decode query over its prefix, in a prefill chunk, with other sequences batched beside it, and with
    masked keys appended after its own. In FP32 too, where nothing is rounded to BF16 on the way, so an
    FP32 sum taken in another order shows (in BF16 it does only now and then)."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(HEADS, 300, DIM, generator=gen).to(dtype) for _ in range(3))
    whole = _attend(q, k, v, causal=True)
    for length in (1, 63, 64, 65, 128, 129, 150, 191, 192, 255, 300):
        decoded = _attend(q[:, length - 1:length], k[:, :length], v[:, :length], causal=True)
        assert torch.equal(decoded, whole[:, length - 1:length]), length
    chunk = _attend(q[:, 120:200], k[:, :200], v[:, :200], causal=True)
    assert torch.equal(chunk, whole[:, 120:200])
    other = [torch.randn(HEADS, 300, DIM, generator=gen).to(dtype) for _ in range(3)]
    batched = _attend(*(torch.stack([a, b]) for a, b in zip((q, k, v), other)), causal=True)
    assert torch.equal(batched[0], whole)
    # keys 300..419 appended and masked: same bits for every row
    extra = [torch.cat([t, torch.randn(HEADS, 120, DIM, generator=gen).to(dtype)], 1) for t in (k, v)]
    hidden = torch.ones(300, 420, dtype=torch.bool).triu(1)
    hidden[:, 300:] = True
    assert torch.equal(_attend(q, *extra, hidden=hidden), whole)


def test_the_engines_decode_and_prefill_rows_have_the_trainers_bits_over_several_blocks():
    """Through ``tp_invariant.engine_attention``'s unit (one request read from a paged cache whose
    blocks are out of order), decode steps and a prefill chunk at 200 keys give the trainer's rows."""
    from megapatch.patches.tp_invariant.engine_attention import _request_rows

    dim, seq, page = 64, 200, 16
    q, k, v = _qkv(11, seq, batch=1, dim=dim)
    trained = _local(q, k, v, True)[:, 0]  # [s, heads, dim]
    pages = -(-seq // page)
    table = torch.arange(pages).flip(0)
    k_cache = torch.zeros(pages, page, GROUPS, dim, dtype=k.dtype)
    v_cache = torch.zeros_like(k_cache)
    for pos in range(seq):
        k_cache[table[pos // page], pos % page], v_cache[table[pos // page], pos % page] = k[pos, 0], v[pos, 0]
    for length in (1, 64, 65, 130, 200):
        row = _request_rows(q[length - 1:length, 0], k_cache, v_cache, length, table, dim ** -0.5)
        assert torch.equal(row, trained[length - 1:length]), length
    chunk = _request_rows(q[150:200, 0], k_cache, v_cache, 200, table, dim ** -0.5)
    assert torch.equal(chunk, trained[150:200])


# -- packed sequences (THD) -------------------------------------------------------------------------

LENGTHS = (37, 64, 5, 100)


def _sequences(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, h, DIM, generator=gen).bfloat16() for h in (HEADS, GROUPS, GROUPS, HEADS))
            for n in LENGTHS]  # q, k, v, and the output's cotangent


def _params(lengths, pads):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    padded = torch.tensor([0, *torch.tensor([n + p for n, p in zip(lengths, pads)]).cumsum(0).tolist()],
                          dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def _grads(out, cotangent, leaves):
    with torch.enable_grad():
        (out.float() * cotangent.float()).sum().backward()
    return [t.grad for t in leaves]


def _alone(seq):
    leaves = [t.clone().requires_grad_() for t in seq[:3]]
    with torch.enable_grad():
        out = _local(*(t.unsqueeze(1) for t in leaves), True)[:, 0]
    return out.detach(), _grads(out, seq[3], leaves)


def _packed(seqs, order, pads, seed=0):
    """The sequences ``order`` packed in one bin, ``pads`` garbage rows after each; each sequence's
    output and its q, k, v gradients, and the bin's padding rows of the output."""
    gen = torch.Generator().manual_seed(seed)
    leaves = {i: [t.clone().requires_grad_() for t in seqs[i][:3]] for i in order}
    parts = [[], [], [], []]
    for i, pad in zip(order, pads):
        for j in range(4):
            parts[j].append(leaves[i][j] if j < 3 else seqs[i][3])
            parts[j].append(torch.randn(pad, *seqs[i][j].shape[1:], generator=gen).bfloat16())  # garbage
    q, k, v, cot = (torch.cat(p) for p in parts)
    with torch.enable_grad():
        out = _local(q, k, v, True, packed=_params([len(seqs[i][0]) for i in order], pads))
        _grads(out, cot, [t for i in order for t in leaves[i]])
    results, row, padding = {}, 0, []
    for i, pad in zip(order, pads):
        n = len(seqs[i][0])
        results[i] = (out[row:row + n].detach(), [t.grad for t in leaves[i]])
        padding.append(out[row + n:row + n + pad].detach())
        row += n + pad
    return results, torch.cat(padding)


def test_each_packed_sequence_has_the_bits_it_has_alone_forward_and_gradients():
    """Sequences of 37, 64, 5 and 100 tokens packed in two orders, with and without padding between
    them, and beside other neighbours: each one's output and its q, k, v gradients equal those of the
    sequence run alone unpacked, bit for bit; the padding rows are zeros."""
    seqs = _sequences(0)
    alone = [_alone(s) for s in seqs]
    neighbours = _sequences(1)
    layouts = [((0, 1, 2, 3), (3, 0, 11, 4)), ((3, 2, 1, 0), (0, 0, 0, 0)), ((2, 0), (64, 1))]
    for order, pads in layouts:
        got, padding = _packed(seqs, order, pads)
        assert torch.equal(padding, torch.zeros_like(padding)) and not padding.isnan().any()
        for i in order:
            out, grads = got[i]
            assert torch.equal(out, alone[i][0]), (order, i)
            for name, g, expected in zip("qkv", grads, alone[i][1]):
                assert torch.equal(g, expected), (order, i, name)
    # neighbours of other contents around sequence 1
    mixed = [neighbours[0], seqs[1], neighbours[3]]
    got, _ = _packed(mixed, (0, 1, 2), (2, 3, 0))
    assert torch.equal(got[1][0], alone[1][0])
    assert all(torch.equal(g, e) for g, e in zip(got[1][1], alone[1][1]))


def test_the_first_bin_of_several_sequences_logs_the_doctors_packing_line_once(monkeypatch):
    """The job's word on packing (issue 49), the line ``megapatch doctor`` prints for
    ``--rl-use-sequence-packing``: logged once (rank 0) at the first bin holding two or more sequences,
    not for a bin of one sequence (Megatron RL's no-op THD default)."""
    import logging

    from megapatch.core import report
    from megapatch.patches.tp_invariant.attention import packing_line

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("megapatch").addHandler(handler)
    monkeypatch.setattr(report, "_said", set())
    try:
        seqs = _sequences(0)
        one = seqs[1]
        _local(*one[:3], True, packed=_params([len(one[0])], [0]))
        assert not any("packed sequences" in line for line in lines), lines
        for _ in range(2):
            _packed(seqs, (0, 1), (0, 2))
    finally:
        logging.getLogger("megapatch").removeHandler(handler)
    assert lines.count(packing_line(None)) == 1, lines  # the attention's config: no experts


def test_packed_sequences_the_mode_does_not_cover_are_refused_naming_the_option():
    from megatron.core.packed_seq_params import PackedSeqParams

    from megapatch.core.errors import UnsupportedConfigurationError

    q, k, v = (t[:, 0] for t in _qkv(2, 20, batch=1))
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    cases = [
        (PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu), None, "qkv_format='sbhd'"),
        (PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, local_cp_size=2), None,
         "local_cp_size"),
        (PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu),
         torch.zeros(1, 1, 20, 20, dtype=torch.bool), "attention_mask"),
    ]
    for packed, mask, named in cases:
        with pytest.raises(UnsupportedConfigurationError, match=named):
            _local(q, k, v, True, mask=mask, packed=packed)


# -- memory -----------------------------------------------------------------------------------------

def _peak(seq: int) -> int:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, seq, 16, generator=gen).bfloat16() for _ in range(3))
    meter = LiveBytes()
    with torch.no_grad(), meter:
        _attend(q, k, v, causal=True)
    return meter.peak


def test_the_peak_memory_of_a_call_grows_with_s_times_block_not_s_squared():
    """At 256 and 1024 keys (4x), the peak of live intermediates grows ~4x, not 16x, and at 1024 stays
    under one FP32 S x S score matrix for its heads (the full-matrix version held several)."""
    small, large = _peak(256), _peak(1024)
    assert large < 6 * small, (small, large)
    assert large < 2 * 1024 * 1024 * 4, large
