"""Tensor-parallel reductions that accumulate in FP32 and round once.

Two modes, chosen by ``tp_reduce_dtype``:

* ``fp32``: the collective runs on an FP32 copy (twice the bytes of BF16); the FP32 sum is
  rounded once into the caller's tensor.
* ``fp32-accumulate``: partial sums travel in their own dtype (the bytes of the native
  collective): an all-to-all hands each rank one shard from every peer, the shard is summed
  locally in FP32 in rank order and rounded once, and (for an all-reduce) an all-gather
  reassembles the result -- as megatron-core does for data-parallel gradients in
  ``distributed/reduce_scatter_with_fp32_accumulation.py``.

Both keep the callers' contracts: results land in the caller's tensor, and an async handle's
``wait()`` returns only once they are there. The collectives called here are torch's originals
(``distributed_c10d``), never a wrapped ``torch.distributed`` attribute.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.distributed import distributed_c10d as c10d

MODES = ("fp32", "fp32-accumulate")


class CastBackOnWait:
    """An async collective handle that finishes megapatch's work when waited on.

    ``finish`` runs once, after the underlying work completed: it rounds the FP32 result into the
    tensor the caller holds (and, for fp32-accumulate, runs the remaining steps)."""

    def __init__(self, work, finish: Callable[[], None]):
        self._work = work
        self._finish: Optional[Callable[[], None]] = finish

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return result

    def is_completed(self) -> bool:
        return self._finish is None and self._work.is_completed()

    def __getattr__(self, name):
        return getattr(self._work, name)


def _done(finish: Callable[[], None], work, async_op: bool):
    if async_op:
        return CastBackOnWait(work, finish)
    if work is not None:
        work.wait()
    finish()
    return None


def all_reduce_(tensor: torch.Tensor, group, mode: str, async_op: bool = False):
    """Sum ``tensor`` over ``group`` in place (its dtype kept), accumulating in FP32.
    Returns None, or a handle when ``async_op``; the result is in ``tensor`` after ``wait()``."""
    if mode == "fp32":
        buf = tensor.to(torch.float32, memory_format=torch.contiguous_format)
        work = c10d.all_reduce(buf, group=group, async_op=async_op)
        return _done(lambda: tensor.copy_(buf.view_as(tensor)), work, async_op)
    if mode == "fp32-accumulate":
        world = group.size()
        flat = tensor.reshape(-1)
        pad = (-flat.numel()) % world
        send = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.contiguous()
        recv = torch.empty_like(send)
        work = c10d.all_to_all_single(recv, send, group=group, async_op=async_op)

        def finish():
            shard = torch.sum(recv.view(world, -1), dim=0, dtype=torch.float32).to(tensor.dtype)
            if send.data_ptr() == tensor.data_ptr():  # contiguous, no padding: gather in place
                c10d.all_gather_into_tensor(send, shard, group=group)
                return
            gathered = torch.empty_like(send)
            c10d.all_gather_into_tensor(gathered, shard, group=group)
            tensor.copy_(gathered[: flat.numel()].view_as(tensor))

        return _done(finish, work, async_op)
    raise ValueError(f"unknown tp_reduce_dtype mode {mode!r}; valid: {', '.join(MODES)}")


def reduce_scatter_(output: torch.Tensor, input_: torch.Tensor, group, mode: str,
                    async_op: bool = False):
    """Reduce-scatter ``input_`` along dim 0 into ``output`` (``output``'s dtype kept),
    accumulating in FP32; the contract of ``torch.distributed.reduce_scatter_tensor``."""
    if mode == "fp32":
        out32 = torch.empty(output.shape, dtype=torch.float32, device=output.device)
        work = c10d.reduce_scatter_tensor(out32, input_.to(torch.float32).contiguous(), group=group,
                                          async_op=async_op)
        return _done(lambda: output.copy_(out32), work, async_op)
    if mode == "fp32-accumulate":
        world = group.size()
        recv = torch.empty(input_.shape, dtype=input_.dtype, device=input_.device)
        work = c10d.all_to_all_single(recv, input_.contiguous(), group=group, async_op=async_op)

        def finish():
            output.copy_(torch.sum(recv.view(world, *output.shape), dim=0, dtype=torch.float32))

        return _done(finish, work, async_op)
    raise ValueError(f"unknown tp_reduce_dtype mode {mode!r}; valid: {', '.join(MODES)}")


def reduce_scatter(input_: torch.Tensor, group, mode: str) -> torch.Tensor:
    """Reduce-scatter along dim 0 into a new tensor of ``input_``'s dtype."""
    shape = list(input_.shape)
    shape[0] //= group.size()
    output = torch.empty(shape, dtype=input_.dtype, device=input_.device)
    reduce_scatter_(output, input_, group, mode)
    return output
