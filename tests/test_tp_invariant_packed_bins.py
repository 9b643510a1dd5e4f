"""``tp_invariant.packed_bins`` (issue 49): a packed (THD) bin's weight gradients cut at its sequences, so
that a step on packed bins equals a step on the same sequences unpacked.

The arithmetic: with the exact sum's sink on the parameters, a bin of several sequences hands over one
term per sequence (and per run of rows no sequence covers), each bit-identical to the gradient of an
unpacked micro-batch of that sequence alone -- padded to the bin's length with other tokens whose
gradients are zero -- computed without packing (the oracle: separate backward passes, no bin).

The model: a Llama-shaped GPT (RoPE, GQA, SwiGLU, RMSNorm) in megatron-core's DDP under the mode, at
TP 1 and at TP 2 with sequence parallelism: one packed bin of two sequences and a padding tail gives
every DDP main gradient the bits two unpacked micro-batches of the same sequences give, and the same
logits for every real token; with the cut switched off the gradients differ.
"""

from __future__ import annotations

import pytest
import torch

from megapatch.testing import run_ranks

BIN = 32
LENGTHS = (11, 13)  # then 8 rows of padding: Megatron RL's last cu_seqlens entry is the bin's end


def _params(cu, padded=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(cu, dtype=torch.int32)
    padded = cu if padded is None else torch.tensor(padded, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=BIN, max_seqlen_kv=BIN)


def test_a_bin_is_cut_into_its_sequences_and_the_rows_between_them():
    from megapatch.numerics import packed_bins

    assert packed_bins.from_params(_params([0, 11, 24, 32])).segments == ((0, 11), (11, 13), (24, 8))
    # padded slots: the rows between a sequence's end and the next slot are a segment of their own
    got = packed_bins.from_params(_params([0, 11, 24], [0, 12, 28]))
    assert got.segments == ((0, 11), (11, 1), (12, 13), (25, 3)) and got.rows == 28
    # ghost sequences of no tokens (Megatron RL pads cu_seqlens with the bin's end) add nothing
    assert packed_bins.from_params(_params([0, 11, 32, 32, 32])).segments == ((0, 11), (11, 21))
    assert packed_bins.from_params(_params([0, 32, 32])) is None  # one sequence: an unpacked micro-batch
    t = torch.arange(32.0).view(32, 1, 1)
    with packed_bins.running(packed_bins.from_params(_params([0, 11, 24]))):  # a bin padded past cu_seqlens
        assert packed_bins.current(t).segments == ((0, 11), (11, 13), (24, 8))
        assert packed_bins.current(t[:16], split=2).rows == 32
        assert packed_bins.current(t[:20]) is None and packed_bins.current(t.view(32, 1)) is None
        assert packed_bins.current(t.view(16, 2, 1)) is None  # a micro-batch of two rows is not a bin
    frame = packed_bins.from_params(_params([0, 11, 24, 32])).frame(t, 1)
    assert frame[:13, 0, 0].tolist() == list(range(11, 24)) and not frame[13:].any()


def test_a_bin_hands_the_exact_sum_one_term_per_sequence_each_the_unpacked_sequences_gradient(monkeypatch):
    """Column- and row-parallel linears (weight and bias) and a norm's affine weight, position-dependent
    values: a bin of sequences of 11 and 13 tokens and an 8-row tail hands over 3 terms, the first
    returned, the others deposited; each equals the gradient of its sequence at the top of an unpacked
    micro-batch of 32 rows whose other rows hold other values and zero gradients."""
    from megapatch.numerics import block_linear, block_tree, gradient_terms, packed_bins, token_tree

    monkeypatch.setattr(block_tree, "active", lambda: True)
    monkeypatch.setattr(block_tree, "width", lambda: 4)
    k, n = 8, 12
    bin_ = packed_bins.from_params(_params([0, 11, 24, 32]))
    # rows scaled by powers of two from 2^-8 to 2^8: FP32 sums over tokens then depend on their order and
    # blocking, so a sequence cut anywhere but at its own first row (or blocks anchored elsewhere) shows
    scale = (2.0 ** (torch.arange(BIN) * 5 % 17 - 8)).view(BIN, 1, 1)
    steps = torch.arange(BIN * k, dtype=torch.float32).reshape(BIN, 1, k)
    x = (torch.sin(steps * 0.37) * (1 + steps / 50) * scale).bfloat16()
    g = (torch.cos(torch.arange(BIN * n, dtype=torch.float32).reshape(BIN, 1, n) * 0.11) * scale.flip(0)).bfloat16()
    gen = torch.Generator().manual_seed(1)
    weight_c = torch.nn.Parameter(torch.randn(n, k, generator=gen).bfloat16())
    bias_c = torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16())
    weight_r = torch.nn.Parameter(torch.randn(k, n, generator=gen).bfloat16())
    norm_w = torch.nn.Parameter(torch.randn(k, generator=gen).bfloat16())
    layers = {
        "column": ((weight_c, bias_c), lambda x_, w, b: block_linear.ColumnParallel.apply(x_, w, b, None, False, 4)),
        "row": ((weight_r,), lambda x_, w: block_linear.RowParallel.apply(x_, w, None, 4)),
        "norm": ((norm_w,), lambda x_, w: token_tree.TokenBlockedAffine.apply(x_.float(), w, None, None, 4, False,
                                                                                torch.bfloat16)),
    }
    other = torch.randn(BIN, 1, n, generator=gen).bfloat16()  # what fills an unpacked micro-batch's padding
    for name, (params, layer) in layers.items():
        grad_out = g if name == "column" else g[..., :k]
        inputs = x if name != "row" else torch.sin(torch.arange(BIN * n).reshape(BIN, 1, n) * 0.3).bfloat16()

        def backward(batch, gout):
            for p in params:
                p.grad = None
            layer(batch, *params).backward(gout)
            return [p.grad.clone() for p in params]

        alone = []
        for start, rows in bin_.segments:  # unpacked: the sequence on top, other values and zero gradients after
            batch = other[..., :inputs.shape[-1]].clone()
            batch[:rows] = inputs[start:start + rows]
            gout = torch.zeros_like(grad_out)
            gout[:rows] = grad_out[start:start + rows]
            alone.append(backward(batch, gout))
        deposited = {id(p): [] for p in params}
        for p in params:
            setattr(p, gradient_terms.SEQUENCE_TERMS, deposited[id(p)].extend)
        try:
            with packed_bins.running(bin_):
                returned = backward(inputs, grad_out)
            whole = backward(inputs, grad_out)  # outside the bin: one term for all its rows
        finally:
            for p in params:
                delattr(p, gradient_terms.SEQUENCE_TERMS)
        for j, p in enumerate(params):
            assert torch.equal(returned[j], alone[0][j]), (name, j)
            assert len(deposited[id(p)]) == bin_.count() - 1, (name, j)
            for i in range(1, bin_.count()):
                assert torch.equal(deposited[id(p)][i - 1], alone[i][j]), (name, j, i)
            total = sum(a[j].double() for a in alone)  # BF16 terms: a few BF16 ulps of the largest term
            bound = 2 ** -6 * bin_.count() * max(float(a[j].abs().max()) for a in alone)
            assert torch.allclose(whole[j].double(), total, rtol=0, atol=bound), (name, j)
        assert not all(torch.equal(returned[j], whole[j]) for j in range(len(params))), name


