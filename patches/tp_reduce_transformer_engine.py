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

The TE wiring these wrappers rely on (symbols, signatures, call shapes) is declared below
(``LAYERS``, ``REDUCE_PARAMS``, ``GEMM_KEYWORDS``, ``OPS_REDUCING``, ...) and checked against
TE's own sources: statically for every claimed release (``tools/te_wiring_check.py``) and, at
install, against the installed sources (``megapatch.te_check.wiring``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib
import inspect
import logging
import sys
from typing import Any, List, Optional, Tuple

import torch
from torch.distributed import distributed_c10d as c10d

from megapatch.numerics import fp32_collectives
from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.core.errors import UnsupportedConfigurationError, UpstreamSurfaceError
from megapatch.core.registry import Patch, Target
from megapatch.core.scope import scoped
from megapatch.numerics.dtypes import LOW_PRECISION
from megapatch.patches._common import MOE_FP32_SUM, TRANSFORMER_ENGINE_TESTED, reduction_mode

log = logging.getLogger("megapatch")

TE = "transformer_engine.pytorch"
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


@dataclasses.dataclass
class _RowForward:
    """One row-parallel layer forward in mode fp32: its FP32 accumulators awaiting their reduction."""

    layer: str
    group: Any
    pending: List[torch.Tensor] = dataclasses.field(default_factory=list)
    dtype: Optional[torch.dtype] = None  # what TE asked the GEMM for (the activation dtype)
    intercepted: int = 0

    def claim(self, tensor) -> bool:
        for i, acc in enumerate(self.pending):
            if acc is tensor:
                del self.pending[i]
                return True
        return False


_row_forward: contextvars.ContextVar[Optional[_RowForward]] = contextvars.ContextVar(
    "megapatch_te_row_forward", default=None)


@dataclasses.dataclass
class _HandedOn:
    """One forward of a routed expert's fc2 in mode fp32 (marked by ``tp_reduce.moe``: the MoE layer
    sums the experts' outputs on in FP32 and rounds once): its fprop GEMM's FP32 accumulator, and the
    rounded copy TE itself goes on with."""

    layer: str
    accumulator: Optional[torch.Tensor] = None
    rounded: Optional[torch.Tensor] = None
    intercepted: int = 0


_handed_on: contextvars.ContextVar[Optional[_HandedOn]] = contextvars.ContextVar(
    "megapatch_te_handed_on", default=None)


class _AccumulatorOut(torch.autograd.Function):
    """Forward: the FP32 accumulator in place of TE's rounded output. Backward: the gradient cast to
    the activation dtype, into TE's own backward (the contract of Megatron-LM PR #6252, as
    ``numerics.fp32_output_linear`` keeps it for megatron-core's linears)."""

    @staticmethod
    def forward(ctx, rounded, accumulator):
        ctx.dtype = rounded.dtype
        return accumulator.view_as(rounded)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None  # (autograd would cast it too: it is the rounded output's gradient)


# -- layer forward: refusals, and the row-parallel context --------------------------------------

def _layer_forward(layer: Layer):
    def forward(wrapped, instance, args, kwargs):
        mode = state.current().tp_reduce_dtype
        if mode not in fp32_collectives.MODES:
            return wrapped(*args, **kwargs)
        parallel = _read(instance, layer.parallel_attr)
        if mode == "fp32" and getattr(instance, MOE_FP32_SUM, False):
            return _hand_on_accumulator(wrapped, instance, args, kwargs, layer, parallel)
        ctx = None
        if layer.split(parallel) and _read(instance, "tp_size") > 1:
            _refuse_unsupported(instance, layer, mode)
            if mode == "fp32" and layer.row_parallel(parallel):
                ctx = _RowForward(type(instance).__name__, _read(instance, "tp_group"))
        with scoped(_row_forward, ctx):  # also hides an enclosing layer's context
            result = wrapped(*args, **kwargs)
        if ctx is not None and ctx.pending:
            raise UpstreamSurfaceError(
                f"megapatch: {ctx.layer}.forward made {ctx.intercepted} FP32-accumulator GEMM(s) but "
                f"reduced {ctx.intercepted - len(ctx.pending)}: an FP32 partial sum would leave the layer "
                f"unreduced. Transformer Engine's row-parallel forward changed",
                hint="Use tp_reduce_dtype='fp32-accumulate' (no GEMM change) or 'native'.")
        out = result[0] if isinstance(result, (tuple, list)) else result
        if ctx is not None and ctx.intercepted and getattr(out, "dtype", None) == torch.float32:
            raise UpstreamSurfaceError(
                f"megapatch: {ctx.layer}.forward returned float32 after its fprop GEMM was switched to "
                f"an FP32 accumulator (activation dtype {ctx.dtype}): Transformer Engine's row-parallel "
                f"forward changed", hint="Use tp_reduce_dtype='fp32-accumulate' or 'native'.")
        return result

    forward.__name__ = forward.__qualname__ = f"{layer.cls}_forward"
    return forward


def _grouped_forward(wrapped, instance, args, kwargs):
    """``GroupedLinear.forward``: grouped-GEMM experts' fc2 (``TEGroupedMLP``) hands its FP32
    accumulators on under fp32 when ``tp_reduce.moe`` marked it; otherwise untouched (a grouped
    linear does no TP communication: the token dispatcher does)."""
    if state.current().tp_reduce_dtype != "fp32" or not getattr(instance, MOE_FP32_SUM, False):
        return wrapped(*args, **kwargs)
    return _hand_on_accumulator(wrapped, instance, args, kwargs, None, None)


def _hand_on_accumulator(wrapped, instance, args, kwargs, layer: Optional[Layer], parallel):
    """A routed expert's fc2 (TE ``Linear``, or ``GroupedLinear`` for grouped-GEMM experts: neither
    sums anything itself, the token dispatcher does) returns its fprop GEMM's FP32 accumulator, for
    the MoE layer's FP32 sums."""
    name = type(instance).__name__
    if layer is not None and (layer.cls != "Linear" or (layer.split(parallel) and _read(instance, "tp_size") > 1)):
        raise UnsupportedConfigurationError(
            f"megapatch tp_reduce_dtype='fp32': {name} ({layer.cls}, {parallel!r}, tp_size "
            f"{_read(instance, 'tp_size')}) is marked to hand its FP32 output on to the MoE layer, but "
            f"it reduces over TP itself. Routed experts' fc2 (TE runs it without a TP reduction) is covered",
            hint="Use tp_reduce_dtype='fp32-accumulate' or 'native' for this model.")
    handed = _HandedOn(name)
    with scoped(_row_forward, None), scoped(_handed_on, handed):
        result = wrapped(*args, **kwargs)
    out = result[0] if isinstance(result, (tuple, list)) else result
    if (handed.intercepted != 1 or out.data_ptr() != handed.rounded.data_ptr()
            or out.numel() != handed.rounded.numel()):
        raise UpstreamSurfaceError(
            f"megapatch tp_reduce_dtype='fp32': {name}.forward (a routed expert's fc2) made "
            f"{handed.intercepted} recognised fprop GEMM(s) and did not return that GEMM's output as it is: "
            f"a GEMM-fused bias, FP8 output, or a changed Transformer Engine forward",
            hint="Use tp_reduce_dtype='fp32-accumulate' or 'native'.")
    full = _AccumulatorOut.apply(out, handed.accumulator)
    return (full, *result[1:]) if isinstance(result, (tuple, list)) else full


def _refuse_unsupported(instance, layer: Layer, mode: str) -> None:
    name = f"{type(instance).__name__} ({_read(instance, 'tp_size')}-way tensor parallel)"
    flags = [f for f in layer.ub_reducing if _read(instance, f)]
    config = getattr(instance, "config", None)  # megatron-core's TELinear & co. keep theirs
    megatron_ub = bool(getattr(config, "tp_comm_overlap", False)) and any(
        getattr(config, f, True) for f in ("tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad",
                                           "tp_comm_bulk_wgrad"))
    if flags or megatron_ub:
        backend = "cuBLASMp" if _using_cublasmp() else "Userbuffers"
        found = f"{', '.join(flags)} set on the layer" if flags else "megatron tp_comm_overlap=True"
        raise UnsupportedConfigurationError(
            f"megapatch tp_reduce_dtype={mode!r} cannot be honoured for {name}: comm+GEMM overlap "
            f"({found}) makes {backend} reduce-scatter inside the GEMM kernel, in the activation "
            f"dtype, out of megapatch's reach. Turn the reduce-scatter overlaps off (TE: no "
            f"ub_overlap_rs/ub_overlap_rs_dgrad/ub_bulk_wgrad; Megatron: no --tp-comm-overlap, or "
            f"tp_comm_overlap_rs=tp_comm_overlap_rs_dgrad=tp_comm_bulk_wgrad=False), or set "
            f"tp_reduce_dtype='native'.")
    if torch.compiler.is_compiling():
        raise UnsupportedConfigurationError(
            f"megapatch tp_reduce_dtype={mode!r} cannot be honoured for {name} under torch.compile: "
            f"the compiled layer (TE >= 2.20 custom op) does not run megapatch's Python wrappers. "
            f"Run the tensor-parallel TE layers eagerly (torch.compiler.disable, or compile only "
            f"other parts), or set tp_reduce_dtype='native'.")


def _using_cublasmp() -> bool:
    base = sys.modules.get(f"{TE}.module.base")
    probe = getattr(base, "using_cublasmp_backend", None)  # TE >= 2.17
    return bool(probe()) if probe is not None else False


def _read(obj, attr: str):
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise UpstreamSurfaceError(
            f"megapatch: {type(obj).__module__}.{type(obj).__qualname__} has no attribute {attr!r}, "
            f"which the tp_reduce_dtype patch reads") from None


# -- the fprop GEMM of a row-parallel forward returns its FP32 accumulator (mode fp32) -----------

def _is_row_fprop(kwargs) -> bool:
    """TE's fprop call: ``general_gemm(weight, input, quantization_params=..., out_dtype=...,
    bias=..., use_split_accumulator=..., ub=..., ub_type=..., extra_output=...)`` -- layout TN, no
    ``out``/``grad``/``accumulate``/``gelu`` (this also tells LayerNormMLP's fc1 apart: it passes
    ``gelu=`` and no ``extra_output=``). Row-parallel bias is never fused (added after the
    reduction), and the output is not quantized."""
    return ("extra_output" in kwargs and kwargs["extra_output"] is None
            and kwargs.get("out_dtype") in LOW_PRECISION
            and kwargs.get("layout", "TN") == "TN"
            and not kwargs.get("grad") and not kwargs.get("accumulate") and not kwargs.get("gelu")
            and kwargs.get("out") is None and kwargs.get("bias") is None
            and kwargs.get("quantization_params") is None
            and kwargs.get("ub") is None and kwargs.get("ub_type") is None)


def _general_gemm(wrapped, instance, args, kwargs):
    handed = _handed_on.get()
    if handed is not None and _is_row_fprop(kwargs):
        result = wrapped(*args, **dict(kwargs, out_dtype=torch.float32))
        handed.accumulator = result[0]
        handed.rounded = result[0].to(kwargs["out_dtype"])
        handed.intercepted += 1
        return type(result)((handed.rounded, *result[1:]))
    ctx = _row_forward.get()
    if ctx is None or not _is_row_fprop(kwargs):
        return wrapped(*args, **kwargs)
    dtype = kwargs["out_dtype"]
    # the reduction of this output follows: same mode check (and cross-rank check) as there
    probe = torch.empty((), dtype=dtype, device="meta")
    if reduction_mode(probe, ctx.group) != "fp32":
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **dict(kwargs, out_dtype=torch.float32))
    if result[0].dtype != torch.float32:
        raise UpstreamSurfaceError(
            f"megapatch asked general_gemm for an FP32 output in {ctx.layer}.forward and got "
            f"{result[0].dtype}")
    ctx.pending.append(result[0])
    ctx.dtype = dtype
    ctx.intercepted += 1
    return result


