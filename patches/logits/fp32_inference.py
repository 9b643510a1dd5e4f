"""FP32 logits through megatron-core's inference paths: static batching and the dynamic engine
(what Megatron RL rollouts run), up to sampling and the log-prob computation.

Released inference downcasts logits to ``params_dtype`` wherever pipeline parallelism moves them:
``AbstractModelInferenceWrapper.forward_pass_with_pipeline_parallel_{small,large}_input_batch``
(<= 0.16) or ``forward_pass_with_pipeline_parallel`` (>= 0.17) (``.to(params_dtype)``, a BF16
preallocated buffer) and the text-generation controller's
``broadcast_from_last_pipeline_stage(..., dtype=params_dtype)``. Without pipeline parallelism the
FP32 logits already reach sampling and log-probs unchanged.

The dynamic engine takes the same wrapper methods and the same controller broadcast (the PP logits
of ``_dynamic_step_forward_logits`` and, on main, the MTP draft logits). From megatron-core 0.17
the controller also copies the logits into ``_all_logits_cuda`` when CUDA graphs are on
(``cuda_graph_impl="local"``), a buffer ``_init_dynamic_sampling_tensors`` allocates in
``params_dtype``; sampling and log-probs read that buffer.

With ``logits_dtype="fp32"``: ``_forward`` hands each micro-batch's FP32 logits to the pipeline
method that called it, which returns them (concatenated in micro-batch order) instead of its
downcast copy; the controller's logits broadcasts use FP32 on every rank; the logits buffers the
controller allocates are FP32. A controller that allocates a logits buffer megapatch does not
know is refused at enable (the probe), never left in BF16 while status says FP32.
"""

from __future__ import annotations

import ast
import contextvars
import inspect
import textwrap

import torch

from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.core.errors import UpstreamSurfaceError
from megapatch.core.registry import Patch, Target
from megapatch.core.scope import scoped
from megapatch.patches._common import MEGATRON_CORE_TESTED, when

WRAPPER = "megatron.core.inference.model_inference_wrappers.abstract_model_inference_wrapper"
CONTROLLER = "megatron.core.inference.text_generation_controllers.text_generation_controller"
PP_METHODS = ("forward_pass_with_pipeline_parallel_small_input_batch",  # <= 0.16
              "forward_pass_with_pipeline_parallel_large_input_batch",  # <= 0.16
              "forward_pass_with_pipeline_parallel")                    # >= 0.17

#: controller attributes holding logits, allocated by ``_init_dynamic_sampling_tensors`` (>= 0.17)
LOGITS_BUFFERS = ("_all_logits_cuda",)
_LOW_PRECISION = (torch.bfloat16, torch.float16)

_stash = contextvars.ContextVar("megapatch_fp32_logits", default=None)


def _on() -> bool:
    return state.current().logits_dtype == "fp32"


def _forward(wrapped, instance, args, kwargs):
    logits = wrapped(*args, **kwargs)
    stash = _stash.get()
    if stash is not None and isinstance(logits, torch.Tensor) and logits.dtype == torch.float32:
        stash.append(logits)
    return logits


def _pipeline_forward(wrapped, instance, args, kwargs):
    if not _on():
        return wrapped(*args, **kwargs)
    stash: list = []
    with scoped(_stash, stash):
        logits = wrapped(*args, **kwargs)
    if logits is None or not stash:  # not the last stage
        return logits
    full = stash[0] if len(stash) == 1 else torch.cat(stash, dim=0)
    if full.shape != logits.shape:
        raise UpstreamSurfaceError(
            f"megapatch logits_dtype='fp32': {WRAPPER}.{wrapped.__name__} returned logits of shape "
            f"{tuple(logits.shape)}, the model produced {tuple(full.shape)}: the inference wrapper "
            f"changed")
    return full


