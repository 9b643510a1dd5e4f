"""FP32 tensor-parallel reductions in megatron-core's own (local, non-TE) layers.

Covers every floating-point reduction over the TP group in ``megatron.core.tensor_parallel``:

* ``mappings._reduce``: the forward all-reduce after row-parallel layers and the vocab-parallel
  embedding, and the backward all-reduce of ``copy_to_tensor_model_parallel_region``;
* ``mappings._reduce_scatter_along_first_dim`` (and ``_last_dim``, which calls it): the
  sequence-parallel reduce-scatter, forward and backward;
* ``layers.dist_reduce_scatter_func``: the sequence-parallel dgrad reduce-scatter (async);
* ``torch.distributed.all_reduce`` while ``LinearWithGradAccumulationAndAsyncCommunication`` or
  ``LinearWithFrozenWeight`` run their backward: the dgrad all-reduce (async and sync). Outside
  those two backwards the wrapper passes straight through;
* ``RowParallelLinear.forward`` (mode ``fp32``): the layer's GEMM hands its FP32 accumulator to
  the reduction, so partial sums are never rounded to BF16; the sum (plus bias) is rounded once.
  A layer inside an MoE layer (marked by ``tp_reduce.moe``) hands on the FP32 result unrounded,
  reduced or not, for the MoE layer to round once.
  The FP32 output itself comes from the ``linear.fp32_output`` patch; if it is not in place, the
  layer raises instead of reducing BF16-rounded partials.

Integer tensors, FP32 tensors and all-gathers go through upstream untouched.
"""

from __future__ import annotations

import contextvars

import torch

from megapatch.numerics import fp32_collectives, fp32_output_linear
from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.core.errors import UpstreamSurfaceError
from megapatch.core.registry import Patch, Target
from megapatch.core.scope import scoped
from megapatch.numerics.dtypes import LOW_PRECISION
from megapatch.patches._common import LAYERS, LINEAR_FUNCTIONS, MEGATRON_CORE_TP_REDUCE_TESTED, tp_group
from megapatch.patches.tp_reduce._reduction import MOE_FP32_SUM, reduction_mode

MAPPINGS = "megatron.core.tensor_parallel.mappings"

_in_linear_backward = contextvars.ContextVar("megapatch_in_linear_backward", default=False)


def _reduce(wrapped, instance, args, kwargs):
    input_, group = argument(args, kwargs, 0, "input_"), argument(args, kwargs, 1, "group")
    mode = reduction_mode(input_, group)
    if mode is None:
        return wrapped(*args, **kwargs)
    fp32_collectives.all_reduce_(input_, group, mode)
    return input_


def _reduce_scatter_along_first_dim(wrapped, instance, args, kwargs):
    input_, group = argument(args, kwargs, 0, "input_"), argument(args, kwargs, 1, "group")
    mode = reduction_mode(input_, group)
    if mode is None:
        return wrapped(*args, **kwargs)
    split_sizes = argument(args, kwargs, 2, "input_split_sizes", None)
    if split_sizes is None:
        return fp32_collectives.reduce_scatter(input_, group, mode)
    # uneven splits (MoE): upstream's list reduce-scatter over an FP32 copy, rounded once
    return wrapped(input_.to(torch.float32), group, split_sizes).to(input_.dtype)


def _layers_reduce_scatter(wrapped, instance, args, kwargs):
    output, input_ = argument(args, kwargs, 0, "output"), argument(args, kwargs, 1, "input")
    op = argument(args, kwargs, 2, "op", torch.distributed.ReduceOp.SUM)
    group = argument(args, kwargs, 3, "group", None)
    mode = reduction_mode(input_, group) if op == torch.distributed.ReduceOp.SUM else None
    if mode is None:
        return wrapped(*args, **kwargs)
    return fp32_collectives.reduce_scatter_(output, input_, group or torch.distributed.group.WORLD, mode,
                                       async_op=argument(args, kwargs, 4, "async_op", False))


def _dgrad_all_reduce(wrapped, instance, args, kwargs):
    if not _in_linear_backward.get():
        return wrapped(*args, **kwargs)
    tensor = argument(args, kwargs, 0, "tensor")
    op = argument(args, kwargs, 1, "op", torch.distributed.ReduceOp.SUM)
    group = argument(args, kwargs, 2, "group", None)
    mode = reduction_mode(tensor, group) if op == torch.distributed.ReduceOp.SUM else None
    if mode is None:
        return wrapped(*args, **kwargs)
    return fp32_collectives.all_reduce_(tensor, group or torch.distributed.group.WORLD, mode,
                                   async_op=argument(args, kwargs, 3, "async_op", False))


def _linear_backward(wrapped, instance, args, kwargs):
    if state.current().tp_reduce_dtype == "native":
        return wrapped(*args, **kwargs)
    with scoped(_in_linear_backward, True):
        return wrapped(*args, **kwargs)


def _row_parallel_forward(wrapped, instance, args, kwargs):
    input_ = argument(args, kwargs, 0, "input_")
    if state.current().tp_reduce_dtype != "fp32" or input_.dtype not in LOW_PRECISION:
        return wrapped(*args, **kwargs)
    in_moe = getattr(instance, MOE_FP32_SUM, False)  # the MoE layer sums on and rounds once
    if not in_moe and (getattr(instance, "explicit_expert_comm", False) or tp_group(instance).size() == 1):
        return wrapped(*args, **kwargs)
    with fp32_output_linear.output_dtype(torch.float32):
        output, output_bias = wrapped(*args, **kwargs)
    if output.dtype != torch.float32:
        raise UpstreamSurfaceError(
            f"megapatch tp_reduce_dtype='fp32': RowParallelLinear produced {output.dtype}, not its FP32 "
            f"GEMM accumulator (is the linear.fp32_output patch skipped? see megapatch.status())")
    return (output if in_moe else output.to(input_.dtype)), output_bias


def _backend():
    from megapatch.numerics import fp32_gemm

    mode = state.current().tp_reduce_dtype
    if mode == "fp32":
        return f"fp32 wire, FP32 row-parallel accumulator ({fp32_gemm.backend()})"
    return "activation-dtype wire, FP32 local accumulation"


PATCHES = (
    Patch(
        name="tp_reduce.megatron_core",
        supports=MEGATRON_CORE_TP_REDUCE_TESTED,
        option="tp_reduce_dtype",
        summary="FP32-accumulated TP reductions in megatron.core.tensor_parallel",
        hook="megatron.core.tensor_parallel",
        applies=lambda s: s.tp_reduce_dtype in fp32_collectives.MODES,
        backend=_backend,
        targets=(
            Target(MAPPINGS, "_reduce", _reduce, params=("input_", "group")),
            Target(MAPPINGS, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim,
                   params=("input_", "group")),
            Target(LAYERS, "dist_reduce_scatter_func", _layers_reduce_scatter,
                   params=("output", "input"), rebind_aliases=False),
            Target("torch.distributed", "all_reduce", _dgrad_all_reduce,
                   params=("tensor", "op", "group", "async_op"), rebind_aliases=False),
            *(Target(LAYERS, f"{name}.backward", _linear_backward, kind="staticmethod",
                     params=("ctx", "grad_output")) for name in LINEAR_FUNCTIONS),
            Target(LAYERS, "RowParallelLinear.forward", _row_parallel_forward, kind="method",
                   params=("self", "input_")),
        ),
    ),
)
