"""The ``tp_reduce.transformer_engine`` wrappers of a TE layer's forward and of its fprop GEMM:
refusals, the row-parallel context, and (mode ``fp32``) the fprop GEMM's FP32 accumulator handed to
the reduction (``_te_reductions``) or, for a routed expert's fc2, to the MoE layer's FP32 sums."""

from __future__ import annotations

import contextvars
import dataclasses
import sys
from typing import Any, List, Optional

import torch

from megapatch.core import state
from megapatch.core.call_args import argument, with_argument
from megapatch.core.errors import UnsupportedConfigurationError, UpstreamSurfaceError
from megapatch.core.scope import scoped
from megapatch.numerics import fp32_collectives
from megapatch.numerics.dtypes import LOW_PRECISION
from megapatch.patches.tp_reduce._reduction import MOE_FP32_SUM, reduction_mode

TE = "transformer_engine.pytorch"


@dataclasses.dataclass
class _RowForward:
    """One row-parallel layer forward in mode fp32: its FP32 accumulators awaiting their reduction."""

    layer: str
    group: Any
    pending: List[torch.Tensor] = dataclasses.field(default_factory=list)
    dtype: Optional[torch.dtype] = None  # what TE asked the GEMM for (the activation dtype)
    intercepted: int = 0

    def claim(self, tensor) -> bool:
        for i, acc in enumerate(self.pending):
            if acc is tensor:
                del self.pending[i]
                return True
        return False


_row_forward: contextvars.ContextVar[Optional[_RowForward]] = contextvars.ContextVar(
    "megapatch_te_row_forward", default=None)


@dataclasses.dataclass
class _HandedOn:
    """One forward of a routed expert's fc2 in mode fp32 (marked by ``tp_reduce.moe``: the MoE layer
    sums the experts' outputs on in FP32 and rounds once): its fprop GEMM's FP32 accumulator, and the
    rounded copy TE itself goes on with."""

    layer: str
    accumulator: Optional[torch.Tensor] = None
    rounded: Optional[torch.Tensor] = None
    intercepted: int = 0


_handed_on: contextvars.ContextVar[Optional[_HandedOn]] = contextvars.ContextVar(
    "megapatch_te_handed_on", default=None)


class _AccumulatorOut(torch.autograd.Function):
    """Forward: the FP32 accumulator in place of TE's rounded output. Backward: the gradient cast to
    the activation dtype, into TE's own backward (the contract of Megatron-LM PR #6252, as
    ``numerics.fp32_output_linear`` keeps it for megatron-core's linears)."""

    @staticmethod
    def forward(ctx, rounded, accumulator):
        ctx.dtype = rounded.dtype
        return accumulator.view_as(rounded)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None  # (autograd would cast it too: it is the rounded output's gradient)


# -- layer forward: refusals, and the row-parallel context --------------------------------------

def layer_forward(layer):
    def forward(wrapped, instance, args, kwargs):
        mode = state.current().tp_reduce_dtype
        if mode not in fp32_collectives.MODES:
            return wrapped(*args, **kwargs)
        parallel = read(instance, layer.parallel_attr)
        if mode == "fp32" and getattr(instance, MOE_FP32_SUM, False):
            return _hand_on_accumulator(wrapped, instance, args, kwargs, layer, parallel)
        ctx = None
        if layer.split(parallel) and read(instance, "tp_size") > 1:
            _refuse_unsupported(instance, layer, mode)
            if mode == "fp32" and layer.row_parallel(parallel):
                ctx = _RowForward(type(instance).__name__, read(instance, "tp_group"))
        with scoped(_row_forward, ctx):  # also hides an enclosing layer's context
            result = wrapped(*args, **kwargs)
        if ctx is not None and ctx.pending:
            raise UpstreamSurfaceError(
                f"megapatch: {ctx.layer}.forward made {ctx.intercepted} FP32-accumulator GEMM(s) but "
                f"reduced {ctx.intercepted - len(ctx.pending)}: an FP32 partial sum would leave the layer "
                f"unreduced. Transformer Engine's row-parallel forward changed",
                hint="Use tp_reduce_dtype='fp32-accumulate' (no GEMM change) or 'native'.")
        out = result[0] if isinstance(result, (tuple, list)) else result
        if ctx is not None and ctx.intercepted and getattr(out, "dtype", None) == torch.float32:
            raise UpstreamSurfaceError(
                f"megapatch: {ctx.layer}.forward returned float32 after its fprop GEMM was switched to "
                f"an FP32 accumulator (activation dtype {ctx.dtype}): Transformer Engine's row-parallel "
                f"forward changed", hint="Use tp_reduce_dtype='fp32-accumulate' or 'native'.")
        return result

    forward.__name__ = forward.__qualname__ = f"{layer.cls}_forward"
    return forward


