"""The dynamic engine's paged prefill and decode attention under ``tp_invariant``
(``Attention.flash_decode_and_prefill``): the arithmetic of ``tp_invariant.attention`` -- the trainer's
core attention -- with the keys and values read from the paged cache through the block table, as
flash-attn reads them, so each rollout row gets the trainer's bits for that position (why:
``patches/tp_invariant_attention.py``). On a GPU this replaces flash-attn's kernels with torch GEMMs
(slower; the price of the promise, and cuBLAS chooses kernels by shape: not shown there). Left to
upstream: multi-latent attention and softmax offsets (sinks).
"""

from __future__ import annotations

import torch

from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics.attention import causal_visible, paged_rows, repeat_groups, row_invariant_attention
from megapatch.patches._common import tp_invariant_patch

ATTENTION = "megatron.core.transformer.attention"


def _request_rows(q_rows, k_cache, v_cache, kv_length: int, blocks, scale: float) -> torch.Tensor:
    """One request's attention: ``q_rows`` [M, heads, dim], the request's last M positions, over its
    first ``kv_length`` cached keys (causal, end-aligned as flash-attn aligns them)."""
    heads = q_rows.shape[1]
    k = repeat_groups(paged_rows(k_cache, blocks, kv_length), heads, 1)
    v = repeat_groups(paged_rows(v_cache, blocks, kv_length), heads, 1)
    visible = causal_visible(q_rows.shape[0], kv_length, q_rows.device).unsqueeze(0)
    out = row_invariant_attention(q_rows.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, visible)
    return out.transpose(0, 1)


def _engine_attention(wrapped, instance, args, kwargs):
    names = ("q", "k", "v", "max_seqlen_q", "max_seqlen_k", "cu_seqlens_q", "cu_seqlens_k", "seqlens_k",
             "block_table", "is_decode_only")
    if (not state.current().tp_invariant or getattr(instance.config, "multi_latent_attention", False)
            or argument(args, kwargs, len(names), "softmax_offset", None) is not None):
        return wrapped(*args, **kwargs)
    call = {n: argument(args, kwargs, i, n) for i, n in enumerate(names)}
    q, k_cache, v_cache, table = call["q"], call["k"], call["v"], call["block_table"]
    out = torch.zeros_like(q)
    if call["is_decode_only"]:  # q [batch, 1, heads, dim]; upstream passes flash-attn no scale here
        scale = q.shape[-1] ** -0.5
        for i, length in enumerate(call["seqlens_k"].tolist()):
            if length > 0:
                out[i] = _request_rows(q[i], k_cache, v_cache, length, table[i], scale)
        return out
    scale = getattr(instance, "softmax_scale", None) or q.shape[-1] ** -0.5  # q [tokens, 1, heads, dim]
    q_bounds, kv_bounds = call["cu_seqlens_q"].tolist(), call["cu_seqlens_k"].tolist()
    for i in range(len(q_bounds) - 1):
        start, end = q_bounds[i], q_bounds[i + 1]
        if end > start:
            out[start:end, 0] = _request_rows(q[start:end, 0], k_cache, v_cache,
                                              kv_bounds[i + 1] - kv_bounds[i], table[i], scale)
    return out


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.engine_attention",
        summary="the dynamic engine's paged prefill/decode attention in the arithmetic of the trainer's "
                "(tp_invariant.attention), so a rollout's log-probs are the trainer's",
        hook=ATTENTION,
        targets=(Target(ATTENTION, "Attention.flash_decode_and_prefill", _engine_attention, kind="method",
                        params=("self", "q", "k", "v", "max_seqlen_q", "max_seqlen_k", "cu_seqlens_q",
                                "cu_seqlens_k", "seqlens_k", "block_table", "is_decode_only")),),
    ),
)
