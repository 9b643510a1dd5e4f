"""``--attention-backend`` under ``tp_invariant``: accepted, with one line saying what runs instead.

Core attention runs as the mode's attention whatever the backend asks for (``tp_invariant.attention``
for megatron-core's local attention, ``tp_invariant.transformer_engine`` for TE's
``DotProductAttention``): FP32 products over fixed query-by-key blocks, never a whole score matrix,
recomputed in the backward. A job that chose a
backend (``--attention-backend flash``, Megatron RL's example) is told so once, on rank 0, when its
model is built (``tp_invariant.construction``), and ``megapatch doctor -- <flags>`` prints the same
line (the record's ``notes``). ``auto``, the default, chose nothing: docs/tp_invariant.md says what runs.
"""

from __future__ import annotations

from typing import Optional

from megapatch.core import report
from megapatch.numerics import block_shapes
from megapatch.numerics.attention import QUERY_BLOCK

#: the backend a job chose -> what it would have run, and what that keeps of the score matrix
_INSTEAD = {
    "flash": "flash attention, which keeps no score matrix",
    "fused": "cuDNN's fused attention, which keeps no score matrix",
    "unfused": "Transformer Engine's unfused attention (BF16 score matrices)",
    "local": "megatron-core's local attention (BF16 score matrices)",
}


def _backend(config) -> Optional[str]:
    value = getattr(config, "attention_backend", None)
    name = getattr(value, "name", None) or (str(value).rsplit(".", 1)[-1] if value is not None else None)
    return name if name in _INSTEAD else None


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}" if unit == "GiB" else f"{count / scale:.0f} {unit}"
    return f"{count} bytes"


def attention_backend_note(config, seq_length: Optional[int] = None) -> Optional[str]:
    """The line for a job whose config chose an attention backend, or None (``auto``, or none)."""
    name = _backend(config)
    if name is None:
        return None
    seq_length = seq_length if seq_length is not None else getattr(config, "seq_length", None)
    cost = f"at most 4 x {QUERY_BLOCK} x S bytes of scores for each head and sequence"
    if seq_length:
        heads = (getattr(config, "num_attention_heads", None) or 0) // (getattr(config, "tensor_model_parallel_size", 1) or 1)
        per_head = 4 * QUERY_BLOCK * seq_length
        cost += f": {_size(per_head)} at --seq-length {seq_length}"
        if heads:
            cost += f", {_size(per_head * heads)} a layer and sequence for the {heads} heads of a TP rank"
    return (f"megapatch tp_invariant: --attention-backend {name} is accepted, but core attention runs as the "
            f"mode's attention instead of {_INSTEAD[name]}: FP32 products over {QUERY_BLOCK}-query by 64-key "
            f"blocks, recomputed in the backward ({cost}), slower than a fused kernel, memory growing as "
            f"S x {QUERY_BLOCK}, not S x S; it is what gives "
            f"training and the rollout engine the same bits (docs/tp_invariant.md)")


def notes(config) -> Optional[str]:
    """The record's ``notes``: the line for the model ``megapatch doctor -- <flags>`` derives."""
    return attention_backend_note(config)


def say_attention_backend(config) -> None:
    """Log the line once per job (rank 0) as the model is built; in a Megatron-LM job with its
    ``--seq-length``, as the doctor says it."""
    note = attention_backend_note(config, block_shapes.megatron_lm_sequence_length(config))
    if note is not None:
        report.once("tp_invariant:attention_backend", "warning", note)
