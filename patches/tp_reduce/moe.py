"""FP32 sums in megatron-core's mixture-of-experts layers (``tp_reduce_dtype='fp32'``).

Upstream (core_v0.16.1, ``transformer/moe``): an expert's row-parallel fc2 leaves its TP reduction
to the token dispatcher (``explicit_expert_comm``). The dispatcher casts the partials to the
router probabilities' dtype and sums them over expert TP (allgather: over TP x EP) with a
reduce-scatter; ``unpermute`` adds each token's top-k expert outputs with ``scatter_add``; the
shared experts' output is added last. With BF16 activations every one of those sums rounds, and
the partials are rounded to BF16 before any of them.

Under ``fp32``, inside an MoE layer:

* every ``RowParallelLinear`` (routed experts' and shared experts' fc2) hands on its FP32 GEMM
  accumulator, after its own reduction if it does one (``tp_reduce.megatron_core``);
* the dispatchers carry that FP32 tensor through their reduce-scatter and all-to-all (the cast
  to the probabilities' dtype is skipped for it), so the TP x EP sum, the top-k combine and the
  shared-expert add all run in FP32;
* the layer's output is rounded once, to the dtype of its input.

``fp32-accumulate`` keeps its documented meaning here too: partials travel in their own dtype
(rounded once by the GEMM), each rank sums what it receives in FP32.

Routed experts built from Transformer Engine layers (``TERowParallelLinear`` fc2 in a
``SequentialMLP``, ``TERowParallelGroupedLinear`` in a ``TEGroupedMLP``: ``--moe-grouped-gemm``)
hand on their FP32 accumulator too (``tp_reduce.transformer_engine``).

Refused at construction under ``fp32`` (what this does not reach): the ``flex`` dispatcher
(DeepEP/HybridEP kernels sum inside the fused all-to-all), grouped-GEMM experts without TE (the
``grouped_gemm`` package's ``GroupedMLP`` has no fc2 module), shared experts built from TE layers, TE
expert biases. The router
needs nothing: its gating weight is replicated and its input is the TP-reduced hidden state; ``moe_router_dtype='fp32'`` (upstream) composes, making
the probabilities and so the dispatcher's cast FP32 as well. Aux-loss reductions sum integer
token counts (exact) and FP32 loss values.
"""

from __future__ import annotations

import contextlib

import torch

from megapatch.core import state
from megapatch.core.call_args import argument
from megapatch.core.errors import UnsupportedConfigurationError, UpstreamSurfaceError
from megapatch.core.registry import Patch, Target
from megapatch.numerics.dtypes import LOW_PRECISION
from megapatch.patches._common import LEGACY_GROUPED_EXPERTS, MEGATRON_CORE_TP_REDUCE_TESTED
from megapatch.patches.tp_reduce._reduction import MOE_FP32_SUM

MOE_LAYER = "megatron.core.transformer.moe.moe_layer"
DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
COVERED_DISPATCHERS = ("allgather", "alltoall")

#: what status, the job-log line and the doctor say this patch covers and leaves out
COVERAGE = ("routed experts' fc2 partials (SequentialMLP, local or TE layers; TE's grouped GEMM) and shared "
            "experts (local layers, with or without overlap) kept FP32 through the allgather/alltoall dispatchers' "
            "reduce-scatter and all-to-all and the top-k combine, rounded once at the MoE layer output; refused: "
            "flex dispatcher, grouped-GEMM experts without TE, TE shared experts")


def _active() -> bool:
    return state.current().tp_reduce_dtype == "fp32"


def _refusals(config) -> list:
    found = []
    dispatcher = getattr(config, "moe_token_dispatcher_type", "allgather")
    if dispatcher not in COVERED_DISPATCHERS:
        found.append(
            f"moe_token_dispatcher_type={dispatcher!r} (Megatron-LM: --moe-token-dispatcher-type "
            f"{dispatcher}; covered: {', '.join(COVERED_DISPATCHERS)}): its fused all-to-all sums the "
            f"experts' outputs where megapatch cannot keep them FP32")
    if getattr(config, "moe_grouped_gemm", False) and getattr(config, "transformer_impl", None) == "local":
        found.append(_LEGACY_GROUPED)  # (a built layer is judged by its experts' type: _mark)
    return found


