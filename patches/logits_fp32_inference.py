"""FP32 logits through megatron-core's inference path (static batching, text generation).

Released inference downcasts logits to ``params_dtype`` wherever pipeline parallelism moves them:
``AbstractModelInferenceWrapper.forward_pass_with_pipeline_parallel_{small,large}_input_batch``
(<= 0.16) or ``forward_pass_with_pipeline_parallel`` (>= 0.17) (``.to(params_dtype)``, a BF16
preallocated buffer) and the text-generation controller's
``broadcast_from_last_pipeline_stage(..., dtype=params_dtype)``. Without pipeline parallelism the
FP32 logits already reach sampling and log-probs unchanged.

With ``logits_dtype="fp32"``: ``_forward`` hands each micro-batch's FP32 logits to the pipeline
method that called it, which returns them (concatenated in micro-batch order) instead of its
downcast copy, and the controller's logits broadcasts use FP32 on every rank.
"""

from __future__ import annotations

import contextvars

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


def _pipeline_methods_probe():
    from megatron.core.inference.model_inference_wrappers import abstract_model_inference_wrapper as amiw

    if not any(hasattr(amiw.AbstractModelInferenceWrapper, name) for name in PP_METHODS):
        return (f"{WRAPPER}.AbstractModelInferenceWrapper has none of {', '.join(PP_METHODS)}: "
                f"the pipeline-parallel inference path changed")
    return None


PATCHES = (
    Patch(
        name="logits.fp32_inference",
        supports=MEGATRON_CORE_TESTED,
        option="logits_dtype",
        summary="FP32 logits reach sampling and log-probs in static-batching inference",
        hook=CONTROLLER,
        applies=when("logits_dtype", "fp32"),
        probe=_pipeline_methods_probe,
        targets=(
            Target(WRAPPER, "AbstractModelInferenceWrapper._forward", _forward, kind="method",
                   params=("self", "inference_input")),
            *(Target(WRAPPER, f"AbstractModelInferenceWrapper.{name}", _pipeline_forward, kind="method",
                     optional=True) for name in PP_METHODS),
            Target(CONTROLLER, "broadcast_from_last_pipeline_stage", _broadcast,
                   params=("size", "dtype", "tensor"), rebind_aliases=False),
        ),
    ),
)
