"""Core attention under ``tp_invariant``: one arithmetic for the trainer's sequences and the dynamic
engine's prefill and decode steps, whose rows do not depend on the shapes they run in.

Per head, attention already gives the same bits at every TP size. What the mode also promises, a
rollout's log-probs equal to the trainer's (Megatron RL), needs each query row's result to be the same
whether it is the last of 64 training positions or a decode step's one query over 55 cached keys. Upstream
runs megatron-core's local ``DotProductAttention`` (BF16 ``baddbmm``/``bmm`` over the whole sequence)
in training and flash-attn's paged kernels in the engine (``Attention.flash_decode_and_prefill``); the
two choose their reductions by shape, and even the CPU stand-in for flash-attn, which uses the local
attention's own BF16 arithmetic on the decode shapes, gave a row other bits now and then (3e-6 in
``train_rl.py``'s logged mismatch). Under the mode both run ``numerics.attention.row_invariant_attention``:
FP32 products on fixed key blocks, scores and probabilities rounded to the activation dtype as upstream
rounds them, memory growing with S x block, not S x S (the engine's side, its keys read from the paged
cache: ``patches/tp_invariant/engine_attention.py``). Packed sequences (THD, ``packed_seq_params``), which
upstream's local attention refuses, run one sequence at a time (:func:`packed_attention`).

Left to upstream (the mode's other guarantees hold there, this one does not): attention with softmax
offsets (sinks), sliding windows, query-key layer scaling, dropout in training and attention bias (with
packed sequences these are refused: upstream's local attention takes none). TE's ``DotProductAttention``
runs as this local attention under the mode (``tp_invariant.transformer_engine``), so it takes this
arithmetic too, packed sequences included.
"""

from __future__ import annotations

import torch

from megapatch.core import report, state
from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics import packed_bins
from megapatch.numerics.attention import repeat_groups, row_invariant_attention
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant, tp_invariant_patch

DOT_PRODUCT_ATTENTION = "megatron.core.transformer.dot_product_attention"


def packing_line(config) -> str:
    """What packing under the mode gives, and what not (yet): said once per job (rank 0) at the first bin
    of several sequences, and by ``megapatch doctor -- <flags>`` for ``--rl-use-sequence-packing``."""
    line = ("megapatch tp_invariant: packed sequences (THD bins, --rl-use-sequence-packing): each sequence of a bin "
            "is attended and RoPE-rotated alone, as the rollout engine computes it (trainer log-probs equal the "
            "rollout's), and its weight gradients are terms of their own, as an unpacked micro-batch's "
            "(tp_invariant.packed_bins): packed and unpacked steps of the same sequences agree bit for bit where "
            "upstream weighs their tokens alike, with --calculate-per-token-loss (without it upstream divides "
            "each bin's or micro-batch's loss by its own token count)")
    if getattr(config, "num_moe_experts", None):
        line += ("; but an MoE layer's router and routed experts are not cut per sequence yet, so with experts a "
                 "packed step is not bit-identical to an unpacked one")
    return line + "; context parallelism stays refused (docs/tp_invariant.md)"


def packing_note(config):
    """The record's ``notes``: the packing line for a Megatron-LM job's flags (``megapatch doctor``)."""
    return packing_line(config) if getattr(config, "rl_use_sequence_packing", False) else None


def _plain_local_attention(instance, bias) -> bool:
    softmax = getattr(instance, "scale_mask_softmax", None)
    return (bias is None and getattr(instance, "softmax_offset", None) is None
            and softmax is not None and getattr(softmax, "scale", None) is None
            and getattr(softmax, "window_size", None) is None
            and not (instance.training and instance.attention_dropout.p > 0))


def _by_head(t, heads):  # [s, b, groups, hn] -> [b, heads, s, hn] (a view until the FP32 copy)
    return repeat_groups(t, heads, 2).permute(1, 2, 0, 3)


def _starts(packed, which: str):
    """Where each sequence of the bin starts (``cu_seqlens_*_padded`` where given) and its length."""
    found = packed_bins.bounds(packed, which)
    if found is None:
        refuse_tp_invariant(f"packed sequences without packed_seq_params.cu_seqlens_{which}",
                            "the mode attends each sequence of the bin on its own and needs its bounds")
    starts, lengths = found
    for i, length in enumerate(lengths):
        if length < 0 or starts[i] + length > starts[i + 1]:
            refuse_tp_invariant(f"packed_seq_params.cu_seqlens_{which}_padded shorter than cu_seqlens_{which}",
                                f"sequence {i} ({length} tokens) does not fit its padded slot")
    return starts, lengths


