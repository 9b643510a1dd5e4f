"""``tp_invariant.tensor_parallel``: megatron-core's column- and row-parallel linear layers
(``_linear_layers``) and vocab-parallel cross entropy (``_cross_entropy``) through the fixed FP32
block tree (``megapatch.numerics.block_tree``), so their results do not depend on the TP size."""

from __future__ import annotations

from megapatch.core.registry import Target
from megapatch.patches._common import LAYERS
from megapatch.patches.tp_invariant._cross_entropy import CROSS_ENTROPY, predicted_logits, refuse_sharded_smoothing
from megapatch.patches.tp_invariant._linear_layers import column_forward_impl, column_init, row_forward
from megapatch.patches.tp_invariant._mode import tp_invariant_patch


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.tensor_parallel",
        summary="TP-invariant linear layers and vocab-parallel cross entropy (fixed-tree FP32 sums)",
        hook="megatron.core.tensor_parallel",
        watches=(f"{LAYERS}:ColumnParallelLinear.forward",),
        targets=(
            Target(LAYERS, "ColumnParallelLinear._forward_impl", column_forward_impl, kind="method",
                   params=("self", "input", "weight")),
            Target(LAYERS, "ColumnParallelLinear.__init__", column_init, kind="method",
                   params=("self", "input_size", "output_size")),
            Target(LAYERS, "RowParallelLinear.forward", row_forward, kind="method",
                   params=("self", "input_")),
            Target(CROSS_ENTROPY, "VocabParallelCrossEntropy.calculate_predicted_logits",
                   predicted_logits, kind="staticmethod",
                   params=("vocab_parallel_logits", "target", "logits_max")),
            Target(CROSS_ENTROPY, "_VocabParallelCrossEntropy.forward", refuse_sharded_smoothing,
                   kind="staticmethod", params=("ctx", "vocab_parallel_logits")),  # a profiler's (ctx, logits, *args) too
        ),
    ),
)
