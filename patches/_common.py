"""What the patch families share: the versions they were tested on, the megatron-core linear
Functions, a layer's tensor-parallel group, ``Patch.applies`` for an option value, and the refusal
both MoE modes give grouped-GEMM experts without Transformer Engine."""

from __future__ import annotations

from typing import Callable

# Versions each patch was tested on (``Patch.supports``): the matrix re-runs them
# (``python tools/matrix.py``; docs/versions.md shows the generated table).
MEGATRON_CORE_TESTED = {"megatron-core": ">=0.12,<0.21"}
MEGATRON_CORE_TP_REDUCE_TESTED = {"megatron-core": ">=0.13,<0.21"}  # 0.12's _reduce has no group
# tests/test_tp_invariant.py passes on 0.16.1, 0.17.1, 0.18.2, 0.19.2 and main (docs/versions.md);
# below 0.16 the mode refuses (``tp_invariant._mode``: on 0.14.0 Llama-shaped models were not invariant)
MEGATRON_CORE_TP_INVARIANT_TESTED = {"megatron-core": ">=0.16,<0.21"}
TRANSFORMER_ENGINE_TESTED = {"transformer-engine": ">=2.9,<=2.20.2"}

LAYERS = "megatron.core.tensor_parallel.layers"
#: megatron-core's linear autograd Functions (FP32 outputs, FP32 row-parallel accumulators)
LINEAR_FUNCTIONS = ("LinearWithGradAccumulationAndAsyncCommunication", "LinearWithFrozenWeight")


def when(option: str, value) -> Callable:
    """``Patch.applies`` for a patch that serves ``option`` set to ``value``."""
    return lambda settings: getattr(settings, option) == value


def tp_group(layer):
    """The tensor-parallel group of a megatron-core layer (its own, else the global one)."""
    group = getattr(layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group


#: what both modes refuse for ``--moe-grouped-gemm`` without TE, naming the flags (TE's grouped experts,
#: ``TEGroupedMLP``, are covered by both)
LEGACY_GROUPED_EXPERTS = ("grouped-GEMM experts without Transformer Engine (Megatron-LM: --moe-grouped-gemm with "
                          "--transformer-impl local, the grouped_gemm package's GroupedMLP; TE's grouped experts, "
                          "--transformer-impl transformer_engine, are covered)")