def _is_grouped_fprop(args, kwargs) -> bool:
    """``GroupedLinear``'s fprop call: ``general_grouped_gemm(weights, inputs, [out], quantizers,
    dtype, single_output=True, m_splits=..., bias=..., use_bias=..., ...)`` -- layout TN, one
    low-precision output, no quantizer, no bias, GELU, gradient or accumulation."""
    out = argument(args, kwargs, 2, "out", None)
    quantizers = argument(args, kwargs, 3, "quantization_params", None) or ()
    return (isinstance(out, (list, tuple)) and len(out) == 1 and out[0].dtype in LOW_PRECISION
            and kwargs.get("single_output") is True and kwargs.get("layout", "TN") == "TN"
            and not kwargs.get("grad") and not kwargs.get("accumulate") and not kwargs.get("gelu")
            and not kwargs.get("use_bias") and kwargs.get("D_dtype") is None
            and all(q is None for q in quantizers))


def _general_grouped_gemm(wrapped, instance, args, kwargs):
    handed = _handed_on.get()
    if handed is None or not _is_grouped_fprop(args, kwargs):
        return wrapped(*args, **kwargs)
    out = argument(args, kwargs, 2, "out")
    accumulator = torch.empty_like(out[0], dtype=torch.float32)
    if len(args) > 2:
        args = (*args[:2], [accumulator], *args[3:])
    else:
        kwargs = dict(kwargs, out=[accumulator])
    result = wrapped(*args, **kwargs)
    out[0].copy_(accumulator)  # TE goes on with the rounded output
    handed.accumulator, handed.rounded = accumulator, out[0]
    handed.intercepted += 1
    return type(result)((out[0], *result[1:]))


