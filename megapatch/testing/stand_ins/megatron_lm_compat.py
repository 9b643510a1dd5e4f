"""CPU stand-ins for the CUDA-only calls of Megatron-LM's ``megatron/training`` (on top of
:mod:`megapatch.testing.stand_ins.cpu_compat`, which covers megatron-core).

Used by :mod:`megapatch.testing.ranks.cpu_launch` to run an unmodified Megatron-LM script (e.g.
``pretrain_gpt.py``) on CPU ranks. Same contract as ``cpu_compat``: CUDA-only calls are redirected,
no numerics change, nothing in Megatron-LM's files is edited, and every replacement is listed in
:data:`WORKAROUNDS` with the upstream call it replaces:

=============================================  ===================================================
replaced (CPU stand-in)                        upstream call it replaces
=============================================  ===================================================
``torch.cuda.Stream`` / ``stream``: torch's    the DDP side stream in ``training.get_model``
CPU stream (``torch.cpu.Stream`` /             (``torch.cuda.Stream()``, ``wait_stream``); CPU ops
``torch.cpu.stream``)                          have finished when their Python call returns
                                               (``current_stream``: ``cpu_compat``)
``torch.cuda.get_rng_state`` /                 ``RerunStateMachine._save_state`` /
``set_rng_state`` (CPU default generator)      ``_restore_state``; the CPU generator plays the CUDA
                                               generator, as in ``cpu_compat``
``training.utils.get_device_arch_version``     ``torch.cuda.get_device_properties`` in
returns 0 (no CUDA architecture)               ``validate_args``: treated as pre-Blackwell, so TP>1
                                               requires ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as on H100
``initialize_megatron(allow_no_cuda=True)``    ``assert torch.cuda.is_available(), "Megatron
                                               requires CUDA."``
``_initialize_distributed``: one device        ``torch.cuda.device_count() == 0`` skips
(``device_count() == 1``, ``set_device``       ``mpu.initialize_model_parallel``; CPU plays device
no-op) for this call                           0 and gloo is the backend (``--distributed-backend``)
``_set_random_seed``: one device for this      ``torch.cuda.device_count() == 0`` skips
call                                           ``model_parallel_cuda_manual_seed`` (the TP RNG
                                               tracker, kept on CPU by ``cpu_compat``)
``initialize._warmup_jit_function``: skipped   compiles the fused bias-GeLU / bias-dropout kernels
                                               on random ``device="cuda"`` tensors (~20 s of
                                               ``torch.compile`` on CPU for kernels the
                                               ``--no-*-fusion`` run never calls; its random draws
                                               would shift the CPU generator that plays CUDA's)
``p2p_communication._p2p_ops`` sends a         Megatron-LM forces ``deallocate_pipeline_outputs``:
private copy of each tensor it sends           ``deallocate_output_tensor`` frees a stage output
                                               right after its ``isend`` is posted; CUDA orders
                                               the send first, gloo sends from a background
                                               thread and would read the freed storage
``megatron.legacy.fused_kernels.load``:        runs ``nvcc -V`` (absent on CPU); builds no kernel
skipped (optional: only older Megatron-LM)
``DistributedOptimizer.state_dict`` on a       without apex/TE: ``assert len(steps) == 1`` over
fresh optimizer takes upstream's TE/apex       torch's per-parameter ``step`` (none yet) when
branch (a template without ``step``)           ``sharded_state_dict(is_loading=True)`` builds the
                                               torch_dist resume template; the checkpoint's step
                                               is loaded as upstream loads it
``_set_main_param_and_optimizer_states``       without apex/TE: ``KeyError: 'step'`` copying a
gets torch Adam's already-loaded ``step``      ``--dist-ckpt-optim-fully-reshardable`` checkpoint
                                               (upstream sets the step from the param groups and
                                               leaves it out of the copied tensors)
``DistributedOptimizer.load_state_dict``       without apex/TE: one ``step`` tensor shared by
gives each parameter's Adam state its own      every parameter's torch Adam state, advanced once
copy of the loaded ``step``                    per parameter per step (a resumed run leaves the
                                               uninterrupted one at its first step)
``Tensor.type()`` of a CPU tensor reports      the ``'torch.cuda.BFloat16Tensor'`` / ``FloatTensor``
``torch.cuda.<T>``                             checks in megatron-core's optimizers
                                               (``Float16OptimizerWithFloat16Params``,
                                               ``DistributedOptimizer``, ``clip_grads``)
=============================================  ===================================================

Module attributes of ``megatron.training`` / ``megatron.legacy`` are replaced by post-import hooks,
when the script first imports them (before any ``from``-import binds an alias). A required target
that the checkout lacks raises naming the symbol; everything is restored when the context exits.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import threading
from typing import Any, Callable, Iterator, Tuple

from megapatch.testing.stand_ins.cpu_streams import cpu_side_stream, cpu_stream_context
from megapatch.testing.stand_ins.replacements import Replacements, Workaround

__all__ = ["megatron_lm_workarounds", "WORKAROUNDS", "TYPE_REPORT"]


# --- torch.cuda stand-ins ----------------------------------------------------------------------


def _cpu_get_rng_state(_original):
    import torch

    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    return get_rng_state


def _cpu_set_rng_state(_original):
    import torch

    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    return set_rng_state


def _no_cuda_architecture(_original):
    def get_device_arch_version():
        return 0

    return get_device_arch_version


# --- megatron.training stand-ins ---------------------------------------------------------------


def _allow_no_cuda(original):
    signature = inspect.signature(original)
    if "allow_no_cuda" not in signature.parameters:
        raise RuntimeError(
            "megapatch.testing.ranks.cpu_launch: megatron.training.initialize.initialize_megatron has no "
            f"'allow_no_cuda' parameter (signature {signature}); this Megatron-LM is not supported")

    @functools.wraps(original)
    def initialize_megatron(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["allow_no_cuda"] = True
        return original(*bound.args, **bound.kwargs)

    return initialize_megatron


def _one_cuda_device(original):
    import torch

    @functools.wraps(original)
    def with_one_device(*args, **kwargs):
        device_count, set_device = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count = lambda: 1
        torch.cuda.set_device = lambda device: None
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = device_count, set_device

    return with_one_device


def _send_private_copies(original):
    # Megatron-LM forces deallocate_pipeline_outputs=True: right after posting the send of a
    # stage's output, the schedule pseudo-frees it (``out.data = torch.empty((1,))``). Under CUDA
    # the send is ordered on the stream before anything reuses that memory; gloo sends from a
    # background thread and may read the swapped storage (seen here: wrong activations, NaN).
    # The receiver gets the same values either way.
    @functools.wraps(original)
    def _p2p_ops(*args, **kwargs):
        for name in ("tensor_send_prev", "tensor_send_next"):
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name].clone()
        return original(*args, **kwargs)

    return _p2p_ops


def _template_without_step(original):
    # Without apex/TE, DistributedOptimizer.state_dict reads Adam's 'step' from torch's per-parameter
    # state and asserts there is exactly one. On resume, sharded_state_dict(is_loading=True) calls
    # it on a fresh optimizer (no state yet) to build the load template, and feeds the template to
    # load_state_dict: the assert fails on every CPU resume. The stand-in, only while the state is
    # empty, takes upstream's TE/apex branch for this one call (module flags flipped and restored:
    # a template without a step) and gives each param group the step of an optimizer that has
    # taken none (0.0: torch's path requires one). The checkpoint's own param groups, with their
    # step, replace the template when Megatron-LM loads them, as upstream does on GPU.
    @functools.wraps(original)
    def state_dict(self):
        module = sys.modules[type(self).__module__]
        if getattr(module, "HAVE_APEX_OR_TE", True) or len(self.optimizer.state) > 0:
            return original(self)
        flags = {name: getattr(module, name) for name in ("HAVE_APEX_OR_TE", "USING_TE_OPTIMIZER",
                                                           "USING_APEX_OPTIMIZER") if hasattr(module, name)}
        try:
            module.HAVE_APEX_OR_TE = True
            module.USING_TE_OPTIMIZER = module.USING_APEX_OPTIMIZER = False
            template = original(self)
        finally:
            for name, value in flags.items():
                setattr(module, name, value)
        for group in template["optimizer"]["param_groups"]:
            group["step"] = 0.0
        return template

    return state_dict


def _keep_torch_adam_step(original):
    # Without apex/TE, torch's Adam keeps a 'step' tensor in each parameter's state. Loading a
    # fully reshardable distributed-optimizer checkpoint, upstream sets that step from the param
    # groups first (load_state_dict) and leaves 'step' out of the tensors it then copies in ("handle
    # torch Adam 'step' state separately"), but _set_main_param_and_optimizer_states copies every
    # key of the destination state: KeyError 'step'. The stand-in hands it the step already set,
    # so that copy is a no-op; every other tensor is copied as upstream copies it.
    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not getattr(self.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                                                 False):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main_param, {}).get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


def _own_step_per_parameter(original):
    # Without apex/TE, DistributedOptimizer.load_state_dict gives every parameter's torch Adam
    # state the same 'step' tensor object (one torch.tensor(step) assigned to each state, and
    # torch's load_state_dict keeps it as it is). torch's Adam then increments that one tensor once
    # per parameter per step: Adam's bias correction after a resume uses a step count inflated by
    # the parameter count, and the resumed run leaves the uninterrupted one at the first step. On
    # GPU, TE's/apex's FusedAdam keep the step in the param group. The stand-in gives each state a
    # copy of the loaded value after upstream's load.
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        seen = set()
        for state in self.optimizer.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if step is not None and hasattr(step, "clone"):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(step))
        return result

    return load_state_dict


def _skip(original):
    @functools.wraps(original)
    def skipped(*args, **kwargs):
        return None

    return skipped


_INITIALIZE = "megatron.training.initialize"

WORKAROUNDS: Tuple[Workaround, ...] = (
    # the same stand-ins as cpu_compat's (whichever is applied last wins: a launcher that enters the
    # dynamic engine's stand-ins first applies these after): events recorded on them are complete
    Workaround("torch.cuda", "Stream", "torch.cuda.Stream() (DDP side stream in get_model)", cpu_side_stream),
    Workaround("torch.cuda", "stream", "with torch.cuda.stream(ddp_stream):", cpu_stream_context),
    Workaround("torch.cuda", "get_rng_state", "torch.cuda.get_rng_state() in RerunStateMachine",
               _cpu_get_rng_state),
    Workaround("torch.cuda", "set_rng_state", "torch.cuda.set_rng_state() in RerunStateMachine",
               _cpu_set_rng_state),
    # (not torch.cuda.get_device_properties: torch.compile'd fusions such as bias-SwiGLU read it too)
    Workaround("megatron.training.utils", "get_device_arch_version",
               "torch.cuda.get_device_properties('cuda:0').major in validate_args", _no_cuda_architecture),
    Workaround(_INITIALIZE, "initialize_megatron",
               'assert torch.cuda.is_available(), "Megatron requires CUDA."', _allow_no_cuda),
    Workaround(_INITIALIZE, "_initialize_distributed",
               "torch.cuda.device_count() == 0 skips mpu.initialize_model_parallel",
               _one_cuda_device),
    Workaround(_INITIALIZE, "_set_random_seed",
               "torch.cuda.device_count() == 0 skips model_parallel_cuda_manual_seed",
               _one_cuda_device),
    Workaround(_INITIALIZE, "_warmup_jit_function",
               "JIT warm-up of fused kernels on random device='cuda' tensors", _skip),
    Workaround("megatron.core.pipeline_parallel.p2p_communication", "_p2p_ops",
               "isend of a stage output that deallocate_output_tensor frees right after posting",
               _send_private_copies),
    Workaround("megatron.legacy.fused_kernels", "load", "nvcc -V probe of the CUDA toolkit", _skip,
               optional=True),
    Workaround("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.state_dict",
               "assert len(steps) == 1 (no apex/TE) when a torch_dist resume builds the distributed "
               "optimizer's load template before its first step", _template_without_step),
    Workaround("megatron.core.optimizer.distrib_optimizer",
               "DistributedOptimizer._set_main_param_and_optimizer_states",
               "KeyError 'step' (no apex/TE) copying a fully reshardable checkpoint's optimizer state "
               "into torch Adam's", _keep_torch_adam_step, optional=True),
    Workaround("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.load_state_dict",
               "one 'step' tensor shared by every parameter's torch Adam state after a distributed-"
               "optimizer load (no apex/TE): Adam advances it once per parameter", _own_step_per_parameter),
)

TYPE_REPORT = "Tensor.type() == 'torch.cuda.<T>' checks in megatron-core's optimizers"


def _make_type_report_mode():
    """``Tensor.type()`` (the no-argument string query) of a CPU tensor reports ``torch.cuda.<T>``;
    conversions (``Tensor.type(dtype)``) and every other call pass through."""
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaTypeReport(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                if args[0].device.type == "cpu" and not name.startswith("torch.cuda."):
                    return "torch.cuda." + name[len("torch."):]
                return name
            return func(*args, **kwargs)

    return CudaTypeReport()


# --- application -------------------------------------------------------------------------------


class _Applied:
    """The replacements made so far (restored in reverse order) and whether hooks may still act."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.replacements = Replacements()
        self.active = False

    def replace(self, owner, workaround: Workaround) -> None:
        # ``attr`` may be dotted (``Class.method``): the last part is replaced on its owner
        *path, leaf = workaround.attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, leaf):
            if workaround.optional:
                return
            raise RuntimeError(
                f"megapatch.testing.ranks.cpu_launch: {workaround.module}.{workaround.attr} not found "
                f"(needed for: {workaround.replaces}); this Megatron-LM is not supported")
        self.replacements.replace(owner, leaf, workaround.make)


