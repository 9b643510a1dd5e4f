"""(stand-in, for ``te_runtime``) Transformer Engine's attention
on CPU: the softmax kernels of ``DotProductAttention``'s unfused backend
(``tex.scaled_softmax_*``, ``tex.scaled_masked_softmax_*``), and what the runtime answers TE's
backend selection (no cuDNN fused attention; the device's compute capability, the cuDNN version)."""

from __future__ import annotations

import torch


# -- attention: the unfused backend's softmax ------------------------------------------------------

def scaled_softmax_forward(input, scale):
    """``softmax(input * scale)`` over the last dim ([b, heads, sq, sk]) in FP32, rounded once to the
    input's dtype (``scaled_masked_softmax.h``: FP32 accumulation in the warp)."""
    return torch.softmax(input.float() * scale, dim=-1).to(input.dtype)


def scaled_masked_softmax_forward(input, mask, scale):
    """As :func:`scaled_softmax_forward`, the masked positions (``mask`` true, [b or 1, 1, sq, sk])
    set to -10000 after scaling, as the kernel sets them (a fully masked row comes out uniform)."""
    x = (input.float() * scale).masked_fill(mask.bool(), -10000.0)
    return torch.softmax(x, dim=-1).to(input.dtype)


def scaled_softmax_backward(output_grads, softmax_results, scale):
    """``scale * y * (g - sum(g * y))`` over the last dim in FP32 (the kernel's ``acc_t``), rounded
    once to the gradient's dtype."""
    y, g = softmax_results.float(), output_grads.float()
    gy = g * y
    return (scale * (gy - y * gy.sum(dim=-1, keepdim=True))).to(output_grads.dtype)


scaled_masked_softmax_backward = scaled_softmax_backward  # the same kernel arithmetic: y is 0 where masked


# -- attention backend selection ------------------------------------------------------------------

#: what the runtime answers when TE asks for the device's compute capability (attention backend
#: selection, FP8 support checks): an A100-class device, without FP8 (which the runtime refuses)
COMPUTE_CAPABILITY = (8, 0)
#: the cuDNN version reported to TE's attention backend selection: no cuDNN kernel runs here
CUDNN_VERSION = 90000


def get_cudnn_version() -> int:
    return CUDNN_VERSION


def get_fused_attn_backend(*args, **kwargs):
    """No cuDNN fused-attention backend: TE's ``DotProductAttention`` then takes its unfused backend
    (``UnfusedDotProductAttention``: torch ``baddbmm``/``bmm`` and softmax), which runs on CPU."""
    import transformer_engine_torch as tex

    return tex.NVTE_Fused_Attn_Backend.NVTE_No_Backend, "megapatch's TE CPU runtime has no fused attention"