def _claim(tensor) -> Optional[_RowForward]:
    """The row-parallel forward whose FP32 accumulator ``tensor`` is (claimed now), else None.
    A low-precision tensor reduced by a row-parallel forward in mode fp32 means its GEMM was not
    recognised: refused rather than summed from rounded partials."""
    ctx = _row_forward.get()
    if ctx is None:
        return None
    if ctx.claim(tensor):
        return ctx
    if tensor.dtype in LOW_PRECISION:
        raise UpstreamSurfaceError(
            f"megapatch tp_reduce_dtype='fp32': {ctx.layer}.forward reduces a {tensor.dtype} output "
            f"that did not come from an FP32-accumulator GEMM ({ctx.intercepted} intercepted). Its "
            f"fprop GEMM was not recognised: FP8 output (fp8_output=True), a debug quantizer, a "
            f"GEMM-fused bias, or a changed Transformer Engine",
            hint="Use tp_reduce_dtype='fp32-accumulate' (FP32 sum of the rounded partials) or 'native'.")
    return None


# -- the reductions -------------------------------------------------------------------------------

def _group(group):
    return c10d.group.WORLD if group is None else group


def _allreduce(wrapped, instance, args, kwargs):
    inp = argument(args, kwargs, 0, "inp")
    group = argument(args, kwargs, 1, "tp_group", None)
    async_op = argument(args, kwargs, 2, "async_op", False)
    ctx = _claim(inp)
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


