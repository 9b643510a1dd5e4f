"""(stand-in) A CPU runtime for Transformer Engine 2.20's BF16/FP32 module path: the CUDA kernels
behind ``transformer_engine_torch`` (``tex``) that ``te.Linear``, ``te.LayerNormLinear`` and
``te.LayerNormMLP`` call, implemented with torch on CPU, inside :func:`te_cpu_runtime` only.

What it replaces (read in TE 2.20.2's ``module/linear.py``, ``module/layernorm_linear.py``,
``module/layernorm_mlp.py``, ``module/_common.py`` and ``cpp_extensions/gemm.py``, and the
contracts of ``csrc/extensions/gemm.cpp`` and ``normalization.cpp``):

* ``tex.generic_gemm`` (every GEMM of the three modules, through ``general_gemm``): cuBLAS's
  column-major ``D = op(A) op(B)`` as TE's Python wrapper uses it on row-major tensors, i.e.
  ``D = opB(B) @ opA(A)`` with ``opA(A) = A.T`` when ``transa`` and ``opB(B) = B.T`` when
  ``transb`` (layout ``"TN"``: fprop ``x @ W.T``; ``"NN"``: dgrad ``dy @ W``; ``"NT"``: wgrad
  ``dy.T @ x``), leading dimensions of ``A`` and ``B`` flattened and ``B``'s restored on the output
  unless ``transb``. Accumulated in FP32 and rounded once to ``out_dtype`` (default ``A``'s
  dtype); ``alpha`` scales the product; ``accumulate=True`` adds ``beta`` (default 1) times ``out``
  in FP32 before that one rounding; the epilogues: bias added to the FP32 accumulator (forward),
  GELU (tanh form) with its pre-activation returned rounded to the output dtype (``gelu=True``),
  the GELU derivative at ``gelu_in`` multiplied into the product (``gelu=True, grad=True``), and
  the bias gradient, the FP32 column sums of ``B`` rounded to the output dtype (``bias=`` with
  ``grad=True``). Returns ``[out, bias_grad, pre_gelu_out, extra_output]`` as the binding does.
  Operands of two dtypes (BF16 with FP32) are refused, as cuBLASLt refuses them outside FP8.
* ``tex.layernorm_fwd`` / ``tex.rmsnorm_fwd``: per row, FP32 statistics (mean and 1/sqrt(var +
  eps), or 1/sqrt(mean(x^2) + eps)), returned as FP32 ``mu`` / ``rsigma`` of shape ``(N,)`` (RMSNorm:
  ``mu`` is None), output rounded once to ``otype``, written into ``ln_out`` when given;
  ``zero_centered_gamma`` scales by ``1 + gamma``.
* ``tex.layernorm_bwd`` / ``tex.rmsnorm_bwd``: ``dx`` from the saved statistics in FP32, ``dgamma``
  (and ``dbeta``) summed over all rows in FP32, each rounded once to its tensor's dtype.
* Attention (``DotProductAttention`` on its unfused backend, which TE picks here: the runtime reports
  no cuDNN fused-attention backend, ``tex.get_fused_attn_backend``, and flash-attn is not installed):
  ``tex.scaled_softmax_forward/backward`` and ``tex.scaled_masked_softmax_forward/backward``
  (``scaled_masked_softmax.h``: the scaled scores, masked positions set to -10000, softmax in FP32
  rounded once; backward ``scale * y * (g - sum(g * y))`` in FP32). The GEMMs around them are torch's
  ``baddbmm``/``bmm``, as on a GPU.
* The activations LayerNormMLP looks up (``tex.gelu``/``dgelu`` (tanh GELU), ``relu``/``drelu``,
  ``silu``/``dsilu``, ``swiglu``/``dswiglu``, ``geglu``/``dgeglu``, ``reglu``/``dreglu``; gated ones
  apply the activation to the first half of the last dimension and multiply by the second, TE's
  convention): computed in FP32 from the input, rounded once to the input's dtype.

* ``tex.multi_tensor_scale`` / ``tex.multi_tensor_l2norm`` (through TE's ``multi_tensor_applier``,
  which megatron-core's gradient clipping and BF16 optimizer bind at import when TE is installed):
  the scale's product in FP32 written in the output's dtype; the norm in FP32 (torch's summation
  order, not the kernel's chunked one); a non-finite value sets the no-op flag.
* ``tex.multi_tensor_adam`` (TE's ``FusedAdam``, which Megatron-LM's optimizer uses when TE is
  installed): the AdamFunctor's elementwise FP32 arithmetic, AdamW and L2 modes, with FP32 master
  params or without (torch's CPU ops: no fused multiply-add as the CUDA kernel may use).

On the way, what is CUDA-only in those modules, replaced for the same scope: ``torch.cuda.is_available``
(TE's modules refuse to construct without CUDA), ``torch.cuda.current_device`` (allocation device:
the CPU), ``torch.compile`` (``torch._dynamo.config.disable``: compiled functions, such as
megatron-core's ``jit_fuser`` ones, run eagerly; compiling would query the CUDA device),
``torch.cuda.is_current_stream_capturing`` (never; and torch's optimizers' own graph-capture check,
which would ask CUDA for its stream; ``torch.accelerator.is_available`` says False, so that torch's
device-generic code, a DataLoader's pinned memory, stays on the CPU), the cuBLAS workspace
(``cpp_extensions.gemm.get_cublas_workspace``: an empty CPU buffer), and the ``inp.is_cuda`` check
of ``TransformerEngineBaseModule.prepare_forward``, answered True for that one input tensor during
that call; for one ``DotProductAttention.forward``, ``is_cuda`` True for its query, key and value and
tensors TE creates on ``device="cuda"`` made on the CPU; the device's compute capability (TE's
``utils._get_device_compute_capability``, and ``torch.cuda.get_device_capability`` for Megatron-LM's
argument checks: ``COMPUTE_CAPABILITY``, an A100-class device without FP8)
and ``tex.get_cudnn_version`` (``CUDNN_VERSION``), which the backend selection reads. Construct the
modules inside the scope with ``device="cpu"``.

What it cannot show: cuBLAS's own kernels (their accumulation order, split-K, the epilogues'
exact arithmetic; the CPU's FP32 sums run in MKL's order), TE's CUDA norm and activation kernels,
FP8 / MXFP8 / NVFP4 (quantized tensors and quantizers), Userbuffers and cuBLASMp comm+GEMM overlap,
CUDA graphs and streams. Every other ``tex`` function, and a quantizer, a quantized operand or a
comm-overlap argument given to an implemented one, raises :class:`NotOnCpuRuntime` naming it.
The operation fuser (``te.ops``) binds some kernels by name at import and is not covered.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import threading
from typing import Callable, Dict, Iterator, List, Optional

import torch

from megapatch.testing.stand_ins.cpu_compat import Replacements

__all__ = ["te_cpu_runtime", "NotOnCpuRuntime", "KERNELS", "runtime_active"]


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


# -- GEMM -----------------------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """TE's GELU: the tanh form (FP32 in, FP32 out)."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def _gelu_derivative(x: torch.Tensor) -> torch.Tensor:
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    t = torch.tanh(inner)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)


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