def _refuse(found: list) -> None:
    raise UnsupportedConfigurationError(
        f"megapatch tp_reduce_dtype='fp32' does not cover this MoE layer: {'; '.join(found)}. "
        f"tp_reduce_dtype was set by {state.origin('tp_reduce_dtype')}; tp_reduce_dtype='fp32-accumulate' "
        f"(partials on the wire in their own dtype) or 'native' run it.")


def _preflight(config):
    if not getattr(config, "num_moe_experts", None):
        return None
    found = _refusals(config)
    # from a job's flags only: a built layer is judged by its modules (_mark)
    te = getattr(config, "transformer_impl", None) == "transformer_engine"
    if getattr(config, "moe_grouped_gemm", False) and not te and _LEGACY_GROUPED not in found:
        found.append(_LEGACY_GROUPED)
    if te and getattr(config, "moe_shared_expert_intermediate_size", None):
        found.append("shared experts with Transformer Engine layers (Megatron-LM: --moe-shared-expert-intermediate-size "
                     "with --transformer-impl transformer_engine; --transformer-impl local covers them): their fc2 "
                     "reduces over TP inside TE, rounded before the MoE layer's FP32 sum")
    return "; ".join(found) or None


def _mark(layer) -> None:
    """Every fc2 of the layer's experts and shared experts hands on FP32 (read by
    ``tp_reduce.megatron_core``'s RowParallelLinear wrapper); refused when one is not a megatron-core
    RowParallelLinear. The mark is structure, not a setting: an activation-checkpoint recompute of
    the experts sees it too."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    found = _refusals(layer.config)
    fc2s = [(f"{part}.{name}", module) for part in ("experts", "shared_experts")
            if getattr(layer, part, None) is not None
            for name, module in getattr(layer, part).named_modules(prefix="") if name.endswith("linear_fc2")]
    experts = getattr(layer, "experts", None)
    if experts is not None and not any(name.startswith("experts.") for name, _ in fc2s):
        found.append(f"experts of type {type(experts).__qualname__}: {_LEGACY_GROUPED}")
    for name, module in fc2s:
        if isinstance(module, RowParallelLinear):
            continue
        if _te_routed_fc2(name, module):
            if getattr(module, "use_bias", False):
                found.append(f"{name}: a Transformer Engine expert fc2 with a bias (Megatron-LM: "
                             f"--disable-bias-linear): TE fuses it into the GEMM megapatch keeps in FP32")
            continue
        te = "transformer_engine" in type(module).__module__
        found.append(f"{name} of type {type(module).__qualname__}"
                     + (" (Transformer Engine shared experts; Megatron-LM: --transformer-impl local)" if te else "")
                     + ": its partials would be rounded before the dispatcher sums them (covered: megatron-core's "
                       "RowParallelLinear, and TE's TERowParallelLinear as a routed expert's fc2)")
    if found:
        _refuse(found)
    for _, module in fc2s:
        setattr(module, MOE_FP32_SUM, True)


_LEGACY_GROUPED = f"{LEGACY_GROUPED_EXPERTS}: they have no fc2 layer megapatch can keep in FP32"


def _te_routed_fc2(name: str, module) -> bool:
    """A routed expert's fc2 built from Transformer Engine (megatron-core's ``TERowParallelLinear`` in
    a ``SequentialMLP``, or ``TERowParallelGroupedLinear`` in a ``TEGroupedMLP``): TE runs it without
    a TP reduction, and ``tp_reduce.transformer_engine`` hands its FP32 accumulator on when it carries
    the mark. Shared experts' TE fc2 reduces over TP inside TE, rounded: not covered."""
    kind = type(module)
    return (name.startswith("experts.") and kind.__name__ in ("TERowParallelLinear", "TERowParallelGroupedLinear")
            and kind.__module__ == "megatron.core.extensions.transformer_engine")


def _moe_init(wrapped, instance, args, kwargs):
    if not _active():
        return wrapped(*args, **kwargs)
    found = _refusals(argument(args, kwargs, 0, "config"))
    if found:  # before upstream builds what it may not build here (flex: DeepEP)
        _refuse(found)
    result = wrapped(*args, **kwargs)
    _mark(instance)
    return result


