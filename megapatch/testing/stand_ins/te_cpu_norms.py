"""(stand-in, for ``te_runtime``) Transformer Engine's norm kernels
on CPU: ``tex.layernorm_fwd``/``rmsnorm_fwd`` (FP32 statistics, the output rounded once) and
``tex.layernorm_bwd``/``rmsnorm_bwd`` (FP32 from the saved statistics)."""

from __future__ import annotations

import torch

from megapatch.testing.stand_ins.te_cpu_refusals import _no_quantizer, _plain, _torch_dtype


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    gamma = weight.float()
    return gamma + 1.0 if zero_centered_gamma else gamma


def _norm_out(y: torch.Tensor, ln_out, quantizer, otype, kernel: str) -> torch.Tensor:
    _no_quantizer(quantizer, kernel)
    if ln_out is None:
        return y.to(_torch_dtype(otype))
    _plain(ln_out, "ln_out", kernel).view(y.shape).copy_(y)
    return ln_out


def _rows(x: torch.Tensor, kernel: str) -> torch.Tensor:
    x = _plain(x, "input", kernel)
    if x.dim() != 2:
        raise ValueError(f"{kernel} expects a 2-D input (tokens, hidden), got {tuple(x.shape)}")
    return x


def layernorm_fwd(input, weight, bias, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
    x = _rows(input, "layernorm_fwd").float()
    mu = x.mean(dim=1)
    centered = x - mu[:, None]
    rsigma = torch.rsqrt((centered * centered).mean(dim=1) + eps)
    y = centered * rsigma[:, None] * _gamma(_plain(weight, "weight", "layernorm_fwd"), zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    return [_norm_out(y, ln_out, quantizer, otype, "layernorm_fwd"), mu, rsigma]


def rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
    x = _rows(input, "rmsnorm_fwd").float()
    rsigma = torch.rsqrt((x * x).mean(dim=1) + eps)
    y = x * rsigma[:, None] * _gamma(_plain(weight, "weight", "rmsnorm_fwd"), zero_centered_gamma)
    return [_norm_out(y, ln_out, quantizer, otype, "rmsnorm_fwd"), None, rsigma]


def layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
    dz32, x32 = dz.float().reshape(x.shape), x.float()
    x_hat = (x32 - mu.float()[:, None]) * rsigma.float()[:, None]
    dy = dz32 * _gamma(gamma, zero_centered_gamma)
    dx = rsigma.float()[:, None] * (dy - dy.mean(dim=1, keepdim=True)
                                     - x_hat * (dy * x_hat).mean(dim=1, keepdim=True))
    return [dx.to(x.dtype), (dz32 * x_hat).sum(dim=0).to(gamma.dtype), dz32.sum(dim=0).to(gamma.dtype)]


def rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma):
    dz32, x32 = dz.float().reshape(x.shape), x.float()
    x_hat = x32 * rsigma.float()[:, None]
    dy = dz32 * _gamma(gamma, zero_centered_gamma)
    dx = rsigma.float()[:, None] * (dy - x_hat * (dy * x_hat).mean(dim=1, keepdim=True))
    return [dx.to(x.dtype), (dz32 * x_hat).sum(dim=0).to(gamma.dtype)]
