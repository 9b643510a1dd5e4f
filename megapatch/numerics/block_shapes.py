"""Which model shapes the fixed block tree can split (``tp_invariant=True``), as refusals.

Every dimension tensor parallelism splits is cut into W equal blocks (W = ``tp_invariant_width``)
and each TP rank owns W/TP of them, so the TP size must divide W and W must divide every split
dimension. The functions here say which part of a model breaks that rule, naming the size, the
Megatron-LM flag that set it and what to change: ``(what, why)`` pairs, in the words of
the refusals of ``tp_invariant`` (``patches/tp_invariant/_refusal_tables.py``). The same functions decide at model construction (the
patch) and before a job is submitted (``megapatch doctor -- <flags>``, through the patch's
preflight), so the two cannot disagree.

A config here is any object with megatron-core ``TransformerConfig`` field names as attributes;
a missing or None field is a size nobody knows yet, and is not checked. Nothing here imports
torch: ``megapatch doctor`` reads flags with it where torch may be missing.
"""

from __future__ import annotations

import math
import sys
import types
from typing import List, Optional, Sequence, Tuple

from megapatch.core import options, state

WIDTH_OPTION = "tp_invariant_width"
Refusal = Tuple[str, str]


def width() -> int:
    return int(getattr(state.current(), WIDTH_OPTION, 8))


def valid_widths(tp: int, sizes: Sequence[int] = ()) -> str:
    """The widths the option accepts that the TP size divides and that divide every one of
    ``sizes`` (the dimensions TP splits), as a message lists them."""
    fits = [w for w in options.OPTIONS_BY_NAME[WIDTH_OPTION].choices
            if w % tp == 0 and all(size % w == 0 for size in sizes)]
    return ", ".join(map(str, fits)) or "none"


def tp_size(config) -> int:
    return getattr(config, "tensor_model_parallel_size", 1) or 1


def _width() -> str:
    return f"the width W={width()} ({state.origin(WIDTH_OPTION)})"


def _split_dimensions(config, seq_length: Optional[int] = None) -> List[Tuple[str, int, str]]:
    """``(what, size, the flag to change)`` for each dimension a GPT layer built from ``config``
    splits over TP. The sequence counts only with sequence parallelism at TP > 1 (norm and bias
    gradients then sum it in W blocks across ranks), where its length is known: the config's
    ``seq_length`` (the doctor's, from ``--seq-length``), else ``seq_length`` (the run's, from a
    Megatron-LM job's arguments: megatron-core's ``TransformerConfig`` has no such field; see
    :func:`megatron_lm_sequence_length`). Unknown, the run meets it at its first step."""
    found = []
    heads, channels = getattr(config, "num_attention_heads", None), getattr(config, "kv_channels", None)
    if heads and channels and not getattr(config, "multi_latent_attention", False):
        groups = getattr(config, "num_query_groups", None) or heads
        qkv = (heads + 2 * groups) * channels
        found.append((f"the attention's query-key-value output features, (num_attention_heads {heads} + 2 x "
                      f"num_query_groups {groups}) x kv_channels {channels} = {qkv}",
                      qkv, "--num-query-groups or --kv-channels"))
        found.append((f"the attention projection's input features, num_attention_heads {heads} x "
                      f"kv_channels {channels} = {heads * channels}", heads * channels, "--kv-channels"))
    ffn = getattr(config, "ffn_hidden_size", None)
    gated = getattr(config, "gated_linear_unit", False)
    if ffn:
        found.append((f"ffn_hidden_size={ffn} (--ffn-hidden-size)"
                      + (", the size of each of the SwiGLU fc1's gate and up halves (--swiglu)" if gated else ""),
                      ffn, "--ffn-hidden-size"))
    if getattr(config, "num_moe_experts", None):  # routed and shared experts: column/row parallel over expert TP
        for field, flag in (("moe_ffn_hidden_size", "--moe-ffn-hidden-size"),
                            ("moe_shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size")):
            size = getattr(config, field, None)
            if size:
                found.append((f"{field}={size} ({flag})"
                              + (", the size of each of the SwiGLU fc1's gate and up halves" if gated else ""),
                              size, flag))
    seq = getattr(config, "seq_length", None) or seq_length
    if seq and getattr(config, "sequence_parallel", False) and tp_size(config) > 1:
        found.append((f"the sequence length {seq} (--seq-length) with --sequence-parallel at TP {tp_size(config)}",
                      seq, "--seq-length"))
    return found


def qk_norm_refusals(config) -> List[Refusal]:
    """With QK layernorm, the heads (query norm) and KV groups (key norm) whose count W neither
    divides nor is a multiple of: each norm's weight gradient sums over them as W leaves of the
    fixed tree (``block_tree._head_leaves``)."""
    if not getattr(config, "qk_layernorm", False):
        return []
    w, found = width(), []
    heads = getattr(config, "num_attention_heads", None)
    groups = getattr(config, "num_query_groups", None) or heads
    for what, count, flag in ((f"num_attention_heads={heads}", heads, "--num-attention-heads"),
                              (f"num_query_groups={groups}", groups, "--num-query-groups")):
        if count and count % w and w % count:
            found.append((f"{what} ({flag}) with --qk-layernorm",
                          f"the QK norm's weight gradient sums over the heads TP splits as W blocks, so W must "
                          f"divide the count or be a multiple of it, and {_width()} is neither: change {flag} "
                          f"or the width"))
    return found


