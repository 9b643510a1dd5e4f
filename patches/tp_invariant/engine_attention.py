"""The dynamic engine's paged prefill and decode attention under ``tp_invariant``
(``Attention.flash_decode_and_prefill``): the arithmetic of ``tp_invariant.attention`` -- the trainer's
core attention -- with the keys and values read from the paged cache through the block table, as
flash-attn reads them, so each rollout row gets the trainer's bits for that position (why:
``patches/tp_invariant/attention.py``). On a GPU this replaces flash-attn's kernels with torch GEMMs
(slower; the price of the promise, and cuBLAS chooses kernels by shape: not shown there). Left to
upstream: multi-latent attention and softmax offsets (sinks).
"""

from __future__ import annotations

import torch

from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics.attention import by_request, kv_lengths, paged_rows, repeat_groups, row_invariant_attention
from megapatch.patches.tp_invariant._mode import tp_invariant_patch

ATTENTION = "megatron.core.transformer.attention"


def _request_rows(q_rows, k_cache, v_cache, kv_length: int, blocks, scale: float) -> torch.Tensor:
    """One request's attention: ``q_rows`` [M, heads, dim], the request's last M positions, over its
    first ``kv_length`` cached keys (causal, end-aligned as flash-attn aligns them)."""
    heads = q_rows.shape[1]
    k = repeat_groups(paged_rows(k_cache, blocks, kv_length), heads, 1)
    v = repeat_groups(paged_rows(v_cache, blocks, kv_length), heads, 1)
    out = row_invariant_attention(q_rows.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, causal=True)
    return out.transpose(0, 1)


def _engine_attention(wrapped, instance, args, kwargs):
    names = ("q", "k", "v", "max_seqlen_q", "max_seqlen_k", "cu_seqlens_q", "cu_seqlens_k", "seqlens_k",
             "block_table", "is_decode_only")
    if (not state.current().tp_invariant or getattr(instance.config, "multi_latent_attention", False)
            or argument(args, kwargs, len(names), "softmax_offset", None) is not None):
        return wrapped(*args, **kwargs)
    call = {n: argument(args, kwargs, i, n) for i, n in enumerate(names)}
    q, k_cache, v_cache, table = call["q"], call["k"], call["v"], call["block_table"]
    if call["is_decode_only"]:  # upstream passes flash-attn no scale here
        scale, bounds, counts = q.shape[-1] ** -0.5, list(range(q.shape[0] + 1)), call["seqlens_k"].tolist()
    else:
        scale = getattr(instance, "softmax_scale", None) or q.shape[-1] ** -0.5
        bounds, counts = call["cu_seqlens_q"].tolist(), kv_lengths(call["cu_seqlens_k"])
    # q: [batch, 1, heads, dim] (decode: one query a request) or [tokens, 1, heads, dim] (prefill)
    return by_request(lambda rows, keys, blocks: _request_rows(rows, k_cache, v_cache, keys, blocks, scale),
                      q[:, 0], bounds, counts, table).unsqueeze(1)

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
