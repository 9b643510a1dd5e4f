"""GEMMs of BF16/FP16 operands whose FP32 accumulator is returned instead of being rounded.

The backend is probed, never assumed:

* ``te-general-gemm``: Transformer Engine's ``general_gemm(..., out_dtype=torch.float32)`` on CUDA
  (``workspace`` is passed only where the installed signature still has it: TE <= 2.9);
* ``torch-mm-out-dtype``: ``torch.mm(a, b, out_dtype=torch.float32)`` on CUDA where torch has it;
* ``upcast``: FP32 copies of the operands (CPU, where neither exists). BF16/FP16 products are exact
  in FP32, so this computes the same FP32-accumulated sum, only slower.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch



@functools.lru_cache(maxsize=None)
def _te_general_gemm():
    try:
        from transformer_engine.pytorch.cpp_extensions import general_gemm
    except Exception:  # TE absent or unusable (TE raises more than ImportError without CUDA)
        return None
    params = inspect.signature(general_gemm).parameters
    required = {"A", "B", "out_dtype", "layout"}
    if not required <= set(params):
        return None
    if "workspace" in params:
        from transformer_engine.pytorch.module.base import get_workspace

        return functools.partial(_gemm_with_workspace, general_gemm, get_workspace)
    return general_gemm


def _gemm_with_workspace(general_gemm, get_workspace, A, B, **kwargs):
    return general_gemm(A, B, get_workspace(), **kwargs)


@functools.lru_cache(maxsize=None)
def _torch_mm_out_dtype(device_type: str) -> bool:
    if device_type != "cuda":
        return False
    try:
        probe = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
        return torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def backend(device_type: Optional[str] = None) -> str:
    """Name of the backend used for tensors on ``device_type`` (default: cuda if present)."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda" and _te_general_gemm() is not None:
        return "te-general-gemm"
    if _torch_mm_out_dtype(device_type):
        return "torch-mm-out-dtype"
    return "upcast"


def linear_fp32(input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``input_ @ weight.T`` in FP32 from low-precision operands (any leading dims)."""
    name = backend(input_.device.type)
    input_2d = input_.reshape(-1, input_.shape[-1])
    if name == "te-general-gemm":
        out = _te_general_gemm()(weight.contiguous(), input_2d.contiguous(),
                                 out_dtype=torch.float32, layout="TN")[0]
    elif name == "torch-mm-out-dtype":
        out = torch.mm(input_2d, weight.t(), out_dtype=torch.float32)
    else:
        out = torch.mm(input_2d.to(torch.float32), weight.t().to(torch.float32))
    # not a view: callers (megatron's cross entropy) modify FP32 logits in place, which autograd
    # refuses for a view created inside a custom Function
    return torch.ops.aten._unsafe_view(out, (*input_.shape[:-1], weight.shape[0]))


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in FP32 where ``b`` is a 2-D (possibly transposed) weight."""
    return linear_fp32(a, b.t())