def shape_refusals(config, seq_length: Optional[int] = None) -> List[Refusal]:
    """The TP size against the width, then every split dimension the width does not divide
    (``seq_length``: the sequence's length where ``config`` has none, else None)."""
    w, tp = width(), tp_size(config)
    found = []
    if w % tp:
        found.append((f"the tensor-parallel size {tp} (--tensor-model-parallel-size) with {_width()}",
                      f"each rank owns W/TP of the W blocks, so the TP size must divide W; widths for "
                      f"TP={tp}: {valid_widths(tp)}"))
    dimensions = _split_dimensions(config, seq_length)
    fits = valid_widths(tp, [size for _, size, _ in dimensions])
    for what, size, flag in dimensions:
        if size % w:
            found.append((what, f"every dimension TP splits is cut into W equal blocks, and {_width()} does "
                                f"not divide {size}: change {flag} to a multiple of {w}, or use a width "
                                f"that fits this model at TP={tp}: {fits}"))
    return found + qk_norm_refusals(config)


_NULL_TOKENIZERS = ("NullTokenizer",)  # their vocabulary is --vocab-size plus one EOD token


def padded_vocabulary(vocab_size: Optional[int], tokenizer_type: Optional[str], divisible_by: int,
                      tp: int, eod_added: bool = True) -> Optional[int]:
    """The size Megatron-LM builds the model with from ``--vocab-size``: the NullTokenizer's
    vocabulary (plus its EOD token) rounded up to a multiple of ``--make-vocab-size-divisible-by``
    x TP (``megatron/training/tokenizer``: ``_vocab_size_with_padding``); None for other
    tokenizers, whose vocabulary comes from their files. ``eod_added``: core_v0.16.1's NullTokenizer
    adds the EOD token; Megatron-LM main's takes it inside ``--vocab-size`` (EOD = vocab_size - 1)."""
    if vocab_size is None or tokenizer_type not in _NULL_TOKENIZERS:
        return None
    multiple = divisible_by * tp
    return -(-(vocab_size + int(eod_added)) // multiple) * multiple


def vocabulary_refusal(vocabulary, tp: int) -> Optional[Refusal]:
    """``vocabulary.padded_vocab_size`` (the output layer's, the embedding's and the cross
    entropy's TP-split size) when W does not divide it, naming the flags that padded it
    (``vocab_size``, ``make_vocab_size_divisible_by``, ``tokenizer_type``: Megatron-LM's
    arguments, None where unknown)."""
    padded, w = getattr(vocabulary, "padded_vocab_size", None), width()
    if not padded or padded % w == 0:
        return None
    vocab = getattr(vocabulary, "vocab_size", None)
    multiple = getattr(vocabulary, "make_vocab_size_divisible_by", None)
    tokenizer = getattr(vocabulary, "tokenizer_type", None)
    needed = w // math.gcd(w, tp)  # --make-vocab-size-divisible-by x TP is then a multiple of W
    if multiple and padded_vocabulary(vocab, tokenizer, multiple, tp) == padded:
        how = (f"Megatron-LM pads --vocab-size {vocab} + 1 EOD token ({tokenizer}) up to a multiple of "
               f"--make-vocab-size-divisible-by {multiple} x TP {tp} = {multiple * tp}")
    else:  # a tokenizer's own vocabulary, or --padded-vocab-size
        how = ("the model's vocab_size (Megatron-LM pads the tokenizer's vocabulary up to a multiple of "
               "--make-vocab-size-divisible-by x TP, or takes --padded-vocab-size)")
    return (f"the padded vocabulary of {padded} entries",
            f"{how}; the output layer, the embedding and the cross entropy cut it into W equal blocks, and "
            f"{_width()} does not divide {padded}: set --make-vocab-size-divisible-by to a multiple of "
            f"{needed} (its default 128 is one)")


_VOCABULARY_ARGS = ("padded_vocab_size", "vocab_size", "make_vocab_size_divisible_by", "tokenizer_type")


def megatron_lm_args():
    """Inside a Megatron-LM job, its parsed arguments, else None. Megatron-LM keeps them in its
    global args (``megatron.training.global_vars``), read only when that module is already
    loaded (never imported from here) and once they are set (``initialize_megatron``)."""
    return getattr(sys.modules.get("megatron.training.global_vars"), "_GLOBAL_ARGS", None)


def megatron_lm_vocabulary():
    """Inside a Megatron-LM job, the padded vocabulary its model is built with and the arguments
    that padded it, else None: a model knows its padded size, not the flags behind it."""
    args = megatron_lm_args()
    if getattr(args, "padded_vocab_size", None) is None:
        return None
    return types.SimpleNamespace(**{name: getattr(args, name, None) for name in _VOCABULARY_ARGS})


def megatron_lm_sequence_length(config=None) -> Optional[int]:
    """Inside a Megatron-LM job, ``--seq-length``: the length of the sequences its GPT datasets
    (mock and indexed) cut, which every layer sees, the decoder's input being ``[s, b, h]``; else
    None, also where ``config`` (the model's ``TransformerConfig``) says that batches vary in
    length (``variable_seq_lengths``): then only a batch tells, at the first step."""
    args = megatron_lm_args()
    if args is None or getattr(config, "variable_seq_lengths", False):
        return None
    return getattr(args, "seq_length", None)