def _moe_forward(wrapped, instance, args, kwargs):
    hidden_states = argument(args, kwargs, 0, "hidden_states")
    if not _active() or hidden_states.dtype not in LOW_PRECISION:
        return wrapped(*args, **kwargs)
    _mark(instance)  # enabled after the model was built: checked and marked now
    output, mlp_bias = wrapped(*args, **kwargs)
    if output.dtype != torch.float32:
        raise UpstreamSurfaceError(
            f"megapatch tp_reduce_dtype='fp32': the MoE layer's experts produced {output.dtype}, not "
            f"their FP32 sum (is tp_reduce.megatron_core skipped? see megapatch.status())")
    return output.to(hidden_states.dtype), mlp_bias


@contextlib.contextmanager
def _probs_as_fp32(dispatcher, name: str, hidden_states):
    """Upstream casts the expert outputs to ``dispatcher.<name>.dtype`` before summing them; for
    the call, that attribute is an FP32 copy when the outputs are FP32 sums-to-be."""
    probs = getattr(dispatcher, name, None)
    if (not _active() or hidden_states.dtype != torch.float32 or probs is None
            or probs.dtype not in LOW_PRECISION):
        yield
        return
    setattr(dispatcher, name, probs.float())
    try:
        yield
    finally:
        setattr(dispatcher, name, probs)


def _allgather_token_combine(wrapped, instance, args, kwargs):
    with _probs_as_fp32(instance, "local_probs", argument(args, kwargs, 0, "hidden_states")):
        return wrapped(*args, **kwargs)


def _alltoall_combine_preprocess(wrapped, instance, args, kwargs):
    with _probs_as_fp32(instance, "probs", argument(args, kwargs, 0, "hidden_states")):
        return wrapped(*args, **kwargs)


#: the cast each wrapped dispatcher method makes before summing; the FP32 swap relies on it
_PROBS_CASTS = (("MoEAllGatherTokenDispatcher.token_combine", ".to(self.local_probs.dtype)"),
                ("MoEAlltoAllTokenDispatcher.combine_preprocess", ".to(self.probs.dtype)"))


def _probe():
    """The dispatchers still cast the expert outputs to the probabilities' dtype by the attribute
    the swap replaces (else the swap would silently leave the partials rounded)."""
    import inspect

    from megatron.core.transformer.moe import token_dispatcher

    for qualname, cast in _PROBS_CASTS:
        owner, method = qualname.split(".")
        source = inspect.getsource(getattr(getattr(token_dispatcher, owner), method))
        if cast not in source.replace(" ", "").replace("\n", ""):
            return f"{DISPATCHER}.{qualname} no longer contains {cast!r}"
    return None


def _backend() -> str:
    return COVERAGE


PATCHES = (
    Patch(
        name="tp_reduce.moe",
        supports=MEGATRON_CORE_TP_REDUCE_TESTED,
        option="tp_reduce_dtype",
        summary="FP32 expert sums in megatron-core MoE layers (dispatcher reduce-scatter/all-to-all, top-k combine)",
        hook=MOE_LAYER,
        applies=lambda s: s.tp_reduce_dtype == "fp32",
        requires=("tp_reduce.megatron_core",),  # its RowParallelLinear wrapper hands on the FP32 sums
        backend=_backend,
        preflight=_preflight,
        probe=_probe,
        watches=(f"{DISPATCHER}:MoEAllGatherTokenDispatcher.token_combine",
                 f"{DISPATCHER}:MoEAlltoAllTokenDispatcher.combine_preprocess",
                 f"{DISPATCHER}:MoEAlltoAllTokenDispatcher.combine_postprocess",
                 "megatron.core.transformer.moe.moe_utils:unpermute"),
        targets=(
            Target(MOE_LAYER, "MoELayer.__init__", _moe_init, kind="method", params=("self", "config")),
            Target(MOE_LAYER, "MoELayer.forward", _moe_forward, kind="method",
                   params=("self", "hidden_states")),
            Target(DISPATCHER, "MoEAllGatherTokenDispatcher.token_combine", _allgather_token_combine,
                   kind="method", params=("self", "hidden_states")),
            Target(DISPATCHER, "MoEAlltoAllTokenDispatcher.combine_preprocess", _alltoall_combine_preprocess,
                   kind="method", params=("self", "hidden_states")),
        ),
    ),
)
