"""tp_invariant.attention: the trainer's core attention and the dynamic engine's paged prefill and
decode attention give every query row the same bits, against upstream's own code paths (megatron-core's
``DotProductAttention.forward`` and ``Attention.flash_decode_and_prefill`` called through the patch's
wrappers; the engine's flash-attn kernels stood in for by megapatch's CPU stand-in, which the mode
replaces). The end-to-end figure: ``train_rl.py`` with experts at trainer TP 2 EP 2 / rollout TP 1
(results/train_rl.md, tests/test_train_rl.py)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds
from tests.conftest import StandInGroup, bare_module

SEQ, BATCH, HEADS, GROUPS, DIM, BLOCK = 50, 2, 4, 2, 8, 16  # 50 keys: not a multiple of the key block
#: head dim 8: inputs on which upstream's arithmetic gives a decode step or a prefill chunk other bits
#: than training (seeds 0-39 scanned: 19 and 22; it is rare, a few rows in a thousand)
NATIVE_DISAGREES = (19, 22)
#: head dim 64: inputs on which the mode's engine rows miss upstream's training attention (seed 10)
#: and rows computed on unpadded decode shapes miss padded ones (seed 1) -- each break seen on no
#: other seed of 0-15: they keep the mode's two halves and its row padding honest
MODE_NEEDED = (1, 10)


@pytest.fixture
def mode_on(monkeypatch):
    from megapatch.core import options, state

    monkeypatch.setattr(state, "_current", options.Settings(tp_invariant=True))


def _qkv(seed: int, dim: int = DIM):
    global DIM
    DIM = dim  # the helpers below read it
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen).bfloat16()
    k = torch.randn(SEQ, BATCH, GROUPS, DIM, generator=gen).bfloat16()
    v = torch.randn(SEQ, BATCH, GROUPS, DIM, generator=gen).bfloat16()
    return q, k, v


def _trainer(q, k, v, heads=HEADS):
    """megatron-core's local DotProductAttention on [s, b, heads, dim] through the patch's wrapper
    (upstream's own forward where the mode is off): context [s, b, heads, dim]."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    from megapatch.patches.tp_invariant import attention as patch

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    attention = bare_module(DotProductAttention)
    attention.config = SimpleNamespace(sequence_parallel=True)  # upstream: no RNG-tracker fork around (p=0) dropout
    attention.attn_mask_type = AttnMaskType.causal
    attention.num_attention_heads_per_partition, attention.num_query_groups_per_partition = heads, k.shape[2]
    attention.hidden_size_per_partition = heads * DIM
    attention.softmax_scale = 1.0 / math.sqrt(DIM)
    attention.softmax_offset = None
    attention.attention_dropout = torch.nn.Dropout(0.0)
    attention.scale_mask_softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False, input_in_bf16=True, attn_mask_type=AttnMaskType.causal,
        scaled_masked_softmax_fusion=False, mask_func=attention_mask_func, softmax_in_fp32=True, scale=None)
    attention.eval()
    upstream = DotProductAttention.forward.__get__(attention)
    with cpu_workarounds():  # upstream's attention buffer is a CUDA allocation
        context = patch._local_attention(upstream, attention, (q, k, v, None), {})
    return context.view(q.shape)


