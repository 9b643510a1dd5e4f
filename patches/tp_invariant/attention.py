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
FP32 products on padded shapes, scores and probabilities rounded to the activation dtype as upstream
rounds them (the engine's side, its keys read from the paged cache: ``patches/tp_invariant/engine_attention.py``).

Left to upstream (the mode's other guarantees hold there, this one does not): attention with softmax
offsets (sinks), sliding windows, query-key layer scaling, dropout in training, attention bias and packed
sequences. TE's ``DotProductAttention`` runs as this local attention under the mode
(``tp_invariant.transformer_engine``), so it takes this arithmetic too.
"""

from __future__ import annotations

import torch

from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics.attention import causal_visible, repeat_groups, row_invariant_attention
from megapatch.patches.tp_invariant._mode import tp_invariant_patch

DOT_PRODUCT_ATTENTION = "megatron.core.transformer.dot_product_attention"


def _plain_local_attention(instance, bias, packed) -> bool:
    softmax = getattr(instance, "scale_mask_softmax", None)
    return (bias is None and packed is None and getattr(instance, "softmax_offset", None) is None
            and softmax is not None and getattr(softmax, "scale", None) is None
            and getattr(softmax, "window_size", None) is None
            and not (instance.training and instance.attention_dropout.p > 0))


def _local_attention(wrapped, instance, args, kwargs):
    bias = argument(args, kwargs, 5, "attention_bias", None)
    packed = argument(args, kwargs, 6, "packed_seq_params", None)
    if not state.current().tp_invariant or not _plain_local_attention(instance, bias, packed):
        return wrapped(*args, **kwargs)
    query, key, value = (argument(args, kwargs, i, n) for i, n in enumerate(("query", "key", "value")))
    mask = argument(args, kwargs, 3, "attention_mask", None)
    mask_type = argument(args, kwargs, 4, "attn_mask_type", None) or instance.attn_mask_type
    sq, b, heads, dim = query.shape
    sk = key.shape[0]
    key, value = repeat_groups(key, heads, 2), repeat_groups(value, heads, 2)
    if mask is not None:  # upstream's boolean mask, True where masked, broadcast to [b, np, sq, sk]
        visible = (~mask.bool()).expand(b, heads, sq, sk).reshape(b * heads, sq, sk)
    elif getattr(mask_type, "name", None) == "causal":
        visible = causal_visible(sq, sk, query.device).unsqueeze(0)
    else:
        visible = torch.ones(1, sq, sk, dtype=torch.bool, device=query.device)

    def by_head(t):  # [s, b, np, hn] -> [b * np, s, hn]
        return t.permute(1, 2, 0, 3).reshape(b * heads, t.shape[0], dim)

    context = row_invariant_attention(by_head(query), by_head(key), by_head(value), instance.softmax_scale, visible)
    return context.view(b, heads, sq, dim).permute(2, 0, 1, 3).reshape(sq, b, heads * dim)


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.attention",
        summary="megatron-core's local core attention in one arithmetic with the dynamic engine's "
                "(tp_invariant.engine_attention), whose rows do not depend on the query count or key length",
        hook=DOT_PRODUCT_ATTENTION,
        targets=(Target(DOT_PRODUCT_ATTENTION, "DotProductAttention.forward", _local_attention, kind="method",
                        params=("self", "query", "key", "value", "attention_mask", "attn_mask_type",
                                "attention_bias", "packed_seq_params")),),
    ),
)
