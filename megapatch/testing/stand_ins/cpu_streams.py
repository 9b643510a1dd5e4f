"""CUDA streams on CPU, for the CPU stand-ins: a side stream on which everything has already
happened (CPU ops finish when their Python call returns) and its completed events, standing in
for ``torch.cuda.Stream``, ``torch.cuda.current_stream()`` and the ``torch.cuda.stream(...)``
context (megatron-core's gradient sync and MoE dispatcher, Megatron-LM's refit, the dynamic
engine's copy stream)."""

from __future__ import annotations

import contextlib


def _cpu_current_stream(_original):
    # Replaces ``torch.cuda.current_stream()`` in megatron-core >= 0.19's
    # _ParamAndGradBucketGroup.start_grad_sync (distributed/param_and_grad_buffer.py),
    # which waits on the stream for ``param._cudagraph_wgrad_ready_event`` (set only
    # by CUDA-graph replay) before reading the gradients, and in Megatron-LM main's
    # gloo refit (resharding/copy_services), which synchronises it.  On CPU every op
    # has finished when its Python call returns: a stream on which everything has
    # happened stands in (torch.cpu.Stream has no ``synchronize``).
    def current_stream(device=None):
        return CpuSideStream()

    return current_stream


class _CompletedEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuSideStream:
    """A side stream on which everything has already happened (CPU ops finish on return)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _CompletedEvent()

    def synchronize(self) -> None:
        pass


def cpu_side_stream(_original):
    # Replaces torch.cuda.Stream: the MoE alltoall dispatcher's device-to-host copy stream (it
    # synchronises on an event recorded there), the dynamic engine's copy stream (>= 0.17).
    return CpuSideStream


def cpu_stream_context(_original):
    # Replaces the torch.cuda.stream(s) context manager around work on those streams.
    return lambda stream=None: contextlib.nullcontext()