def _broadcast(wrapped, instance, args, kwargs):
    if not _on():
        return wrapped(*args, **kwargs)
    dtype = argument(args, kwargs, 1, "dtype", None)
    if dtype not in (torch.bfloat16, torch.float16):
        return wrapped(*args, **kwargs)
    size = argument(args, kwargs, 0, "size")
    tensor = argument(args, kwargs, 2, "tensor", None)
    rest = {k: v for k, v in kwargs.items() if k not in ("size", "dtype", "tensor")}
    if tensor is not None and tensor.dtype != torch.float32:
        tensor = tensor.to(torch.float32)
    return wrapped(size, torch.float32, tensor, *args[3:], **rest)


def _sampling_buffers(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if _on():
        for name in LOGITS_BUFFERS:
            buffer = getattr(instance, name, None)
            if isinstance(buffer, torch.Tensor) and buffer.dtype in _LOW_PRECISION:
                setattr(instance, name, torch.zeros(buffer.shape, dtype=torch.float32, device=buffer.device))
    return result


def _dtype_allocations(cls) -> dict:
    """``{attribute: dtype expression}`` for every ``self.<attribute> = torch.<fn>(..., dtype=...)``
    in ``cls``'s source whose dtype is the model's: an expression naming ``params_dtype``, or a
    local name the method assigned from one."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    found = {}
    for method in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        model_dtype = {"params_dtype"}
        for node in ast.walk(method):
            if not isinstance(node, ast.Assign):
                continue
            names = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)}
            if names & model_dtype:
                model_dtype |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(method):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            func = node.value.func
            if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                    and func.value.id == "torch"):
                continue
            dtype = next((k.value for k in node.value.keywords if k.arg == "dtype"), None)
            if dtype is None:
                continue
            used = {n.id for n in ast.walk(dtype) if isinstance(n, ast.Name)}
            used |= {n.attr for n in ast.walk(dtype) if isinstance(n, ast.Attribute)}
            if not used & model_dtype:
                continue
            for target in node.targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    found[target.attr] = ast.unparse(dtype)
    return found


def _probe():
    from megatron.core.inference.model_inference_wrappers import abstract_model_inference_wrapper as amiw
    from megatron.core.inference.text_generation_controllers import text_generation_controller as tgc

    if not any(hasattr(amiw.AbstractModelInferenceWrapper, name) for name in PP_METHODS):
        return (f"{WRAPPER}.AbstractModelInferenceWrapper has none of {', '.join(PP_METHODS)}: "
                f"the pipeline-parallel inference path changed")
    try:
        allocations = _dtype_allocations(tgc.TextGenerationController)
    except (OSError, TypeError, SyntaxError) as exc:
        return (f"cannot read the source of {CONTROLLER}.TextGenerationController to check its "
                f"logits buffers ({type(exc).__name__}: {exc})")
    unknown = sorted(set(allocations) - set(LOGITS_BUFFERS))
    if unknown:
        return (f"{CONTROLLER}.TextGenerationController allocates "
                + ", ".join(f"self.{name} (dtype={allocations[name]})" for name in unknown)
                + " in the model's dtype, a buffer megapatch does not know: its logits would stay "
                  "in BF16/FP16")
    return None


PATCHES = (
    Patch(
        name="logits.fp32_inference",
        supports=MEGATRON_CORE_TESTED,
        option="logits_dtype",
        summary="FP32 logits reach sampling and log-probs in static and dynamic inference",
        hook=CONTROLLER,
        applies=when("logits_dtype", "fp32"),
        probe=_probe,
        targets=(
            Target(WRAPPER, "AbstractModelInferenceWrapper._forward", _forward, kind="method",
                   params=("self", "inference_input")),
            *(Target(WRAPPER, f"AbstractModelInferenceWrapper.{name}", _pipeline_forward, kind="method",
                     optional=True) for name in PP_METHODS),
            Target(CONTROLLER, "broadcast_from_last_pipeline_stage", _broadcast,
                   params=("size", "dtype", "tensor"), rebind_aliases=False),
            # optional: a controller without the dynamic engine's sampling tensors lacks it
            Target(CONTROLLER, "TextGenerationController._init_dynamic_sampling_tensors",
                   _sampling_buffers, kind="method", params=("self",), optional=True),
        ),
    ),
)
