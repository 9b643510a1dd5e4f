"""CPU workarounds that let *unmodified* megatron-core run on CPU (gloo).

Contract of :func:`cpu_workarounds`:

* Inside the context, the CUDA-only calls listed in :data:`WORKAROUNDS` are
  redirected to CPU equivalents; on exit every patched attribute is restored
  to the exact object it was before.
* It is re-entrant and idempotent: nested ``with cpu_workarounds():`` blocks
  (or several threads entering it) patch once and restore when the outermost
  block exits.
* It never changes numerics: tensors are allocated on CPU with the dtype and
  shape megatron asked for, and no upstream function under test is replaced.
  One entry is a stand-in rather than a redirect, labelled ``(stand-in)``: with
  ``--sequence-parallel`` upstream needs apex's or TE's norms, so a torch norm is
  built instead, honouring their sequence-parallel gradient contract.
  The workarounds act on torch's CUDA entry points and on the RNG tracker, so
  patches applied to megatron functions (e.g. ``tensor_parallel.mappings``)
  by other code still run the upstream bodies.  The one wrapped megatron
  function, ``p2p_communication._batched_p2p_ops``, is a guard: it calls the
  original unchanged or raises where gloo would mis-deliver messages.

Scope limit: the redirect of literal ``device="cuda"`` arguments is a
``TorchFunctionMode``, which is thread-local.  It is active in the thread that
entered the context (autograd runs CPU backward passes in the calling thread,
so ``loss.backward()`` is covered); megatron code run on other threads sees
only the process-wide patches.

The CPU equivalents are here, with the table and its scope; the RNG ones are in ``cpu_rng``, the
stream ones in ``cpu_streams``, and the :class:`~megapatch.testing.stand_ins.replacements.Workaround`
record and its apply/restore mechanism in ``replacements``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator, Tuple

from megapatch.testing.stand_ins import moe_cpu
from megapatch.testing.stand_ins.cpu_rng import (_RANDOM_MODULE, _SuppressCpuRngWarning, _cpu_get_rng_state,
                                                 _cpu_set_rng_state, _cpu_tracker_add)
from megapatch.testing.stand_ins.cpu_streams import _cpu_current_stream, cpu_side_stream, cpu_stream_context
from megapatch.testing.stand_ins.replacements import Replacements, Workaround, _resolve

__all__ = ["cpu_workarounds", "workarounds_active", "WORKAROUNDS"]


# --- replacements -------------------------------------------------------------


def _cpu_current_device(_original):
    # Replaces every ``device=torch.cuda.current_device()`` allocation in
    # megatron-core: GlobalMemoryBuffer.get_tensor (core/utils.py), the
    # gather/reduce-scatter outputs in tensor_parallel/mappings.py (sequence
    # parallel, parallel_output=False), the sequence-parallel dgrad buffer
    # ``sub_grad_input`` and all-gather buffers in tensor_parallel/layers.py,
    # and the recv/shape buffers in pipeline_parallel/p2p_communication.py.
    # Upstream returns an int CUDA index; a CPU device works wherever the value
    # is used as ``device=`` and fails loudly where it is used as an index.
    import torch

    cpu = torch.device("cpu")

    def current_device():
        return cpu

    return current_device


def _noop_synchronize(_original):
    # Replaces ``torch.cuda.synchronize()`` in p2p_communication after
    # ``batch_isend_irecv`` (config.batch_p2p_comm and batch_p2p_sync, both on
    # by default). On CPU/gloo the work handles' ``wait()`` already completes
    # the transfers, so there is nothing to synchronize.
    def synchronize(device=None):
        return None

    return synchronize


def _guard_batched_p2p(original):
    # Not a CUDA replacement but a guard: upstream _batched_p2p_ops posts
    # send_prev, recv_prev, send_next, recv_next in one batch_isend_irecv.
    # At PP=2 prev and next are the same peer, and gloo matches messages to
    # one peer in posting order, so the activation lands in the gradient
    # buffer and vice versa -- silently wrong numerics.  Raise instead; the
    # unbatched _p2p_ops (batch_p2p_comm=False) is correct on gloo.
    import functools

    @functools.wraps(original)
    def _batched_p2p_ops(*args, **kwargs):
        same_peer = kwargs.get("prev_pipeline_rank") == kwargs.get("next_pipeline_rank")
        both = lambda a, b: kwargs.get(a) is not None and kwargs.get(b) is not None  # noqa: E731
        if same_peer and (both("tensor_send_prev", "tensor_send_next")
                          or both("tensor_recv_prev", "tensor_recv_next")):
            raise RuntimeError(
                "batch_p2p_comm=True exchanges two tensors with the same peer (PP=2) in one "
                "batch; gloo would swap them. Use batch_p2p_comm=False on CPU.")
        return original(*args, **kwargs)

    return _batched_p2p_ops


def _sequence_parallel_torch_norm(original):
    # WrappedTorchNorm (the local spec's norm without apex) asserts `not config.sequence_parallel`:
    # torch's norms have no sequence-parallel variant upstream, apex's FusedLayerNorm and TE's
    # norms do. Stand-in: the same torch norm, its parameters marked `sequence_parallel` as
    # FusedLayerNorm marks them, so that finalize_model_grads all-reduces their gradients over TP
    # (upstream's contract for a norm on sequence-split tokens). Without SP: the original call.
    def __new__(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original(cls, config, *args, **kwargs)
        config.sequence_parallel = False  # only around the assert; the config object is restored
        try:
            module = original(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in module.parameters():
            setattr(param, "sequence_parallel", True)
        return module

    return staticmethod(__new__)


WORKAROUNDS: Tuple[Workaround, ...] = (
    Workaround(
        "torch.cuda",
        "current_device",
        "torch.cuda.current_device() used as an allocation device",
        _cpu_current_device,
    ),
    Workaround(
        "torch.cuda",
        "synchronize",
        "torch.cuda.synchronize() after batch_isend_irecv in p2p_communication",
        _noop_synchronize,
    ),
    Workaround(
        "torch.cuda",
        "current_stream",
        "torch.cuda.current_stream() waited on before the gradient reduction (mcore >= 0.19)",
        _cpu_current_stream,
    ),
    Workaround(
        _RANDOM_MODULE,
        "_get_cuda_rng_state",
        "CUDA generator state read by CudaRNGStatesTracker.fork / checkpointing",
        _cpu_get_rng_state,
    ),
    Workaround(
        _RANDOM_MODULE,
        "_set_cuda_rng_state",
        "CUDA generator state written by CudaRNGStatesTracker.fork / checkpointing",
        _cpu_set_rng_state,
    ),
    Workaround(
        _RANDOM_MODULE,
        "CudaRNGStatesTracker.add",
        "torch.cuda.get_rng_state()/torch.cuda.manual_seed() in CudaRNGStatesTracker.add",
        _cpu_tracker_add,
    ),
    Workaround(
        "megatron.core.transformer.torch_norm",
        "WrappedTorchNorm.__new__",
        "(stand-in) apex FusedLayerNorm / TE norms, the norms upstream builds for --sequence-parallel: "
        "a torch norm whose parameters are marked sequence_parallel, as FusedLayerNorm marks them",
        _sequence_parallel_torch_norm,
        optional=True,
    ),
    Workaround(
        moe_cpu.MOE_UTILS,
        "te_general_gemm",
        "(stand-in) moe_utils.te_general_gemm, unbound without TE (NameError in the MoE router)",
        moe_cpu.no_te_general_gemm,
        optional=True,
        creates=True,
    ),
    Workaround(
        "torch.cuda",
        "Stream",
        "(stand-in) torch.cuda.Stream of the alltoall MoE dispatcher's device-to-host copies: a stream "
        "whose events are complete (CPU ops finish on return)",
        cpu_side_stream,
    ),
    Workaround(
        "torch.cuda",
        "stream",
        "torch.cuda.stream(...) around the alltoall MoE dispatcher's device-to-host copies",
        cpu_stream_context,
    ),
    Workaround(
        moe_cpu.TOKEN_DISPATCHER,
        "maybe_move_tensor_to_cpu",
        "(stand-in) the MoE dispatcher's split sizes as numpy arrays, converted by upstream for "
        "CUDA tensors only (gloo's all_to_all_single rejects tensors)",
        moe_cpu.split_sizes_to_numpy,
        optional=True,
    ),
    Workaround(
        moe_cpu.MAPPINGS,
        "_gather_along_first_dim",
        "(stand-in) the MoE dispatchers' uneven all-gather (gloo rejects parts of different "
        "lengths): padded, gathered, trimmed",
        moe_cpu.padded_uneven_all_gather,
    ),
    Workaround(
        "megatron.core.pipeline_parallel.p2p_communication",
        "_batched_p2p_ops",
        "(guard) batch_isend_irecv with two messages to one peer, mis-matched by gloo",
        _guard_batched_p2p,
        optional=True,
    ),
)


# --- literal device="cuda" ----------------------------------------------------


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return getattr(device, "type", None) == "cuda"


def _make_cuda_literal_mode():
    """A TorchFunctionMode mapping literal CUDA device arguments to CPU.

    Replaces, in megatron-core 0.16: ``torch.zeros([], ..., device="cuda")``
    for ``total_num_tokens`` in every schedule of pipeline_parallel/schedules.py,
    ``torch.ones(..., device="cuda")`` in transformer/utils.get_default_causal_mask,
    and ``weight.data.cuda()`` in LanguageModule.setup_embeddings_and_output_layer
    (PP > 1 with shared embeddings).  Only ``device=`` keyword arguments,
    ``Tensor.cuda()`` and ``Tensor.to("cuda")`` are rewritten; every other
    call passes through untouched.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    cpu = torch.device("cpu")

    class CudaLiteralToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.cuda:
                return args[0].to(cpu, non_blocking=kwargs.get("non_blocking", False))
            if _is_cuda_device(kwargs.get("device")):
                kwargs = dict(kwargs, device=cpu)
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], cpu) + tuple(args[2:])
            return func(*args, **kwargs)

    return CudaLiteralToCpu()