def _engine(q_rows, k, v, lengths, decode: bool):
    """The engine's attention for both sequences -- their last ``len(q_rows)`` positions of ``lengths``
    keys -- through ``Attention.flash_decode_and_prefill`` and the patch's wrapper, keys and values in
    a paged cache of ``BLOCK``-token blocks (upstream's call: flash-attn's stand-in where the mode is off)."""
    from megatron.core.transformer import attention as attention_module

    from megapatch.patches.tp_invariant import engine_attention as patch
    from megapatch.testing.stand_ins import dynamic_inference_compat as stand_in

    pages = -(-SEQ // BLOCK)
    k_cache = torch.zeros(BATCH * pages, BLOCK, GROUPS, DIM, dtype=k.dtype)
    v_cache = torch.zeros_like(k_cache)
    table = torch.arange(BATCH * pages).view(BATCH, pages).flip(1).contiguous()  # blocks out of order
    for b in range(BATCH):
        for pos in range(SEQ):
            k_cache[table[b, pos // BLOCK], pos % BLOCK] = k[pos, b]
            v_cache[table[b, pos // BLOCK], pos % BLOCK] = v[pos, b]
    rows = q_rows.shape[0]
    owner = bare_module(attention_module.SelfAttention)
    owner.config = SimpleNamespace(multi_latent_attention=False)
    owner.training, owner.batch_invariant_mode = False, False
    saved = (getattr(attention_module, "flash_attn_varlen_func", None),
             getattr(attention_module, "flash_attn_with_kvcache", None))
    attention_module.flash_attn_varlen_func = stand_in._varlen(None)
    attention_module.flash_attn_with_kvcache = stand_in._with_kvcache(None)
    try:
        upstream = attention_module.Attention.flash_decode_and_prefill.__get__(owner)
        lengths_t = torch.tensor(lengths, dtype=torch.int32)
        if decode:  # q [batch, 1, heads, dim]
            q = q_rows[-1].unsqueeze(1).contiguous()
            args = (q, k_cache, v_cache, 1, max(lengths), None, None, lengths_t, table, True)
        else:  # q [tokens, 1, heads, dim], requests one after another
            q = q_rows.transpose(0, 1).reshape(BATCH * rows, 1, HEADS, DIM).contiguous()
            cu_q = torch.arange(0, BATCH * rows + 1, rows, dtype=torch.int32)
            cu_k = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            args = (q, k_cache, v_cache, rows, max(lengths), cu_q, cu_k, lengths_t, table, False)
        out = patch._engine_attention(upstream, owner, args, {})
    finally:
        attention_module.flash_attn_varlen_func, attention_module.flash_attn_with_kvcache = saved
    if decode:
        return out[:, 0]  # [batch, heads, dim]
    return out[:, 0].view(BATCH, rows, HEADS, DIM).transpose(0, 1)  # [rows, batch, heads, dim]


def _disagreements(q, k, v):
    """Rows where the engine's decode step and a 6-row prefill chunk differ from the trainer's."""
    trained = _trainer(q, k, v)
    found = []
    for length in range(1, SEQ + 1):
        decoded = _engine(q[:length], k, v, [length] * BATCH, decode=True)
        if not torch.equal(decoded, trained[length - 1]):
            found.append(("decode", length))
        if length >= 6 and length % 5 == 0:
            chunk = _engine(q[length - 6:length], k, v, [length] * BATCH, decode=False)
            if not torch.equal(chunk, trained[length - 6:length]):
                found.append(("prefill", length))
    return found


@pytest.mark.quick("tp_invariant.attention", "tp_invariant.engine_attention")
def test_a_rollouts_decode_and_prefill_rows_have_the_trainers_bits(mode_on):
    """Every decode step (one query over 1..50 cached keys, paged out of order) and every prefill chunk
    gives each row the bits of the trainer's whole-sequence attention at that position."""
    for dim, seeds in ((8, NATIVE_DISAGREES), (64, MODE_NEEDED)):
        for seed in seeds:
            assert _disagreements(*_qkv(seed, dim)) == [], (dim, seed)


def test_precondition_upstreams_arithmetic_gives_rows_other_bits_between_decode_and_training(monkeypatch):
    """Without the mode, upstream's local attention in training and the engine's (here: the
    flash-attn stand-in, upstream's BF16 arithmetic on the decode shapes) disagree on some rows."""
    from megapatch.core import options, state

    monkeypatch.setattr(state, "_current", options.Settings(tp_invariant=False))
    found = [row for seed in NATIVE_DISAGREES for row in _disagreements(*_qkv(seed, 8))]
    assert found, "upstream's decode rows all matched the trainer's: the test above would prove nothing"


def test_the_heads_a_tp_rank_holds_do_not_move_a_bit(mode_on):
    """At TP 2 each rank attends half the heads (and half the KV groups): the same bits per head."""
    q, k, v = _qkv(5, 8)
    whole = _trainer(q, k, v)
    halves = [_trainer(q[:, :, h * 2:h * 2 + 2].contiguous(), k[:, :, h:h + 1].contiguous(),
                       v[:, :, h:h + 1].contiguous(), heads=2) for h in range(2)]
    assert torch.equal(torch.cat(halves, dim=2), whole)


def test_a_tp1_models_norm_uses_its_own_tp_group_not_the_trainers(mode_on):
    """A rollout model at TP 1 beside a TP-2 trainer keeps ``sequence_parallel`` on its norm weights;
    its norm splits tokens over *its* TP group (one rank: nothing split), so an engine's dummy
    forward of one token runs; over the trainer's two-rank group it would be refused."""
    from megapatch.core.errors import OptionError
    from megapatch.patches.tp_invariant import _norms

    def norm(group):
        module = torch.nn.RMSNorm(8, eps=1e-6)
        module.weight.sequence_parallel = True
        _norms.token_blocked_norm(module, False, group)
        return module

    hidden = torch.randn(1, 1, 8).bfloat16()
    with torch.no_grad():
        out = norm(StandInGroup(1))(hidden)
        expected = torch.nn.functional.rms_norm(hidden.float(), (8,), None, 1e-6) * norm(None).weight.float()
        assert torch.equal(out, expected.to(out.dtype))
        with pytest.raises(OptionError, match="not divisible"):
            norm(StandInGroup(2))(hidden)
