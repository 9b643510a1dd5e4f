"""The ``tp_reduce.transformer_engine`` wrappers of TE's reduce helpers (``allreduce``,
``reduce_scatter_along_first_dim``, ``symmetric_all_reduce``): a row-parallel forward's FP32
accumulator, or a BF16/FP16 tensor, summed over the TP group in FP32 and rounded once."""

from __future__ import annotations

import logging

import torch
from torch.distributed import distributed_c10d as c10d

from megapatch.numerics import fp32_collectives
from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.patches.tp_reduce._reduction import reduction_mode
from megapatch.patches.tp_reduce._te_forward import claim

log = logging.getLogger("megapatch")


# -- the reductions -------------------------------------------------------------------------------

def _group(group):
    return c10d.group.WORLD if group is None else group


def allreduce(wrapped, instance, args, kwargs):
    inp = argument(args, kwargs, 0, "inp")
    group = argument(args, kwargs, 1, "tp_group", None)
    async_op = argument(args, kwargs, 2, "async_op", False)
    ctx = claim(inp)
    if ctx is not None:
        return _all_reduce_accumulator(inp, _group(group), ctx.dtype, async_op)
    mode = reduction_mode(inp, group)
    if mode is None:
        return wrapped(*args, **kwargs)
    return inp, fp32_collectives.all_reduce_(inp, _group(group), mode, async_op=async_op)


def _all_reduce_accumulator(acc, group, dtype, async_op):
    """Sum an FP32 accumulator in FP32; hand back a new tensor in ``dtype`` (rounded once)."""
    acc = acc.contiguous()
    work = c10d.all_reduce(acc, group=group, async_op=async_op)
    if not async_op:
        return acc.to(dtype), None
    out = torch.empty_like(acc, dtype=dtype)
    return out, fp32_collectives.CastBackOnWait(work, lambda: out.copy_(acc))


_symmetric_noted = False


def symmetric_all_reduce(wrapped, instance, args, kwargs):
    global _symmetric_noted
    if argument(args, kwargs, 2, "async_op", False):
        return wrapped(*args, **kwargs)  # TE refuses async symmetric all-reduce itself
    if not _symmetric_noted and state.current().tp_reduce_dtype in fp32_collectives.MODES:
        _symmetric_noted = True
        log.warning("megapatch: tp_reduce_dtype=%r sums symmetric_ar_type all-reduces with its own "
                    "FP32 all-reduce, not TE's symmetric-memory kernel",
                    state.current().tp_reduce_dtype)
    return allreduce(wrapped, instance, args, kwargs)


def reduce_scatter_along_first_dim(wrapped, instance, args, kwargs):
    inp = argument(args, kwargs, 0, "inp")
    group = argument(args, kwargs, 1, "tp_group", None)
    async_op = argument(args, kwargs, 2, "async_op", False)
    output = argument(args, kwargs, 3, "output", None)
    ctx = claim(inp)
    mode = "fp32" if ctx is not None else reduction_mode(inp, group)
    if mode is None:
        return wrapped(*args, **kwargs)
    group = _group(group)
    world = group.size()
    if inp.shape[0] % world:
        raise ValueError(
            f"First dimension of the tensor should be divisible by tensor parallel size, but got "
            f"dim_size[0]={inp.shape[0]} and world_size={world}")
    if output is None:
        output = torch.empty((inp.shape[0] // world, *inp.shape[1:]),
                             dtype=ctx.dtype if ctx is not None else inp.dtype, device=inp.device)
    return output, fp32_collectives.reduce_scatter_(output, inp, group, mode, async_op=async_op)