def packed_attention(query, key, value, mask, mask_type, packed, scale, config=None):
    """Packed (THD) sequences: ``query`` [t, heads, hn] (or [t, 1, heads, hn]), ``key``/``value`` [t, groups,
    hn], sequence i at rows ``cu_seqlens_*_padded[i]`` (or ``cu_seqlens_*[i]``) on, for
    ``cu_seqlens_*[i + 1] - cu_seqlens_*[i]`` rows. Each sequence runs alone through the mode's attention
    (causal within it, end-aligned, for the causal mask types), so it gets the bits it gets unpacked,
    wherever it sits in the bin and whatever else is packed with it; rows between sequences are zeros.
    Returns [t, heads x hn]."""
    fmt = getattr(packed, "qkv_format", None)
    if fmt != "thd":
        refuse_tp_invariant(f"packed_seq_params with qkv_format={fmt!r}", "the mode packs the 'thd' format only")
    cp = getattr(packed, "cp_group", None)
    if (getattr(packed, "local_cp_size", None) or 1) > 1 or (cp is not None and cp.size() > 1):
        refuse_tp_invariant("packed sequences with context parallelism (packed_seq_params.local_cp_size / "
                            "cp_group)", "the mode attends each sequence whole on one rank")
    if mask is not None:
        refuse_tp_invariant("an attention_mask with packed (THD) sequences",
                            "the sequences' bounds (cu_seqlens) are the mask the mode takes")
    kind = getattr(mask_type, "name", str(mask_type))
    if kind not in ("causal", "padding_causal", "no_mask", "padding"):
        refuse_tp_invariant(f"packed (THD) sequences with attn_mask_type {kind}",
                            "the mode takes causal, padding_causal, no_mask or padding there")
    query, key, value = (t.squeeze(1) if t.dim() == 4 else t for t in (query, key, value))
    tokens, heads, dim = query.shape
    key, value = repeat_groups(key, heads, 1), repeat_groups(value, heads, 1)
    q_starts, q_lengths = _starts(packed, "q")
    k_starts, k_lengths = _starts(packed, "kv")
    if len(q_lengths) != len(k_lengths) or q_starts[-1] > tokens or k_starts[-1] > key.shape[0]:
        refuse_tp_invariant("packed_seq_params whose cu_seqlens_q and cu_seqlens_kv disagree or overrun the "
                            f"{tokens} packed tokens", "each sequence's queries need their keys")
    if sum(1 for n in q_lengths if n) > 1:
        report.once("tp_invariant:packing", "warning", packing_line(config))
    pieces, row = [], 0
    for start, rows, k_start, keys in zip(q_starts, q_lengths, k_starts, k_lengths):
        if start > row:
            pieces.append(query.new_zeros(start - row, heads, dim))
        if rows:
            if not keys:
                pieces.append(query.new_zeros(rows, heads, dim))
            else:
                seq = [t[a:a + n].transpose(0, 1) for t, a, n in ((query, start, rows), (key, k_start, keys),
                                                                  (value, k_start, keys))]
                out = row_invariant_attention(*seq, scale, causal=kind.endswith("causal"))
                pieces.append(out.transpose(0, 1))
        row = start + rows
    if tokens > row:
        pieces.append(query.new_zeros(tokens - row, heads, dim))
    return torch.cat(pieces).reshape(tokens, heads * dim)


def _local_attention(wrapped, instance, args, kwargs):
    bias = argument(args, kwargs, 5, "attention_bias", None)
    packed = argument(args, kwargs, 6, "packed_seq_params", None)
    if not state.current().tp_invariant:
        return wrapped(*args, **kwargs)
    if not _plain_local_attention(instance, bias):
        if packed is not None:
            refuse_tp_invariant(
                "packed sequences (packed_seq_params) with attention bias, softmax offsets (sinks), "
                "sliding windows, query-key layer scaling or dropout in training",
                "these are left to upstream's local attention, which takes no packed sequences")
        return wrapped(*args, **kwargs)
    query, key, value = (argument(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
    mask = argument(args, kwargs, 3, "attention_mask", None)
    mask_type = argument(args, kwargs, 4, "attn_mask_type", None) or instance.attn_mask_type
    if packed is not None:
        return packed_attention(query, key, value, mask, mask_type, packed, instance.softmax_scale,
                                getattr(instance, "config", None))
    sq, b, heads, dim = query.shape
    causal = mask is None and getattr(mask_type, "name", None) == "causal"
    hidden = mask.bool() if mask is not None else None  # upstream's mask: True where masked, [b|1, np|1, sq, sk]
    context = row_invariant_attention(_by_head(query, heads), _by_head(key, heads), _by_head(value, heads),
                                      instance.softmax_scale, causal=causal, hidden=hidden)
    return context.permute(2, 0, 1, 3).reshape(sq, b, heads * dim)


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.attention",
        summary="megatron-core's local core attention in one arithmetic with the dynamic engine's "
                "(tp_invariant.engine_attention), whose rows do not depend on the query count or key length",
        hook=DOT_PRODUCT_ATTENTION,
        targets=(Target(DOT_PRODUCT_ATTENTION, "DotProductAttention.forward", _local_attention, kind="method",
                        params=("self", "query", "key", "value", "attention_mask", "attn_mask_type",
                                "attention_bias", "packed_seq_params")),),
        notes=packing_note,
    ),
)
