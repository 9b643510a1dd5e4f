"""(stand-in, for ``te_runtime``) Transformer Engine's GEMMs on CPU:
``tex.generic_gemm`` (cuBLAS's column-major ``D = op(A) op(B)`` on row-major tensors, accumulated
in FP32 and rounded once, with its bias, GELU, dGELU and bias-gradient epilogues) and
``tex.te_general_grouped_gemm`` (``GroupedLinear``'s GEMMs)."""

from __future__ import annotations

import math
from typing import List

import torch

from megapatch.testing.stand_ins.te_cpu_activations import _gelu, _gelu_derivative
from megapatch.testing.stand_ins.te_cpu_refusals import _no_quantizer, _plain, _refuse, _torch_dtype


def gemm_output_shape(a_shape, transa: bool, b_shape, transb: bool) -> List[int]:
    """The binding's output shape: 2-D views of A and B (leading dimensions flattened); B's leading
    dimensions restored on the output unless ``transb``."""
    a0, a1 = math.prod(a_shape[:-1]), a_shape[-1]
    b0, b1 = math.prod(b_shape[:-1]), b_shape[-1]
    if (a1 if transa else a0) != (b0 if transb else b1):
        raise ValueError(f"Invalid matrix dimensions for GEMM (A=({a0},{a1}), transa={transa}, "
                         f"B=({b0},{b1}), transb={transb})")
    rows = [b1] if transb else list(b_shape[:-1])
    return rows + [a0 if transa else a1]


def generic_gemm(A, transa, B, transb, D, quantizer, output_dtype, bias, bias_type, gelu, gelu_in,
                 grad, workspace, workspace_size, accumulate, use_split_accumulator,
                 comm_overlap=None, comm_type=None, extra_output=None, bulk_overlap=False,
                 alpha=1.0, beta=None):
    kernel = "generic_gemm"
    if comm_overlap is not None or comm_type is not None or bulk_overlap:
        raise _refuse("comm+GEMM overlap (Userbuffers / cuBLASMp: comm_overlap, comm_type, bulk_overlap)")
    if extra_output is not None:
        raise _refuse("a GEMM extra_output (the reduce-scatter buffer of comm+GEMM overlap)")
    _no_quantizer(quantizer, kernel)
    A, B = _plain(A, "A", kernel), _plain(B, "B", kernel)
    if A.dtype != B.dtype:  # cuBLASLt takes mixed operand types for FP8 only
        raise ValueError(f"generic_gemm with operands of two dtypes (A {A.dtype}, B {B.dtype}): cuBLAS runs "
                         f"no such GEMM")
    if beta is None:
        beta = 1.0 if accumulate else 0.0
    elif not accumulate and beta != 0.0:
        raise ValueError("Trying to use non-zero beta while not accumulating into D tensor.")
    shape = gemm_output_shape(tuple(A.shape), transa, tuple(B.shape), transb)
    out_dtype = _torch_dtype(output_dtype)
    if D is not None:
        _plain(D, "output", kernel)
        if list(D.shape) != shape:
            raise ValueError(f"GEMM output has invalid dims (expected {shape}, got {list(D.shape)})")
        if out_dtype is not None and out_dtype != D.dtype:
            raise ValueError(f"GEMM output has invalid dtype (expected {out_dtype}, found {D.dtype})")
        if not D.is_contiguous():
            raise ValueError("Output tensor is not contiguous.")
        out_dtype = D.dtype
    elif out_dtype is None:
        out_dtype = A.dtype
    a2 = A.reshape(-1, A.shape[-1]).float()
    b2 = B.reshape(-1, B.shape[-1]).float()
    acc = torch.mm(b2.t() if transb else b2, a2.t() if transa else a2)  # FP32 accumulation
    if alpha != 1.0:
        acc = acc * alpha
    bias_grad = pre_gelu_out = None
    if grad:
        if gelu:
            if bias is not None:
                raise _refuse("a GEMM with both the dGELU and the bias-gradient epilogue")
            if gelu_in is None:
                raise ValueError("generic_gemm(gelu=True, grad=True) needs gelu_in")
            acc = acc * _gelu_derivative(_plain(gelu_in, "gelu_in", kernel).reshape(acc.shape).float())
        if bias is not None:
            bias_grad = B.reshape(-1, B.shape[-1]).float().sum(dim=0).to(out_dtype)
    else:
        if bias is not None:
            acc = acc + _plain(bias, "bias", kernel).float()
        if gelu:
            pre_gelu_out = acc.to(out_dtype).view(shape)
            acc = _gelu(acc)
    if accumulate and beta != 0.0:
        acc = acc + beta * D.reshape(acc.shape).float()
    if D is None:
        D = acc.to(out_dtype).view(shape)
    else:
        D.copy_(acc.view(shape))
    return [D, bias_grad, pre_gelu_out, extra_output]


def te_general_grouped_gemm(A, transa, B, transb, D, D_type, m_splits, bias, bias_type, single_output,
                            pre_gelu_out, grad, workspace, workspace_size, accumulate, use_split_accumulator,
                            math_sm_count=0):
    """``GroupedLinear``'s GEMMs (``general_grouped_gemm``): GEMM ``i`` is :func:`generic_gemm` of
    ``A[i]`` and ``B[i]`` into ``D[i]`` (``single_output``: ``D[0]`` cut into ``m_splits`` rows), with
    its bias (forward) or bias gradient (``grad``: written into ``bias[i]``) where ``bias[i]`` is not
    empty; a GEMM with an empty operand (an expert that received no token) zeroes its output unless
    it accumulates, as the binding does. Returns ``bias``."""
    kernel = "te_general_grouped_gemm"
    if any(t.numel() for t in pre_gelu_out):
        raise _refuse(f"{kernel} with a GELU epilogue")
    outs = D
    if single_output:
        outs = list(D[0].split(list(m_splits), dim=0)) if len(A) > 1 else [D[0]]
    for i in range(len(A)):
        with_bias = bias[i].numel() > 0
        if A[i].numel() == 0 or B[i].numel() == 0:
            if outs[i].numel() and not accumulate:
                outs[i].zero_()
            if grad and with_bias:
                bias[i].zero_()
            continue
        _, bias_grad, _, _ = generic_gemm(A[i], transa, B[i], transb, outs[i], None, D_type,
                                          bias[i] if with_bias else None, bias_type, False, None, grad,
                                          None, 0, accumulate, use_split_accumulator)
        if grad and with_bias:
            bias[i].copy_(bias_grad)
    return bias
