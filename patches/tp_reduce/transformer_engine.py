"""FP32-accumulated tensor-parallel reductions in Transformer Engine's linear modules.

Covers every TP reduction of ``te.Linear``, ``te.LayerNormLinear`` and ``te.LayerNormMLP`` (and of
what is built on them: ``te.TransformerLayer``, megatron-core's ``TELinear`` family):

* ``allreduce``: the row-parallel forward (sync) and the column-parallel dgrad (async; TE waits on
  the handle and then uses the tensor it passed in: ``wait()`` leaves the FP32 sum, rounded once,
  in that tensor);
* ``reduce_scatter_along_first_dim``: the same two with sequence parallelism (the output is
  allocated in the input's dtype, as TE does; ``output=`` of TE >= 2.19 is honoured);
* ``symmetric_all_reduce`` (``symmetric_ar_type`` set): the row-parallel forward is summed by
  megapatch's FP32 all-reduce instead of the symmetric-memory kernel (which reduces a buffer of
  the activation dtype) -- same result contract (in place, ``(inp, None)``); the speed of the
  symmetric kernel is given up, and a warning says so once;
* ``general_gemm`` (mode ``fp32``): while a row-parallel layer runs its forward (a context variable
  set by the wrapped ``<Layer>.forward``), its fprop GEMM returns the FP32 accumulator; the
  reduction above sums it in FP32 and returns it rounded once to the activation dtype (TE adds the
  bias after the reduction, in the activation dtype).
* a routed MoE expert's fc2 (megatron-core's ``TERowParallelLinear`` in a ``SequentialMLP``, or the
  ``GroupedLinear`` of grouped-GEMM experts, ``TEGroupedMLP``; marked by ``tp_reduce.moe``; TE runs it
  without a TP reduction, the token dispatcher sums): the layer returns its fprop GEMM's (or grouped
  GEMM's) FP32 accumulator, for the MoE layer's FP32 sums; TE goes on with a copy
  rounded to the activation dtype, and its backward receives the gradient cast to that dtype.

Each module imports these helpers by name (``from ..distributed import allreduce``) and
context-parallel attention imports the same function objects for its CP group: each module's own
name is wrapped, never ``transformer_engine.pytorch.distributed.*``, and aliases are never rebound.

Refused with ``UnsupportedConfigurationError`` (the reduction would stay in the activation dtype,
out of megapatch's reach): Userbuffers / cuBLASMp comm+GEMM overlap that reduces inside the GEMM
(``ub_overlap_rs*``, ``ub_bulk_wgrad``; megatron ``tp_comm_overlap``), the operation fuser
(``te.ops``; megatron ``use_te_op_fuser``), and ``torch.compile`` of these layers.

The wrappers live beside this record: ``_te_forward`` (a layer's forward, its fprop GEMM and grouped
GEMM), ``_te_reductions`` (the reduce helpers); the operation fuser's refusal and the surface check
are below. The TE wiring these wrappers rely on (symbols, signatures, call shapes) is declared below
(``LAYERS``, ``REDUCE_PARAMS``, ``GEMM_KEYWORDS``, ``OPS_REDUCING``, ...) and checked against
TE's own sources: statically for every claimed release (``tools/te_wiring_check.py``) and, at
install, against the installed sources (``megapatch.te_check.wiring``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import sys
from typing import List, Optional, Tuple

from torch.distributed import distributed_c10d as c10d

from megapatch.numerics import fp32_collectives
from megapatch.core import state
from megapatch.core.errors import UnsupportedConfigurationError
from megapatch.core.registry import Patch, Target
from megapatch.patches._common import TRANSFORMER_ENGINE_TESTED
from megapatch.patches.tp_reduce._te_forward import (TE, general_gemm, general_grouped_gemm, grouped_forward,
                                                      layer_forward, read)
from megapatch.patches.tp_reduce._te_reductions import allreduce, reduce_scatter_along_first_dim, symmetric_all_reduce

LINEAR = f"{TE}.module.linear"
LAYERNORM_LINEAR = f"{TE}.module.layernorm_linear"
LAYERNORM_MLP = f"{TE}.module.layernorm_mlp"
FUSER = f"{TE}.ops.fuser"
GROUPED_LINEAR = f"{TE}.module.grouped_linear"  # no TP communication: routed experts' fc2 (fp32) only


@dataclasses.dataclass(frozen=True)
class Layer:
    """A TE module whose forward/backward reduce over the TP group, and what the wrappers read.

    ``parallel_attr`` says whether the layer is split: ``parallel_mode`` ("row": forward
    reduction; "column": dgrad reduction) or LayerNormMLP's ``set_parallel_mode`` (fc1 column,
    fc2 row: both). ``ub_reducing`` are the Userbuffers flags under which TE reduces inside a GEMM.
    """

    module: str
    cls: str
    parallel_attr: str
    ub_reducing: Tuple[str, ...]

    def row_parallel(self, value) -> bool:
        return value == "row" if self.parallel_attr == "parallel_mode" else bool(value)

    def split(self, value) -> bool:
        return value in ("row", "column") if self.parallel_attr == "parallel_mode" else bool(value)


_UB_LINEAR = ("ub_overlap_rs_fprop", "ub_overlap_rs_dgrad", "ub_bulk_wgrad")
LAYERS = (
    Layer(LINEAR, "Linear", "parallel_mode", _UB_LINEAR),
    Layer(LAYERNORM_LINEAR, "LayerNormLinear", "parallel_mode", _UB_LINEAR),
    Layer(LAYERNORM_MLP, "LayerNormMLP", "set_parallel_mode",
          ("ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_wgrad")),
)
LAYER_ATTRS = ("tp_size", "tp_group")  # read from every layer, besides parallel_attr and ub_reducing

# Every parameter each reduce helper may take: the wrappers understand all of them.
REDUCE_PARAMS = {
    "allreduce": ("inp", "tp_group", "async_op"),
    "reduce_scatter_along_first_dim": ("inp", "tp_group", "async_op", "output"),
    "symmetric_all_reduce": ("inp", "tp_group", "async_op", "all_reduce_type"),
}
# The keywords of general_gemm that recognise the row-parallel fprop GEMM (see _is_row_fprop).
GEMM_KEYWORDS = ("out_dtype", "quantization_params", "gelu", "layout", "out", "bias", "grad",
                 "accumulate", "ub", "ub_type", "extra_output")

# te.ops basic operations whose forward or backward sums over a process group (the fuser runs
# them, fused or not), and the attributes that say whether they do.
OPS_REDUCING = {
    f"{TE}.ops.basic.basic_linear.BasicLinear": ("tensor_parallel_mode", "tensor_parallel_size"),
    f"{TE}.ops.basic.all_reduce.AllReduce": ("process_group",),
    f"{TE}.ops.basic.reduce_scatter.ReduceScatter": ("process_group",),
    f"{TE}.ops.basic.all_gather.AllGather": ("process_group",),  # backward: reduce-scatter
}
# Fused ops that reduce only for a basic op above that they contain (refused through it).
OPS_FUSED = {f"{TE}.ops.fused.userbuffers_backward_linear.UserbuffersBackwardLinear": "BasicLinear"}
# Other TE modules that import the reduce helpers by name, and why they are not wrapped.
NOT_WRAPPED = {
    f"{TE}.attention.dot_product_attention.context_parallel":
        "context-parallel attention: reduces over the CP group, not TP",
    f"{TE}.ops.basic.basic_linear": "te.ops: refused at the operation fuser",
}


# -- the operation fuser (te.ops) -----------------------------------------------------------------

def _fuser_call(wrapped, instance, args, kwargs):
    mode = state.current().tp_reduce_dtype
    if mode in fp32_collectives.MODES:
        reducing = _reducing_ops(instance)
        if reducing:
            raise UnsupportedConfigurationError(
                f"megapatch tp_reduce_dtype={mode!r} cannot be honoured for Transformer Engine's "
                f"operation fuser (te.ops: {', '.join(reducing)}): these ops call "
                f"torch.distributed.all_reduce / reduce_scatter_tensor themselves, in the activation "
                f"dtype, out of megapatch's reach. Use the module API (te.Linear, te.LayerNormLinear, "
                f"te.LayerNormMLP; Megatron: a layer spec without use_te_op_fuser), or set "
                f"tp_reduce_dtype='native'.")
    return wrapped(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _op_class(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _reducing_ops(fuser) -> List[str]:
    found = []
    for op in read(fuser, "_basic_ops"):
        for path in OPS_REDUCING:
            cls = _op_class(path)
            if not isinstance(op, cls):
                continue
            if cls.__name__ == "BasicLinear":
                reduces = (read(op, "tensor_parallel_mode") in ("row", "column")
                           and read(op, "tensor_parallel_size") > 1)
            else:
                group = read(op, "process_group")
                reduces = c10d.is_initialized() and c10d.get_world_size(group) > 1
            if reduces:
                found.append(f"{cls.__name__}" + (f"(tensor_parallel_mode={op.tensor_parallel_mode!r})"
                                                  if cls.__name__ == "BasicLinear" else ""))
    return found


# -- surface ----------------------------------------------------------------------------------------

def _probe() -> Optional[str]:
    """Every parameter of the installed reduce helpers is one the wrappers understand, general_gemm
    takes the keywords the recogniser reads, and the installed TE sources are wired as declared
    above (``megapatch.te_check.wiring``, the check the wiring test runs on every claimed release)."""
    for layer in LAYERS:
        module = importlib.import_module(layer.module)
        for name, handled in REDUCE_PARAMS.items():
            params = tuple(inspect.signature(getattr(module, name)).parameters)
            if params != handled[: len(params)]:
                return f"{layer.module}.{name} takes {params}; the wrapper understands {handled}"
        gemm = tuple(inspect.signature(module.general_gemm).parameters)
        missing = [k for k in GEMM_KEYWORDS if k not in gemm]
        if missing:
            return f"{layer.module}.general_gemm takes no {missing}"
    from megapatch.te_check import verdict  # cached per TE installation; the checker loads on a miss

    return verdict.installed_problem(sys.modules[__name__])


def _backend():
    if state.current().tp_reduce_dtype == "fp32":
        return "fp32 wire, FP32 row-parallel accumulator (TE general_gemm out_dtype=float32)"
    return "activation-dtype wire, FP32 local accumulation"


def _targets():
    for layer in LAYERS:
        yield Target(layer.module, f"{layer.cls}.forward", layer_forward(layer), kind="method",
                     params=("self", "inp"))
        # the same function objects live in the other layers' modules and in context-parallel
        # attention: wrap this module's name only
        yield Target(layer.module, "general_gemm", general_gemm, params=("A", "B"),
                     rebind_aliases=False)
        yield Target(layer.module, "allreduce", allreduce, params=REDUCE_PARAMS["allreduce"],
                     rebind_aliases=False)
        yield Target(layer.module, "reduce_scatter_along_first_dim", reduce_scatter_along_first_dim,
                     params=REDUCE_PARAMS["reduce_scatter_along_first_dim"][:3], rebind_aliases=False)
        yield Target(layer.module, "symmetric_all_reduce", symmetric_all_reduce,
                     params=REDUCE_PARAMS["symmetric_all_reduce"], rebind_aliases=False)
    yield Target(FUSER, "OperationFuser.__call__", _fuser_call, kind="method", params=("self", "input"))
    yield Target(GROUPED_LINEAR, "GroupedLinear.forward", grouped_forward, kind="method", params=("self", "inp"))
    yield Target(GROUPED_LINEAR, "general_grouped_gemm", general_grouped_gemm, params=("A", "B", "out"),
                 rebind_aliases=False)


PATCHES = (
    Patch(
        name="tp_reduce.transformer_engine",
        supports=TRANSFORMER_ENGINE_TESTED,
        option="tp_reduce_dtype",
        summary="FP32-accumulated TP reductions in Transformer Engine Linear/LayerNormLinear/LayerNormMLP",
        hook=TE,
        package="transformer-engine",
        applies=lambda s: s.tp_reduce_dtype in fp32_collectives.MODES,
        probe=_probe,
        backend=_backend,
        targets=tuple(_targets()),
    ),
)
