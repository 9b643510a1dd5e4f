"""Stand-in for NCCL when several ranks share one GPU: gloo collectives on CPU copies of CUDA tensors.

NCCL refuses two ranks of a communicator on one device, and gloo's CUDA support does not cover every
collective megatron-core and megapatch call (``reduce_scatter_tensor``, ``all_to_all_single``). Inside
:func:`collectives_through_host`, each ``torch.distributed`` collective given a CUDA tensor runs on
CPU copies and copies every tensor back: a copy changes no bit, and the sums are gloo's, as in the
CPU tests, so what a GPU check measures is the GPU's arithmetic (GEMMs, elementwise kernels), not
its communication. ``async_op=True`` completes before returning (a finished handle).

Install it before ``megatron`` or megapatch is imported: modules that bind a collective at import
(``from torch.distributed import all_gather_into_tensor``) keep what they bound.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, List

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

#: the collectives megatron-core's TP/SP/DP paths and megapatch's block tree call
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_single",
               "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter", "all_to_all_single",
               "all_to_all", "broadcast", "reduce")


class _Finished:
    """The handle of a collective that already completed (``async_op=True``)."""

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 -- torch's Work signature
        return True

    def is_completed(self) -> bool:
        return True


def _to_host(value: Any, moved: List[tuple], staged: Callable[[torch.Tensor], bool]) -> Any:
    if isinstance(value, torch.Tensor) and staged(value):
        host = value.detach().to("cpu", copy=True)
        moved.append((value, host))
        return host
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_to_host(v, moved, staged) for v in value)
    return value


def _through_host(original: Callable, staged: Callable[[torch.Tensor], bool]) -> Callable:
    @functools.wraps(original)
    def collective(*args, **kwargs):
        moved: List[tuple] = []
        args = tuple(_to_host(a, moved, staged) for a in args)
        kwargs = {k: _to_host(v, moved, staged) for k, v in kwargs.items()}
        if not moved:
            return original(*args, **kwargs)
        asynchronous = kwargs.pop("async_op", False)
        work = original(*args, **kwargs)
        if work is not None and hasattr(work, "wait"):
            work.wait()
        with torch.no_grad():
            for device_tensor, host in moved:
                device_tensor.copy_(host)
        return _Finished() if asynchronous else None

    collective.megapatch_through_host = True
    return collective


@contextlib.contextmanager
def collectives_through_host(staged: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda) -> Iterator[None]:
    """Route ``torch.distributed``'s collectives on tensors ``staged`` picks (CUDA ones) through CPU
    copies; restores the originals on exit. ``staged=lambda t: True`` stages CPU tensors through a
    copy too: the same path, testable without a GPU."""
    saved = []
    for module in (dist, c10d):
        for name in COLLECTIVES:
            original = getattr(module, name, None)
            if original is None or getattr(original, "megapatch_through_host", False):
                continue
            saved.append((module, name, original))
    wrapped = {id(original): _through_host(original, staged) for _, _, original in saved}
    try:
        for module, name, original in saved:
            setattr(module, name, wrapped[id(original)])
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