def test_a_sequences_token_blocks_start_at_its_own_first_row(monkeypatch):
    """Planted sums: sequence 2 of the bin (rows 11-23) carries 2^24, 1, 1 and -2^24 at its rows 0, 5, 6 and
    8 (a norm's weight gradient, one feature). In blocks of 8 rows from its own first row -- as an unpacked
    micro-batch of it has them -- the FP32 tree gives 0 (the ones vanish into 2^24); blocks anchored at the
    bin's rows (11-15, 16-23) give 2. The term must be the unpacked micro-batch's 0."""
    from megapatch.numerics import block_tree, gradient_terms, packed_bins, token_tree

    monkeypatch.setattr(block_tree, "active", lambda: True)
    monkeypatch.setattr(block_tree, "width", lambda: 4)
    bin_ = packed_bins.from_params(_params([0, 11, 24, 32]))
    grad = torch.zeros(BIN, 1, 2)
    grad[:, 0, 1] = 1.0  # a second feature, exact in any order
    for row, value in ((0, 2.0 ** 24), (5, 1.0), (6, 1.0), (8, -2.0 ** 24)):
        grad[11 + row, 0, 0] = value
    weight = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    deposited = []
    setattr(weight, gradient_terms.SEQUENCE_TERMS, deposited.extend)
    try:
        with packed_bins.running(bin_):
            token_tree.TokenBlockedAffine.apply(torch.ones(BIN, 1, 2), weight, None, None, 4, False,
                                                torch.bfloat16).backward(grad.bfloat16())
    finally:
        delattr(weight, gradient_terms.SEQUENCE_TERMS)
    assert [d.tolist() for d in deposited] == [[0.0, 13.0], [0.0, 8.0]]  # sequence 2, then the 8 padding rows
    assert weight.grad.tolist() == [0.0, 11.0]


def _job(ctx, cut: bool):
    """At TP 1, then TP 2 with sequence parallelism: the DDP main gradients and real tokens' logits of one
    packed bin (sequences of 11 and 13 tokens, 8 rows of padding) and of two unpacked micro-batches of
    the same sequences (each padded to 32 tokens), every token's loss summed (no averaging)."""
    from megapatch.numerics import packed_bins

    made = packed_bins.from_params
    if not cut:
        packed_bins.from_params = lambda packed: None
    try:
        return _layouts(ctx)
    finally:
        packed_bins.from_params = made


