"""The shared mechanism behind FP32 row-parallel accumulators and FP32 logits: megatron-core's
linear autograd Functions return an FP32 output while a caller asks for it
(``megapatch.numerics.fp32_output_linear.output_dtype``); otherwise they are upstream's, untouched."""

from __future__ import annotations

from megapatch.numerics import fp32_output_linear
from megapatch.core.registry import Patch, Target
from megapatch.patches._common import LAYERS, LINEAR_FUNCTIONS, MEGATRON_CORE_TESTED


def _forward_probe():
    """The FP32-output path calls upstream ``forward(ctx, input, weight, ...)`` itself."""
    import inspect

    from megatron.core.tensor_parallel import layers

    for name in LINEAR_FUNCTIONS:
        params = tuple(inspect.signature(getattr(layers, name).forward).parameters)
        if params[:3] != ("ctx", "input", "weight"):
            return f"{LAYERS}.{name}.forward takes {params}, expected (ctx, input, weight, ...)"
    return None


PATCHES = (
    Patch(
        name="linear.fp32_output",
        supports=MEGATRON_CORE_TESTED,
        option=None,
        summary="FP32 outputs of megatron-core linear Functions, on request only",
        hook="megatron.core.tensor_parallel",
        applies=lambda s: s.tp_reduce_dtype == "fp32" or s.logits_dtype == "fp32",
        probe=_forward_probe,
        watches=tuple(f"{LAYERS}:{name}.forward" for name in LINEAR_FUNCTIONS),
        targets=tuple(Target(LAYERS, f"{name}.apply", fp32_output_linear.apply_wrapper, kind="classmethod")
                      for name in LINEAR_FUNCTIONS),
    ),
)