def grouped_forward(wrapped, instance, args, kwargs):
    """``GroupedLinear.forward``: grouped-GEMM experts' fc2 (``TEGroupedMLP``) hands its FP32
    accumulators on under fp32 when ``tp_reduce.moe`` marked it; otherwise untouched (a grouped
    linear does no TP communication: the token dispatcher does)."""
    if state.current().tp_reduce_dtype != "fp32" or not getattr(instance, MOE_FP32_SUM, False):
        return wrapped(*args, **kwargs)
    return _hand_on_accumulator(wrapped, instance, args, kwargs, None, None)


def _hand_on_accumulator(wrapped, instance, args, kwargs, layer, parallel):
    """A routed expert's fc2 (TE ``Linear``, or ``GroupedLinear`` for grouped-GEMM experts: neither
    sums anything itself, the token dispatcher does) returns its fprop GEMM's FP32 accumulator, for
    the MoE layer's FP32 sums."""
    name = type(instance).__name__
    if layer is not None and (layer.cls != "Linear" or (layer.split(parallel) and read(instance, "tp_size") > 1)):
        raise UnsupportedConfigurationError(
            f"megapatch tp_reduce_dtype='fp32': {name} ({layer.cls}, {parallel!r}, tp_size "
            f"{read(instance, 'tp_size')}) is marked to hand its FP32 output on to the MoE layer, but "
            f"it reduces over TP itself. Routed experts' fc2 (TE runs it without a TP reduction) is covered",
            hint="Use tp_reduce_dtype='fp32-accumulate' or 'native' for this model.")
    handed = _HandedOn(name)
    with scoped(_row_forward, None), scoped(_handed_on, handed):
        result = wrapped(*args, **kwargs)
    out = result[0] if isinstance(result, (tuple, list)) else result
    if (handed.intercepted != 1 or out.data_ptr() != handed.rounded.data_ptr()
            or out.numel() != handed.rounded.numel()):
        raise UpstreamSurfaceError(
            f"megapatch tp_reduce_dtype='fp32': {name}.forward (a routed expert's fc2) made "
            f"{handed.intercepted} recognised fprop GEMM(s) and did not return that GEMM's output as it is: "
            f"a GEMM-fused bias, FP8 output, or a changed Transformer Engine forward",
            hint="Use tp_reduce_dtype='fp32-accumulate' or 'native'.")
    full = _AccumulatorOut.apply(out, handed.accumulator)
    return (full, *result[1:]) if isinstance(result, (tuple, list)) else full


def _refuse_unsupported(instance, layer, mode: str) -> None:
    name = f"{type(instance).__name__} ({read(instance, 'tp_size')}-way tensor parallel)"
    flags = [f for f in layer.ub_reducing if read(instance, f)]
    config = getattr(instance, "config", None)  # megatron-core's TELinear & co. keep theirs
    megatron_ub = bool(getattr(config, "tp_comm_overlap", False)) and any(
        getattr(config, f, True) for f in ("tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad",
                                           "tp_comm_bulk_wgrad"))
    if flags or megatron_ub:
        backend = "cuBLASMp" if _using_cublasmp() else "Userbuffers"
        found = f"{', '.join(flags)} set on the layer" if flags else "megatron tp_comm_overlap=True"
        raise UnsupportedConfigurationError(
            f"megapatch tp_reduce_dtype={mode!r} cannot be honoured for {name}: comm+GEMM overlap "
            f"({found}) makes {backend} reduce-scatter inside the GEMM kernel, in the activation "
            f"dtype, out of megapatch's reach. Turn the reduce-scatter overlaps off (TE: no "
            f"ub_overlap_rs/ub_overlap_rs_dgrad/ub_bulk_wgrad; Megatron: no --tp-comm-overlap, or "
            f"tp_comm_overlap_rs=tp_comm_overlap_rs_dgrad=tp_comm_bulk_wgrad=False), or set "
            f"tp_reduce_dtype='native'.")
    if torch.compiler.is_compiling():
        raise UnsupportedConfigurationError(
            f"megapatch tp_reduce_dtype={mode!r} cannot be honoured for {name} under torch.compile: "
            f"the compiled layer (TE >= 2.20 custom op) does not run megapatch's Python wrappers. "
            f"Run the tensor-parallel TE layers eagerly (torch.compiler.disable, or compile only "
            f"other parts), or set tp_reduce_dtype='native'.")


def _using_cublasmp() -> bool:
    base = sys.modules.get(f"{TE}.module.base")
    probe = getattr(base, "using_cublasmp_backend", None)  # TE >= 2.17
    return bool(probe()) if probe is not None else False


def read(obj, attr: str):
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise UpstreamSurfaceError(
            f"megapatch: {type(obj).__module__}.{type(obj).__qualname__} has no attribute {attr!r}, "
            f"which the tp_reduce_dtype patch reads") from None


# -- the fprop GEMM of a row-parallel forward returns its FP32 accumulator (mode fp32) -----------

