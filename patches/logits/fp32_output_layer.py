"""``logits.fp32_output_layer``: the output layer the model marked computes its logits in FP32.

A separate hook from the marking records: ``ColumnParallelLinear`` is imported long before (or
without) ``GPTModel``; if this half is missing, the marking half raises instead of returning BF16
logits (helpers: ``_lm_head``)."""

from __future__ import annotations

from megapatch.core.registry import Target
from megapatch.patches._common import LAYERS
from megapatch.patches.logits._lm_head import column_parallel_forward, logits_patch

PATCHES = (
    logits_patch(
        name="logits.fp32_output_layer",
        summary="the marked output layer computes its logits in FP32",
        hook="megatron.core.tensor_parallel",
        targets=(
            Target(LAYERS, "ColumnParallelLinear.forward", column_parallel_forward, kind="method",
                   params=("self", "input_")),
        ),
    ),
)