def _layouts(ctx):
    import megapatch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megapatch.testing import build_tiny_gpt, reinit_model_parallel
    from megapatch.testing.models.tiny_gpt import llama_config

    gen = torch.Generator().manual_seed(7)
    sequences = [torch.randint(0, 128, (n + 1,), generator=gen) for n in LENGTHS]
    padding = torch.randint(0, 128, (BIN + 1,), generator=gen)
    out = {}
    for tp, sp in ((1, False), (2, True)):
        ctx = reinit_model_parallel(ctx, tp=tp)
        megapatch.enable(tp_invariant=True)
        try:
            config = llama_config(tp=tp, sequence_parallel=sp, num_attention_heads=4, ffn_hidden_size=128)
            model = build_tiny_gpt(config, vocab_size=128, seq_len=BIN, seed=3, position_embedding_type="rope")
            ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)

            def step(micro_batches):
                ddp.zero_grad_buffer()
                logits = []
                for tokens, labels, mask, packed in micro_batches:
                    positions = torch.arange(BIN).unsqueeze(0)
                    loss = ddp(tokens, positions, None, labels=labels, packed_seq_params=packed)
                    (loss.float() * mask).sum().backward()
                    with torch.no_grad():
                        logits.append(ddp(tokens, positions, None, packed_seq_params=packed).float())
                ddp.finish_grad_sync()
                return {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}, logits

            bin_tokens, bin_labels, bin_mask = padding[:-1].clone(), padding[1:].clone(), torch.zeros(BIN)
            row, unpacked = 0, []
            for seq in sequences:
                n = len(seq) - 1
                bin_tokens[row:row + n], bin_labels[row:row + n], bin_mask[row:row + n] = seq[:-1], seq[1:], 1
                tokens, labels, mask = padding[:-1].clone(), padding[1:].clone(), torch.zeros(BIN)
                tokens[:n], labels[:n], mask[:n] = seq[:-1], seq[1:], 1
                unpacked.append((tokens.unsqueeze(0), labels.unsqueeze(0), mask.unsqueeze(0), None))
                row += n
            packed = [(bin_tokens.unsqueeze(0), bin_labels.unsqueeze(0), bin_mask.unsqueeze(0),
                       _params([0, LENGTHS[0], sum(LENGTHS), BIN]))]
            out[tp, "packed"] = step(packed)
            out[tp, "unpacked"] = step(unpacked)
        finally:
            megapatch.disable()
    return out


@pytest.fixture(scope="module")
def runs():
    """``{cut: [rank 0's results, rank 1's]}``: at TP 2 each rank holds its shards."""
    return {cut: run_ranks(_job, world_size=2, tp=1, args=(cut,), timeout=600) for cut in (True, False)}


def _real_logits(logits, tp, packed: bool):
    """Each sequence's real tokens' logits (this rank's vocabulary shard), as [tokens, vocab]."""
    if packed:
        rows = logits[0]
        flat = rows.reshape(BIN, -1) if rows.dim() == 3 else rows.reshape(-1, rows.shape[-1])
        return flat[:sum(LENGTHS)]
    return torch.cat([mb.reshape(-1, mb.shape[-1])[:n] for mb, n in zip(logits, LENGTHS)])


@pytest.mark.quick("tp_invariant.packed_bins")
@pytest.mark.parametrize("tp", [1, 2])
def test_a_packed_step_gives_every_gradient_the_unpacked_steps_bits(runs, tp):
    for rank, found in enumerate(runs[True]):
        grads, logits = found[tp, "packed"]
        expected, unpacked_logits = found[tp, "unpacked"]
        assert sorted(grads) == sorted(expected) and len(grads) > 10
        assert [n for n in grads if not torch.equal(grads[n], expected[n])] == [], rank
        if rank == 0:  # (at TP 2 the norms' gradients are kept on rank 0 until upstream's TP all-reduce)
            assert [n for n, g in grads.items() if not g.abs().sum() > 0] == []
        assert torch.equal(_real_logits(logits, tp, True), _real_logits(unpacked_logits, tp, False)), rank


def test_without_the_cut_a_packed_step_is_not_the_unpacked_one(runs):
    """The same job with the bin never made (the layers see one micro-batch of one row): the logits still
    agree (attention and RoPE take each sequence alone), the weight gradients do not."""
    grads, logits = runs[False][0][1, "packed"]
    expected, unpacked_logits = runs[False][0][1, "unpacked"]
    assert torch.equal(_real_logits(logits, 1, True), _real_logits(unpacked_logits, 1, False))
    assert [n for n in grads if not torch.equal(grads[n], expected[n])] != []
