"""What the ``logits`` family's LM-head records share. FP32 LM-head logits: the output layer keeps its GEMM accumulator in FP32 (Megatron-LM PR #6252).

``GPTModel.forward`` (and ``MambaModel.forward`` where the installed version has it) marks its own
``output_layer`` for the duration of the call, and so does
``LanguageModule.compute_mtp_single_step`` (megatron-core >= 0.18: the dynamic engine's MTP /
speculative draft logits); that layer's ``ColumnParallelLinear.forward`` then runs upstream's
linear autograd Function with an FP32 output (``megapatch.numerics.fp32_output_linear``): TE
``general_gemm(..., out_dtype=torch.float32)`` where TE and CUDA are there, ``torch.mm(...,
out_dtype=torch.float32)`` on CUDA, FP32 copies of the BF16 operands on CPU. The backward is
upstream's, after ``grad_output`` is cast to the input dtype -- the PR's contract.

Where the installed megatron-core already has the PR (``ColumnParallelLinear.output_dtype``,
Megatron-LM main), megapatch still computes the FP32 logits itself, with the same GEMM backend
(TE ``general_gemm`` on CUDA where TE is there): upstream's ``_linear_forward`` returns its FP32
output as a reshaped view created inside the autograd Function, which megatron's own
vocab-parallel cross entropy modifies in place and autograd refuses; and without TE (CPU,
``--transformer-impl local``) upstream raises. The layer's ``output_dtype`` is held at None for
the call. The first FP32 call logs which path ran (logger ``"megapatch"``, rank 0). A layer built
with another ``output_dtype`` (``GPTModel(logit_dtype=torch.bfloat16)``: Megatron-Bridge's
``logit_dtype``, Megatron-LM's ``--output-logit-dtype bf16``) is refused at construction and at
forward, naming both settings: megapatch never overrides it silently.

Every other ColumnParallelLinear (QKV, fc1, MoE, user layers) is untouched: only the instance that
the running model calls ``output_layer`` is marked.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from megapatch.numerics import fp32_gemm, fp32_output_linear
from megapatch.core import report, state
from megapatch.core.errors import UnsupportedConfigurationError, UpstreamSurfaceError
from megapatch.core.registry import Patch, Target
from megapatch.core.scope import scoped
from megapatch.patches._common import MEGATRON_CORE_TESTED, when
GPT = "megatron.core.models.gpt.gpt_model"
MAMBA = "megatron.core.models.mamba.mamba_model"
LANGUAGE_MODULE = "megatron.core.models.common.language_module.language_module"

_lm_head = contextvars.ContextVar("megapatch_lm_head", default=None)


def _native_output_dtype(layer) -> bool:
    """Whether this megatron-core has PR #6252's ``ColumnParallelLinear.output_dtype``."""
    return hasattr(layer, "output_dtype")


def _device_type(layer) -> str:
    weight = getattr(layer, "weight", None)  # None when the output weight is passed per call (tied)
    if isinstance(weight, torch.Tensor):
        return weight.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=None)
def _path(device_type: str, native_output_dtype: bool) -> str:
    """Which mechanism computes the FP32 logits (status backend and job-log line)."""
    path = f"megapatch FP32-output GEMM ({fp32_gemm.backend(device_type)})"
    if native_output_dtype:
        path += (", not megatron-core's own output_dtype (PR #6252): its FP32 output is a view that "
                 "megatron's cross entropy modifies in place, which autograd refuses (and without "
                 "TE it raises)")
    return path


def _say_path(path: str) -> None:
    report.once(f"logits.fp32_lm_head:{path}", "info", f"megapatch logits.fp32_lm_head: FP32 logits via {path}")


@contextlib.contextmanager
def lm_head(layer):
    """Within this block, ``layer`` (a ColumnParallelLinear) produces FP32 logits when
    ``logits_dtype="fp32"``. The model wrappers use it; tests and custom models may too."""
    if state.current().logits_dtype != "fp32":
        yield
        return
    _refuse_unsupported(layer)
    _refuse_conflicting_output_dtype(layer)
    native = _native_output_dtype(layer)
    _say_path(_path(_device_type(layer), native))
    previous = layer.output_dtype if native else None
    if native:  # upstream computes the plain GEMM; megapatch's FP32OutputLinear takes it from there
        layer.output_dtype = None
    marker = _Marked(layer)
    try:
        with scoped(_lm_head, marker):
            yield
    finally:
        if native:
            layer.output_dtype = previous
    if marker.calls == 0 and getattr(layer, "_megapatch_expect_call", True):
        raise UpstreamSurfaceError(
            "megapatch logits_dtype='fp32': the model ran without calling its output layer "
            "through ColumnParallelLinear.forward, so its logits were not computed in FP32 "
            "(the upstream model forward changed)")