def _symmetric_all_reduce(wrapped, instance, args, kwargs):
    global _symmetric_noted
    if argument(args, kwargs, 2, "async_op", False):
        return wrapped(*args, **kwargs)  # TE refuses async symmetric all-reduce itself
    if not _symmetric_noted and state.current().tp_reduce_dtype in fp32_collectives.MODES:
        _symmetric_noted = True
        log.warning("megapatch: tp_reduce_dtype=%r sums symmetric_ar_type all-reduces with its own "
                    "FP32 all-reduce, not TE's symmetric-memory kernel",
                    state.current().tp_reduce_dtype)
    return _allreduce(wrapped, instance, args, kwargs)


def _reduce_scatter_along_first_dim(wrapped, instance, args, kwargs):
    inp = argument(args, kwargs, 0, "inp")
    group = argument(args, kwargs, 1, "tp_group", None)
    async_op = argument(args, kwargs, 2, "async_op", False)
    output = argument(args, kwargs, 3, "output", None)
    ctx = _claim(inp)
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
    for op in _read(fuser, "_basic_ops"):
        for path in OPS_REDUCING:
            cls = _op_class(path)
            if not isinstance(op, cls):
                continue
            if cls.__name__ == "BasicLinear":
                reduces = (_read(op, "tensor_parallel_mode") in ("row", "column")
                           and _read(op, "tensor_parallel_size") > 1)
            else:
                group = _read(op, "process_group")
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
        yield Target(layer.module, f"{layer.cls}.forward", _layer_forward(layer), kind="method",
                     params=("self", "inp"))
        # the same function objects live in the other layers' modules and in context-parallel
        # attention: wrap this module's name only
        yield Target(layer.module, "general_gemm", _general_gemm, params=("A", "B"),
                     rebind_aliases=False)
        yield Target(layer.module, "allreduce", _allreduce, params=REDUCE_PARAMS["allreduce"],
                     rebind_aliases=False)
        yield Target(layer.module, "reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim,
                     params=REDUCE_PARAMS["reduce_scatter_along_first_dim"][:3], rebind_aliases=False)
        yield Target(layer.module, "symmetric_all_reduce", _symmetric_all_reduce,
                     params=REDUCE_PARAMS["symmetric_all_reduce"], rebind_aliases=False)
    yield Target(FUSER, "OperationFuser.__call__", _fuser_call, kind="method", params=("self", "input"))
    yield Target(GROUPED_LINEAR, "GroupedLinear.forward", _grouped_forward, kind="method", params=("self", "inp"))
    yield Target(GROUPED_LINEAR, "general_grouped_gemm", _general_grouped_gemm, params=("A", "B", "out"),
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