def _is_row_fprop(kwargs) -> bool:
    """TE's fprop call: ``general_gemm(weight, input, quantization_params=..., out_dtype=...,
    bias=..., use_split_accumulator=..., ub=..., ub_type=..., extra_output=...)`` -- layout TN, no
    ``out``/``grad``/``accumulate``/``gelu`` (this also tells LayerNormMLP's fc1 apart: it passes
    ``gelu=`` and no ``extra_output=``). Row-parallel bias is never fused (added after the
    reduction), and the output is not quantized."""
    return ("extra_output" in kwargs and kwargs["extra_output"] is None
            and kwargs.get("out_dtype") in LOW_PRECISION
            and kwargs.get("layout", "TN") == "TN"
            and not kwargs.get("grad") and not kwargs.get("accumulate") and not kwargs.get("gelu")
            and kwargs.get("out") is None and kwargs.get("bias") is None
            and kwargs.get("quantization_params") is None
            and kwargs.get("ub") is None and kwargs.get("ub_type") is None)


def general_gemm(wrapped, instance, args, kwargs):
    handed = _handed_on.get()
    if handed is not None and _is_row_fprop(kwargs):
        result = wrapped(*args, **dict(kwargs, out_dtype=torch.float32))
        handed.accumulator = result[0]
        handed.rounded = result[0].to(kwargs["out_dtype"])
        handed.intercepted += 1
        return type(result)((handed.rounded, *result[1:]))
    ctx = _row_forward.get()
    if ctx is None or not _is_row_fprop(kwargs):
        return wrapped(*args, **kwargs)
    dtype = kwargs["out_dtype"]
    # the reduction of this output follows: same mode check (and cross-rank check) as there
    probe = torch.empty((), dtype=dtype, device="meta")
    if reduction_mode(probe, ctx.group) != "fp32":
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **dict(kwargs, out_dtype=torch.float32))
    if result[0].dtype != torch.float32:
        raise UpstreamSurfaceError(
            f"megapatch asked general_gemm for an FP32 output in {ctx.layer}.forward and got "
            f"{result[0].dtype}")
    ctx.pending.append(result[0])
    ctx.dtype = dtype
    ctx.intercepted += 1
    return result


def _is_grouped_fprop(args, kwargs) -> bool:
    """``GroupedLinear``'s fprop call: ``general_grouped_gemm(weights, inputs, [out], quantizers,
    dtype, single_output=True, m_splits=..., bias=..., use_bias=..., ...)`` -- layout TN, one
    low-precision output, no quantizer, no bias, GELU, gradient or accumulation."""
    out = argument(args, kwargs, 2, "out", None)
    quantizers = argument(args, kwargs, 3, "quantization_params", None) or ()
    return (isinstance(out, (list, tuple)) and len(out) == 1 and out[0].dtype in LOW_PRECISION
            and kwargs.get("single_output") is True and kwargs.get("layout", "TN") == "TN"
            and not kwargs.get("grad") and not kwargs.get("accumulate") and not kwargs.get("gelu")
            and not kwargs.get("use_bias") and kwargs.get("D_dtype") is None
            and all(q is None for q in quantizers))


def general_grouped_gemm(wrapped, instance, args, kwargs):
    handed = _handed_on.get()
    if handed is None or not _is_grouped_fprop(args, kwargs):
        return wrapped(*args, **kwargs)
    out = argument(args, kwargs, 2, "out")
    accumulator = torch.empty_like(out[0], dtype=torch.float32)
    args, kwargs = with_argument(args, kwargs, 2, "out", [accumulator])
    result = wrapped(*args, **kwargs)
    out[0].copy_(accumulator)  # TE goes on with the rounded output
    handed.accumulator, handed.rounded = accumulator, out[0]
    handed.intercepted += 1
    return type(result)((out[0], *result[1:]))


def claim(tensor) -> Optional[_RowForward]:
    """The row-parallel forward whose FP32 accumulator ``tensor`` is (claimed now), else None.
    A low-precision tensor reduced by a row-parallel forward in mode fp32 means its GEMM was not
    recognised: refused rather than summed from rounded partials."""
    ctx = _row_forward.get()
    if ctx is None:
        return None
    if ctx.claim(tensor):
        return ctx
    if tensor.dtype in LOW_PRECISION:
        raise UpstreamSurfaceError(
            f"megapatch tp_reduce_dtype='fp32': {ctx.layer}.forward reduces a {tensor.dtype} output "
            f"that did not come from an FP32-accumulator GEMM ({ctx.intercepted} intercepted). Its "
            f"fprop GEMM was not recognised: FP8 output (fp8_output=True), a debug quantizer, a "
            f"GEMM-fused bias, or a changed Transformer Engine",
            hint="Use tp_reduce_dtype='fp32-accumulate' (FP32 sum of the rounded partials) or 'native'.")
    return None