class _Marked:
    """The output layer marked for this model call, and how often it ran in FP32."""

    __slots__ = ("layer", "calls")

    def __init__(self, layer):
        self.layer, self.calls = layer, 0


def _refuse_unsupported(layer) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    if not isinstance(layer, ColumnParallelLinear):
        raise UnsupportedConfigurationError(
            f"megapatch logits_dtype='fp32': the output layer is a {type(layer).__module__}."
            f"{type(layer).__qualname__}, not megatron-core's ColumnParallelLinear. Upstream refuses "
            f"an FP32 output for TE's MXFP8 LM head (TELMHeadColumnParallelLinear) too; use the "
            f"default output layer. logits_dtype was set by {state.origin('logits_dtype')}.")


def _foreign_logit_dtype(requested) -> bool:
    """A logit dtype of the model's own that is not FP32's: a torch dtype on the built layer, or the
    flag's text (``fp32``/``float32``, ``bf16``...) in a preflight config; None is "not set"."""
    return requested is not None and str(requested).replace("torch.", "") not in ("fp32", "float32")


def _refuse_conflicting_output_dtype(layer) -> None:
    """An output layer that upstream was told to produce another dtype (PR #6252's
    ``output_dtype``, set from ``GPTModel(logit_dtype=...)``: Megatron-Bridge's ``logit_dtype``,
    Megatron-LM's ``--output-logit-dtype``) while megapatch was asked for FP32: neither wins
    silently. ``output_dtype`` None (not set) or float32 (the same request) composes."""
    requested = getattr(layer, "output_dtype", None)
    if not _foreign_logit_dtype(requested):
        return
    raise UnsupportedConfigurationError(
        f"megapatch logits_dtype='fp32' conflicts with the model's own logit dtype: its output layer "
        f"was built with output_dtype={requested} (megatron-core GPTModel(logit_dtype={requested}), "
        f"which Megatron-Bridge's provider field logit_dtype and Megatron-LM's --output-logit-dtype "
        f"set). logits_dtype was set by {state.origin('logits_dtype')}. Use one of them: drop the "
        f"model's logit_dtype (or set it to torch.float32), or unset megapatch's logits_dtype.")


def model_forward(wrapped, instance, args, kwargs):
    layer = getattr(instance, "output_layer", None)
    if layer is None or state.current().logits_dtype != "fp32":  # not the last stage, or off
        return wrapped(*args, **kwargs)
    with lm_head(layer):
        return wrapped(*args, **kwargs)


def _model_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    layer = getattr(instance, "output_layer", None)
    if layer is not None and state.current().logits_dtype == "fp32":
        _refuse_unsupported(layer)  # at model construction, before any training step
        _refuse_conflicting_output_dtype(layer)


def column_parallel_forward(wrapped, instance, args, kwargs):
    marker = _lm_head.get()
    if marker is None or marker.layer is not instance:
        return wrapped(*args, **kwargs)
    marker.calls += 1
    with fp32_output_linear.output_dtype(torch.float32):
        return wrapped(*args, **kwargs)


def _backend() -> str:
    from megatron.core.tensor_parallel import ColumnParallelLinear
    import inspect

    native = "output_dtype" in inspect.signature(ColumnParallelLinear.__init__).parameters
    return _path("cuda" if torch.cuda.is_available() else "cpu", native)


# every patch here serves logits_dtype="fp32"
logits_patch = functools.partial(Patch, option="logits_dtype", applies=when("logits_dtype", "fp32"),
                                  supports=MEGATRON_CORE_TESTED)


def preflight(config) -> "str | None":
    """What the model's construction would refuse: a logit dtype of its own other than FP32
    (``logit_dtype``: Megatron-LM's ``--output-logit-dtype``, Megatron-Bridge's provider field)."""
    requested = getattr(config, "logit_dtype", None)
    if not _foreign_logit_dtype(requested):
        return None
    return (f"the model's own logit dtype is {requested} (--output-logit-dtype / Megatron-Bridge's "
            f"logit_dtype), megapatch's logits_dtype is fp32: the model would be refused at "
            f"construction; use one of them")


def model_marking_patch(name, module, model, summary, watches=(), extra=(), preflight=None):
    """A model class whose construction refuses a foreign head and whose forward marks its
    output layer for FP32 logits (``extra``: further targets marking it the same way)."""
    return logits_patch(
        name=name, summary=summary, hook=module, backend=_backend, watches=watches, preflight=preflight,
        targets=(Target(module, f"{model}.__init__", _model_init, kind="method"),
                 Target(module, f"{model}.forward", model_forward, kind="method"), *extra))