# -- norms ----------------------------------------------------------------------------------------

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


# -- activations ----------------------------------------------------------------------------------

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


# -- the optimizer's multi-tensor kernels (megatron-core's gradient clipping and FP16 copies bind
#    them from transformer_engine.pytorch.optimizers when TE is installed) -------------------------

def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``out[i] = in[i] * scale`` for ``tensor_lists = [inputs, outputs]``, the product in FP32
    (TE's kernel computes in float) written in the output's dtype; a non-finite input sets
    ``noop_flag`` to 1."""
    inputs, outputs = tensor_lists[0], tensor_lists[1]
    for source, target in zip(inputs, outputs):
        product = source.float() * scale
        if not torch.isfinite(source).all():
            noop_flag.fill_(1)
        target.copy_(product.to(target.dtype))


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """``(total, per_tensor_norms)``: the FP32 L2 norm of all of ``tensor_lists[0]`` together (a
    one-element FP32 tensor) and, with ``per_tensor``, each tensor's; summed in torch's order (the
    CUDA kernel's is per chunk, then across chunks: the figures may differ in the last bits)."""
    tensors = tensor_lists[0]
    norms = torch.stack([t.float().norm() for t in tensors]) if tensors else torch.zeros(0)
    if tensors and not torch.isfinite(norms).all():
        noop_flag.fill_(1)
    total = norms.norm().reshape(1) if tensors else torch.zeros(1)
    return total, (norms if per_tensor else torch.zeros(0))


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode,
                      bias_correction, weight_decay):
    """TE's ``FusedAdam`` step (``multi_tensor_adam.cu``'s ``AdamFunctor``) on ``tensor_lists = [grads,
    params, exp_avgs, exp_avg_sqs]`` (with a fifth, FP32 master params: the update runs on them and
    the params get it rounded): in FP32, ``mode`` 1 AdamW (decoupled weight decay added to the update),
    0 Adam with L2 (decay added to the gradient); the bias corrections ``1 - beta^step`` as the host
    computes them. Each tensor is updated in place."""
    grads, params, exp_avgs, exp_avg_sqs = tensor_lists[:4]
    masters = tensor_lists[4] if len(tensor_lists) > 4 else params
    c1 = float(1 - beta1 ** step) if bias_correction else 1.0
    c2 = float(1 - beta2 ** step) if bias_correction else 1.0
    f32 = functools.partial(torch.tensor, dtype=torch.float32)
    lr_, b1, b2, eps_, decay, c1_, c2_ = (f32(v) for v in (lr, beta1, beta2, eps, weight_decay, c1, c2))
    for g, p, m, v, master in zip(grads, params, exp_avgs, exp_avg_sqs, masters):
        r_g, r_p, r_m, r_v = g.float(), master.float(), m.float(), v.float()
        if not torch.isfinite(r_g).all():
            noop_flag.fill_(1)
        if mode == 0:
            r_g = r_g + decay * r_p
        r_m = b1 * r_m + (1 - b1) * r_g
        r_v = b2 * r_v + (1 - b2) * r_g * r_g
        update = (r_m / c1_) / (torch.sqrt(r_v / c2_) + eps_)
        if mode != 0:
            update = update + decay * r_p
        r_p = r_p - lr_ * update
        m.copy_(r_m.to(m.dtype))
        v.copy_(r_v.to(v.dtype))
        master.copy_(r_p.to(master.dtype))
        if master is not p:
            p.copy_(r_p.to(p.dtype))


#: every tex function the runtime implements, by name
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


KERNELS: Dict[str, Callable] = {
    "get_cudnn_version": get_cudnn_version,
    "get_fused_attn_backend": get_fused_attn_backend,
    "scaled_softmax_forward": scaled_softmax_forward,
    "scaled_softmax_backward": scaled_softmax_backward,
    "scaled_masked_softmax_forward": scaled_masked_softmax_forward,
    "scaled_masked_softmax_backward": scaled_masked_softmax_backward,
    "multi_tensor_adam": multi_tensor_adam,
    "multi_tensor_scale": multi_tensor_scale,
    "multi_tensor_l2norm": multi_tensor_l2norm,
    "generic_gemm": generic_gemm,
    "te_general_grouped_gemm": te_general_grouped_gemm,
    "layernorm_fwd": layernorm_fwd,
    "layernorm_bwd": layernorm_bwd,
    "rmsnorm_fwd": rmsnorm_fwd,
    "rmsnorm_bwd": rmsnorm_bwd,
    **{name: _activation(name) for name in _ACTIVATIONS},
    **{f"d{name}": _activation_backward(name) for name in _ACTIVATIONS},
    **{name: _gated(name) for name in _GATED},
    **{f"d{name}": _gated_backward(name) for name in _GATED},
}


# -- installation ---------------------------------------------------------------------------------

def _gemm_call(args, kwargs) -> str:
    """``generic_gemm TN``, with `` bias``, `` gelu``, `` grad``, `` accumulate`` as set."""
    names = ("A", "transa", "B", "transb", "D", "quantizer", "output_dtype", "bias", "bias_type",
             "gelu", "gelu_in", "grad", "workspace", "workspace_size", "accumulate")
    bound = dict(zip(names, args), **kwargs)
    flags = [flag for flag in ("bias", "gelu", "grad", "accumulate")
             if bound.get(flag) is not None and bound.get(flag) is not False]
    layout = ("T" if bound["transa"] else "N") + ("T" if bound["transb"] else "N")
    return " ".join(["generic_gemm", layout, *flags])


def _recorded(name: str, kernel: Callable, calls: List[str]) -> Callable:
    @functools.wraps(kernel)
    def call(*args, **kwargs):
        calls.append(_gemm_call(args, kwargs) if name == "generic_gemm" else name)
        return kernel(*args, **kwargs)

    return call


def _refusing(name: str) -> Callable:
    def refuse(*args, **kwargs):
        raise _refuse(f"transformer_engine_torch.{name} (CUDA only)")

    refuse.__name__ = name
    return refuse


def _cpu_workspace(device=None, ub=False, grouped_gemm=False):
    if ub:
        raise _refuse("the Userbuffers cuBLAS workspace")
    if grouped_gemm:  # one per cuBLAS stream: the runtime has one
        return [torch.empty(0, dtype=torch.uint8)]
    return torch.empty(0, dtype=torch.uint8)


#: the streaming multiprocessors the runtime reports (``utils.get_sm_count``: the grouped GEMM's
#: ``math_sm_count``, which the runtime ignores)
SM_COUNT = 1


def _cpu_empty_tensor() -> torch.Tensor:
    return torch.Tensor()


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


class _InputCudaCheck(torch.overrides.TorchFunctionMode):
    """Answers ``is_cuda`` True for one tensor (the input of ``prepare_forward``)."""

    def __init__(self, tensor: torch.Tensor):
        super().__init__()
        self.tensor = tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (getattr(func, "__self__", None) is torch._C.TensorBase.__dict__["is_cuda"]
                and args and args[0] is self.tensor):
            return True
        return func(*args, **(kwargs or {}))


class _AttentionOnCpu(torch.overrides.TorchFunctionMode):
    """For one ``DotProductAttention.forward``: ``is_cuda`` True for its query, key and value (TE
    asserts it), and tensors TE creates on ``device="cuda"`` (masks, sequence lengths) or moves with
    ``.cuda()`` made on the CPU."""

    def __init__(self, tensors):
        super().__init__()
        self.tensors = tensors

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch._C.TensorBase.__dict__["is_cuda"]:
            if args and any(args[0] is t for t in self.tensors):
                return True
        elif func is torch.Tensor.cuda:
            return args[0]
        elif kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _attention_on_cpu(original):
    @functools.wraps(original)
    def forward(self, query_layer, key_layer, value_layer, *args, **kwargs):
        with _AttentionOnCpu((query_layer, key_layer, value_layer)):
            return original(self, query_layer, key_layer, value_layer, *args, **kwargs)

    return forward


def _prepare_forward_on_cpu(original):
    @functools.wraps(original)
    def prepare_forward(self, inp, *args, **kwargs):
        if isinstance(inp, torch.Tensor) and inp.device.type == "cpu":
            with _InputCudaCheck(inp):
                return original(self, inp, *args, **kwargs)
        return original(self, inp, *args, **kwargs)

    return prepare_forward


_HOLDERS = ("transformer_engine.", "megatron.core.optimizer.")


class _Runtime:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0
        self.replacements = Replacements()
        self.calls: List[str] = []

    def _apply(self) -> None:
        import transformer_engine.pytorch  # noqa: F401  (loads transformer_engine_torch)
        import transformer_engine_torch as tex
        from transformer_engine.pytorch import jit
        from transformer_engine.pytorch import utils as te_utils
        from transformer_engine.pytorch.cpp_extensions import gemm
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

        put = self.replacements.replace
        stand_ins = {}
        for name in dir(tex):
            value = getattr(tex, name)
            if name.startswith("_") or isinstance(value, type) or not callable(value):
                continue
            stand_ins[id(value)] = (_recorded(name, KERNELS[name], self.calls) if name in KERNELS
                                    else _refusing(name))
        stand_ins[id(gemm.get_cublas_workspace)] = _cpu_workspace
        stand_ins[id(te_utils._empty_tensor)] = _cpu_empty_tensor
        stand_ins[id(te_utils.get_sm_count)] = lambda: SM_COUNT
        stand_ins[id(jit.bias_gelu_fused)] = bias_gelu_fused
        stand_ins[id(jit.bgrad_dgelu_fused)] = bgrad_dgelu_fused
        # in tex itself, and every name TE bound from it or from these modules (``cpp_extensions``
        # star-imports tex; the layer modules import the jit functions and _empty_tensor by name;
        # megatron-core's optimizer binds TE's multi-tensor kernels at import)
        holders = [module for name, module in list(sys.modules.items())
                   if module is not None and (name == tex.__name__ or name.startswith(_HOLDERS))]
        for module in holders:
            for name, value in list(vars(module).items()):
                if id(value) in stand_ins and callable(value) and not isinstance(value, type):
                    put(module, name, lambda _o, s=stand_ins[id(value)]: s)
        put(TransformerEngineBaseModule, "prepare_forward", _prepare_forward_on_cpu)
        from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import (
            DotProductAttention)

        put(DotProductAttention, "forward", _attention_on_cpu)
        # TE asks the device's compute capability through this cached helper (every caller)
        put(te_utils, "_get_device_compute_capability", lambda _o: lambda device=None: COMPUTE_CAPABILITY)
        cpu = torch.device("cpu")
        put(torch.cuda, "is_available", lambda _o: lambda: True)
        put(torch.cuda, "current_device", lambda _o: lambda: cpu)
        # the same device to Megatron-LM (validate_args: --moe-grouped-gemm needs compute capability >= 8)
        put(torch.cuda, "get_device_capability", lambda _o: lambda device=None: COMPUTE_CAPABILITY)
        put(torch.cuda, "is_current_stream_capturing", lambda _o: lambda: False)
        # torch.compile (megatron-core's jit_fuser: the router's top-k, ...) asks the CUDA device it is
        # now told exists for its generator and properties: compiled functions run eagerly instead
        import torch._dynamo.config as dynamo_config

        put(dynamo_config, "disable", lambda _o: True)
        if hasattr(torch, "accelerator"):
            # only TE is told CUDA is there: torch's device-generic API (a DataLoader's pinned-memory
            # thread, ...) stays on the CPU
            put(torch.accelerator, "is_available", lambda _o: lambda: False)
        if hasattr(torch.optim.Optimizer, "_accelerator_graph_capture_health_check"):
            # torch's optimizers ask the CUDA stream whether it is capturing once CUDA is said to be
            # available: nothing captures here
            put(torch.optim.Optimizer, "_accelerator_graph_capture_health_check", lambda _o: lambda self: None)

    def acquire(self) -> None:
        with self.lock:
            if self.depth == 0:
                try:
                    self._apply()
                except BaseException:
                    self.replacements.restore()
                    raise
            self.depth += 1

    def release(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self.replacements.restore()


_RUNTIME = _Runtime()


def runtime_active() -> bool:
    return _RUNTIME.depth > 0


@contextlib.contextmanager
def te_cpu_runtime() -> Iterator[List[str]]:
    """Transformer Engine's BF16/FP32 kernels on CPU for the block; yields the list of ``tex``
    kernels called, appended as they run (GEMMs as ``generic_gemm <layout> [bias] [gelu] [grad]
    [accumulate]``). Re-entrant; everything replaced is restored when
    the outermost block exits, also on error."""
    _RUNTIME.acquire()
    try:
        yield _RUNTIME.calls
    finally:
        _RUNTIME.release()
