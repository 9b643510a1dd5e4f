"""Run megatron-core's own linear autograd Functions with an FP32 output.

Upstream's ``LinearWithGradAccumulationAndAsyncCommunication`` and ``LinearWithFrozenWeight``
compute ``torch.matmul(total_input, weight.t())`` in the activation dtype. When a caller asks for
an FP32 output (``output_dtype(torch.float32)``, a context variable), the wrapped ``.apply``
runs ``FP32OutputLinear`` instead, which:

* forward: calls upstream's own ``forward(ctx, *args)`` while a ``TorchFunctionMode`` makes its
  GEMM return the FP32 accumulator (``megapatch.numerics.fp32_gemm``) -- everything else upstream does
  (saved tensors, sequence-parallel all-gather, bias) is upstream's code;
* backward: casts ``grad_output`` to the input dtype, then calls upstream's own ``backward`` --
  the contract of Megatron-LM PR #6252 (BF16 dgrad, TP reduction, gradient-accumulation fusion,
  deferred wgrad unchanged).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from megapatch.core.scope import scoped
from megapatch.numerics import fp32_gemm
from megapatch.numerics.dtypes import LOW_PRECISION
from megapatch.core.errors import UpstreamSurfaceError

_requested: contextvars.ContextVar[Optional[torch.dtype]] = contextvars.ContextVar(
    "megapatch_linear_output_dtype", default=None)


@contextlib.contextmanager
def output_dtype(dtype: Optional[torch.dtype]):
    """Within this block, megatron-core linear Functions applied on this thread return ``dtype``."""
    with scoped(_requested, dtype):
        yield


def requested_output_dtype() -> Optional[torch.dtype]:
    """The output dtype an enclosing ``output_dtype`` block asks for on this thread (or None)."""
    return _requested.get()


class _FP32AccumulatorMode(TorchFunctionMode):
    """Turns the low-precision GEMM of one upstream forward into an FP32-output GEMM."""

    _GEMMS = (torch.matmul, torch.Tensor.matmul, torch.nn.functional.linear)

    def __init__(self):
        super().__init__()
        self.intercepted = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._GEMMS and len(args) >= 2 and kwargs.get("out") is None:
            a, b = args[0], args[1]
            if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.dim() == 2
                    and a.dtype in LOW_PRECISION and b.dtype == a.dtype):
                self.intercepted += 1
                if func is torch.nn.functional.linear:
                    out = fp32_gemm.linear_fp32(a, b)
                    bias = args[2] if len(args) > 2 else kwargs.get("bias")
                    return out if bias is None else out + bias
                return fp32_gemm.matmul_fp32(a, b)
        return func(*args, **kwargs)


class FP32OutputLinear(torch.autograd.Function):
    """Upstream linear Function ``upstream`` with an FP32 forward output (see module doc)."""

    @staticmethod
    def forward(ctx, upstream, input_, *rest):
        ctx.megapatch_upstream = upstream
        ctx.megapatch_input_dtype = input_.dtype
        with _FP32AccumulatorMode() as mode:
            output = upstream.forward(ctx, input_, *rest)
        if mode.intercepted != 1 or output.dtype != torch.float32:
            raise UpstreamSurfaceError(
                f"megapatch asked {upstream.__module__}.{upstream.__qualname__}.forward for an FP32 "
                f"output, but its GEMM was not recognised ({mode.intercepted} GEMM calls "
                f"intercepted, output {output.dtype}): the upstream forward changed")
        return output

    @staticmethod
    def backward(ctx, grad_output):
        grads = ctx.megapatch_upstream.backward(ctx, grad_output.to(ctx.megapatch_input_dtype))
        return (None, *grads)


def apply_wrapper(wrapped, instance, args, kwargs):
    """wrapt wrapper for ``<UpstreamLinearFunction>.apply``: FP32 output when requested."""
    dtype = _requested.get()
    if dtype is None or not args or args[0].dtype not in LOW_PRECISION:
        return wrapped(*args, **kwargs)
    if dtype != torch.float32 or kwargs:
        raise UpstreamSurfaceError(f"megapatch: unsupported linear output request {dtype}, {kwargs}")
    # wrapt passes the class as `instance` for a Python classmethod; torch >= 2.14 defines
    # Function.apply in C, where the bound method's __self__ is the class
    upstream = instance if isinstance(instance, type) else wrapped.__self__
    return FP32OutputLinear.apply(upstream, *args)