def _on_import(applied: _Applied, module_name: str,
               workarounds: Tuple[Workaround, ...]) -> Callable[[Any], None]:
    def hook(module) -> None:
        with applied.lock:
            if applied.active:
                for workaround in workarounds:
                    applied.replace(module, workaround)

    return hook


@contextlib.contextmanager
def megatron_lm_workarounds(extra: Tuple[Workaround, ...] = ()) -> Iterator[None]:
    """Applies :data:`WORKAROUNDS` then ``extra`` (``torch.cuda`` now, Megatron-LM modules when
    imported) and the ``Tensor.type()`` report on this thread; restores everything on exit. Not
    re-entrant. ``extra``: e.g. the converter's stand-ins (:mod:`megapatch.testing.stand_ins.convert_compat`)."""
    import wrapt

    applied = _Applied()
    applied.active = True
    by_module: dict = {}
    for workaround in WORKAROUNDS + tuple(extra):
        by_module.setdefault(workaround.module, []).append(workaround)
    try:
        for module_name, workarounds in by_module.items():
            hook = _on_import(applied, module_name, tuple(workarounds))
            if module_name in sys.modules or module_name == "torch.cuda":
                hook(importlib.import_module(module_name))
            else:
                wrapt.register_post_import_hook(hook, module_name)
        with _make_type_report_mode():
            yield
    finally:
        with applied.lock:
            applied.active = False
            applied.replacements.restore()
