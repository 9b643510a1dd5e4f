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
comm-overlap argument given to an implemented one, raises
:class:`~megapatch.testing.stand_ins.te_cpu_refusals.NotOnCpuRuntime` naming it.
The operation fuser (``te.ops``) binds some kernels by name at import and is not covered.

The kernels live beside this module, one module per kind: ``te_cpu_gemm``, ``te_cpu_norms``,
``te_cpu_activations``, ``te_cpu_attention`` (with the backend selection's answers) and
``te_cpu_optimizer``; ``te_cpu_kernels.KERNELS`` names them by ``tex`` function, and
``te_cpu_refusals`` holds what they refuse. This module installs them, and the CPU answers to TE's
CUDA-only calls, for the scope of :func:`te_cpu_runtime`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Callable, Iterator, List

import torch

from megapatch.testing.stand_ins.replacements import Replacements
from megapatch.testing.stand_ins.te_cpu_activations import bgrad_dgelu_fused, bias_gelu_fused
from megapatch.testing.stand_ins.te_cpu_attention import COMPUTE_CAPABILITY
from megapatch.testing.stand_ins.te_cpu_kernels import KERNELS
from megapatch.testing.stand_ins.te_cpu_refusals import _refuse

__all__ = ["te_cpu_runtime", "runtime_active"]


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
