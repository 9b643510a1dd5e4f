"""(stand-in, for ``te_runtime``) What Transformer Engine's CPU
runtime refuses: :class:`NotOnCpuRuntime` (a ``tex`` kernel, or a kernel argument, it does not
implement), and the checks every kernel makes of its operands (high-precision dtypes only, no
quantized tensor, no quantizer)."""

from __future__ import annotations

from typing import Optional

import torch


class NotOnCpuRuntime(NotImplementedError):
    """A Transformer Engine kernel, or a kernel argument, that the CPU runtime does not implement."""


def _refuse(what: str) -> NotOnCpuRuntime:
    return NotOnCpuRuntime(
        f"megapatch's CPU runtime for Transformer Engine (a test stand-in for the BF16/FP32 path of "
        f"te.Linear, te.LayerNormLinear, te.LayerNormMLP and DotProductAttention's unfused backend) does not "
        f"implement {what}")



# -- dtypes ---------------------------------------------------------------------------------------

def _torch_dtype(te_dtype) -> Optional[torch.dtype]:
    if te_dtype is None or isinstance(te_dtype, torch.dtype):
        return te_dtype
    from transformer_engine.pytorch.constants import TE_DType_To_Torch

    dtype = TE_DType_To_Torch.get(te_dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise _refuse(f"output dtype {te_dtype} (FP8 outputs)")
    return dtype


def _plain(tensor, role: str, kernel: str) -> torch.Tensor:
    """A plain torch tensor in a high-precision dtype, else refused (quantized operands)."""
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise _refuse(f"{kernel} with a {type(tensor).__name__} {role} (FP8/MXFP8/NVFP4 operands)")
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise _refuse(f"{kernel} with a {tensor.dtype} {role}")
    return tensor


def _no_quantizer(quantizer, kernel: str) -> None:
    if quantizer is not None:
        raise _refuse(f"{kernel} with the output quantizer {type(quantizer).__name__} (FP8/MXFP8/NVFP4)")