class _PatchState:
    """Process-wide reference-counted application of :data:`WORKAROUNDS`."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.depth = 0
        self.replacements = Replacements()
        self.log_filter = _SuppressCpuRngWarning()
        self.local = threading.local()

    def acquire(self) -> None:
        with self.lock:
            if self.depth == 0:
                self._apply()
            self.depth += 1

    def release(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self._restore()

    def _apply(self) -> None:
        try:
            for workaround in WORKAROUNDS:
                target = _resolve(workaround)
                if target is None:
                    continue
                owner, leaf = target
                self.replacements.replace(owner, leaf, workaround.make)
            logging.getLogger(_RANDOM_MODULE).addFilter(self.log_filter)
        except BaseException:
            self._restore()
            raise

    def _restore(self) -> None:
        logging.getLogger(_RANDOM_MODULE).removeFilter(self.log_filter)
        self.replacements.restore()


_STATE = _PatchState()


def workarounds_active() -> bool:
    """True while at least one :func:`cpu_workarounds` context is open."""
    return _STATE.depth > 0


@contextlib.contextmanager
def _thread_cuda_literal_mode() -> Iterator[None]:
    """Enters the literal-device mode once per thread (outermost entry only)."""
    local = _STATE.local
    depth = getattr(local, "mode_depth", 0)
    local.mode_depth = depth + 1
    try:
        if depth == 0:
            with _make_cuda_literal_mode():
                yield
        else:
            yield
    finally:
        local.mode_depth = depth


@contextlib.contextmanager
def cpu_workarounds() -> Iterator[None]:
    """Makes real megatron-core run on CPU for the duration of the block.

    Imports ``megatron.core.tensor_parallel.random`` (the RNG patches live
    there).  Safe to nest and to enter from several threads; everything is
    restored when the outermost block exits, also on error.
    """
    _STATE.acquire()
    try:
        with _thread_cuda_literal_mode():
            yield
    finally:
        _STATE.release()
