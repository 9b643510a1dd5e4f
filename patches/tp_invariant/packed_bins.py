"""``tp_invariant``'s packed bins: a weight gradient of a packed (THD) bin cut at its sequences.

A micro-batch's sequences each hand the exact data-parallel sum a weight-gradient term of their own
(``gradient_terms.by_sequence``), which makes the micro-batch size free. A packed bin
(``--rl-use-sequence-packing``: ``packed_seq_params`` with ``qkv_format='thd'``) is one row holding
several sequences; here the calls that run the model's parts (the embedding, the transformer block and
each of its layers, where a recomputed forward also runs, and the output layer) say which rows each
sequence holds (``numerics.packed_bins``), so the mode's
linears, norms, biases and the word embedding hand over one term per sequence of the bin, each the
term an unpacked micro-batch of that sequence alone gives. Not cut yet: an MoE layer's router and
routed experts (their gradients stay the bin's).
"""

from __future__ import annotations

from megapatch.core.registry import Target
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import packed_bins
from megapatch.patches.tp_invariant._mode import tp_invariant_patch

GPT_MODEL = "megatron.core.models.gpt.gpt_model"
TRANSFORMER_BLOCK = "megatron.core.transformer.transformer_block"
TRANSFORMER_LAYER = "megatron.core.transformer.transformer_layer"


def _running(wrapped, packed_seq_params, args, kwargs):
    if not tpi.active() or packed_bins.running_for(packed_seq_params):  # (a layer inside its block)
        return wrapped(*args, **kwargs)
    packed = packed_bins.from_params(packed_seq_params)
    if packed is None:
        return wrapped(*args, **kwargs)
    with packed_bins.running(packed, packed_seq_params):
        return wrapped(*args, **kwargs)


def _call(wrapped, instance, args, kwargs):
    # megatron-core passes it by keyword to each of these (a recomputed layer too)
    return _running(wrapped, kwargs.get("packed_seq_params"), args, kwargs)


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.packed_bins",
        summary="a packed (THD) bin's weight gradients cut at its sequences: each sequence's term of the exact "
                "data-parallel sum the one an unpacked micro-batch of it alone gives (MoE routers and routed "
                "experts not cut yet)",
        hook=GPT_MODEL,
        # the model's embedding (_preprocess), its layers and final norm (the block; each layer again, as a
        # recomputed layer runs outside the block's call) and its output layer (_postprocess); not
        # GPTModel.forward itself, which logits.fp32_lm_head wraps
        targets=(
            Target(GPT_MODEL, "GPTModel._preprocess", _call, kind="method", params=("self", "input_ids")),
            Target(TRANSFORMER_BLOCK, "TransformerBlock.forward", _call, kind="method", params=("self", "hidden_states")),
            Target(TRANSFORMER_LAYER, "TransformerLayer.forward", _call, kind="method", params=("self",)),
            Target(GPT_MODEL, "GPTModel._postprocess", _call, kind="method", params=("self", "hidden_states")),
        ),
    ),
)
