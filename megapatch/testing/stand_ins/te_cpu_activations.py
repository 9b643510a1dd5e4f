"""(stand-in, for ``te_runtime``) Transformer Engine's activation kernels on CPU: TE's GELU (the tanh
form) and its derivative, the ``tex`` activations LayerNormMLP looks up (``gelu``/``dgelu``,
``relu``/``drelu``, ``silu``/``dsilu`` and the gated ``geglu``, ``reglu``, ``swiglu`` with their
backward), and the fused GELU functions of ``transformer_engine.pytorch.jit`` (``bias_gelu_fused``,
``bgrad_dgelu_fused``): computed in FP32, rounded once."""

from __future__ import annotations

import math
from typing import Callable, Dict

import torch

from megapatch.testing.stand_ins.te_cpu_refusals import _no_quantizer, _plain

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """TE's GELU: the tanh form (FP32 in, FP32 out)."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def _gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    t = torch.tanh(inner)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)


def _relu_derivative(x):
    return (x > 0).to(x.dtype)


def _silu(x):
    return x * torch.sigmoid(x)


def _silu_derivative(x):
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


# name -> (f, f') on FP32 tensors
_ACTIVATIONS: Dict[str, tuple] = {
    "gelu": (_gelu, _gelu_derivative),
    "relu": (torch.relu, _relu_derivative),
    "silu": (_silu, _silu_derivative),
}
_GATED = {"geglu": "gelu", "reglu": "relu", "swiglu": "silu"}


def _activation(name: str) -> Callable:
    f, _ = _ACTIVATIONS[name]

    def forward(input, quantizer):
        _no_quantizer(quantizer, name)
        return f(_plain(input, "input", name).float()).to(input.dtype)

    forward.__name__ = name
    return forward


def _activation_backward(name: str) -> Callable:
    _, df = _ACTIVATIONS[name]

    def backward(grad, fwd_input, quantizer):
        _no_quantizer(quantizer, f"d{name}")
        x = _plain(fwd_input, "fwd_input", f"d{name}").float()
        return (grad.float() * df(x)).to(grad.dtype)

    backward.__name__ = f"d{name}"
    return backward


def _gated(name: str) -> Callable:
    f, _ = _ACTIVATIONS[_GATED[name]]

    def forward(input, quantizer):
        _no_quantizer(quantizer, name)
        act, gate = _plain(input, "input", name).float().chunk(2, dim=-1)
        return (f(act) * gate).to(input.dtype)

    forward.__name__ = name
    return forward


def _gated_backward(name: str) -> Callable:
    f, df = _ACTIVATIONS[_GATED[name]]

    def backward(grad, fwd_input, quantizer):
        _no_quantizer(quantizer, f"d{name}")
        act, gate = _plain(fwd_input, "fwd_input", f"d{name}").float().chunk(2, dim=-1)
        g = grad.float()
        return torch.cat([g * gate * df(act), g * f(act)], dim=-1).to(grad.dtype)

    backward.__name__ = f"d{name}"
    return backward


def bias_gelu_fused(inp, bias):
    """``jit.bias_gelu_fused`` (torch.compile'd on GPU: one kernel, FP32 inside): GELU of
    ``inp + bias`` in FP32, rounded once to ``inp``'s dtype."""
    x = inp.float() if bias is None or bias.numel() == 0 else inp.float() + bias.float()
    return _gelu(x).to(inp.dtype)


def bgrad_dgelu_fused(grad_output, inp, bias):
    """``jit.bgrad_dgelu_fused``: the GELU derivative at ``inp + bias`` times ``grad_output`` in
    FP32, rounded once; the bias gradient its FP32 column sum (None without a bias)."""
    has_bias = bias is not None and bias.numel() != 0
    x = inp.float() + bias.float() if has_bias else inp.float()
    dgelu = grad_output.float() * _gelu_derivative(x)
    bgrad = dgelu.sum(dim=0).to(grad_output.dtype) if has_bias else None
    return bgrad, dgelu.to(grad_output.dtype)
