"""``tp_invariant`` on the Transformer Engine layers megatron-core builds (``--transformer-impl
transformer_engine``, Megatron-LM's default): the model keeps its TE modules, parameters and
checkpoint names (``linear_qkv.layer_norm_weight``, ``linear_fc1.weight``, ...); under the mode their
forward runs the mode's arithmetic on those parameters instead of TE's kernels, as it does for the
local layers.

* ``TEColumnParallelLinear`` / ``TERowParallelLinear`` (``TELinear.forward``): the column- and
  row-parallel block GEMMs and fixed-tree TP sums of ``block_tree`` (``ColumnParallel``,
  ``RowParallel``), sequence parallelism by the tree's own gather and slice, a row-parallel bias
  added after the sum with its gradient through the token tree; a gated fc1 (SwiGLU) split into
  gate and up blocks as for the local layers.
* ``TELayerNormColumnParallelLinear``: its fused norm (LayerNorm or RMSNorm, zero-centred gamma) is
  per token; the norm's weight (and bias) gradient, a sum over tokens, goes through the token tree
  (``TokenBlockedAffine``: across TP under sequence parallelism, where upstream all-reduces it as a
  sequence-parallel parameter), then the column-parallel block GEMMs on the normalised rows.
* ``TEDotProductAttention``: megatron-core's local ``DotProductAttention`` with the same arguments,
  per head as for local layers (TE's flash and fused kernels choose their blocking by shape).
  Built from the arguments recorded when the TE module was built under the mode.
* TE's ``RMSNorm``/``LayerNorm`` (``TENorm``: final and QK norms) are covered by the mode's norm
  handling (``tp_invariant``'s ``_norm_affine``).
* Routed experts built from TE layers (``TEColumnParallelLinear``/``TERowParallelLinear`` in a
  ``SequentialMLP``; TE runs them with ``parallel_mode=None`` where the token dispatcher does their
  TP communication): the local experts' arithmetic, read from the running expert call
  (``numerics.expert_call``: fc2's input scaled by the routing probabilities in the fixed tree, each
  source rank's rows one block, the expert-TP group megatron-core gives the layer).
* Grouped-GEMM experts (``TEGroupedMLP``, ``--moe-grouped-gemm``: one ``TEGroupedLinear`` per fc
  holding expert ``i``'s weight as ``weight<i>``): upstream's forward run once per local expert on its
  rows (``tp_invariant.te_grouped_experts``), each ``TEGroupedLinear`` call the block GEMMs of that
  expert's weight (here), as for sequential experts (a grouped GEMM's blocking depends on every expert's token count; this does not). The
  weights keep their names; the grad norm takes the dims TP splits (TE gives them no TP attributes).

Refused under the mode, when the model is built (and by ``megapatch doctor`` from the flags), naming
the flag: grouped-GEMM experts without TE (``--moe-grouped-gemm --transformer-impl local``, refused by
``tp_invariant.moe``), expert biases, a duplicated ``TELinear``, ``return_layernorm_output``, FP8/FP4,
communication overlap (``--tp-comm-overlap``), ``--delay-wgrad-compute``, TE's activation kernels
(``--use-te-activation-func``, refused by ``tp_invariant``).
"""

from __future__ import annotations

from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics import expert_call, fp32_output_linear
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import block_linear
from megapatch.numerics import token_tree
from megapatch.patches._common import MEGATRON_CORE_TP_INVARIANT_TESTED
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant, tp_invariant_patch, tp_invariant_with_te

TE = "megatron.core.extensions.transformer_engine"

_LOCAL_ATTENTION = "_megapatch_local_attention"  # on a TEDotProductAttention: its local twin
_ATTENTION_ARGS = "_megapatch_attention_args"  # on a TEDotProductAttention: its constructor's arguments
_LOCAL = "use --transformer-impl local"

#: config field -> (refused for this value, Megatron-LM flag, why) for models built from TE layers
_REFUSED_TE_CONFIG = {
    "fp8": (bool, "--fp8-format", "FP8 GEMMs quantize the operands the mode's block GEMMs keep in BF16"),
    "fp4": (bool, "--fp4-format", "FP4 GEMMs quantize the operands the mode's block GEMMs keep in BF16"),
    "tp_comm_overlap": (bool, "--tp-comm-overlap", "Userbuffers overlap runs the TP collectives inside TE's GEMMs"),
    "delay_wgrad_compute": (bool, "--delay-wgrad-compute", "the deferred wgrad runs outside the layer"),
}


def _refuse(what: str, why: str):
    refuse_tp_invariant(what, why)


def te_refusals(config) -> list:
    """``[(what, why), ...]`` for a model built from TE layers."""
    found = []
    for field, (refused, flag, why) in _REFUSED_TE_CONFIG.items():
        value = getattr(config, field, None)
        if refused(value):
            found.append((f"{field}={value!r} with Transformer Engine layers (Megatron-LM: {flag})", why))
    return found


# -- linear layers -----------------------------------------------------------------------------

def _tp(layer):
    """``(TP group, TP size)`` of a TE linear layer."""
    group = getattr(layer, "tp_group", None)
    return group, tpi.group_size(group)


def _check_linear(layer, expert: bool = False) -> None:
    """TE's column- and row-parallel linears, and a routed expert's (whose TP communication the
    token dispatcher does: TE runs it with ``parallel_mode=None``)."""
    mode = getattr(layer, "parallel_mode", None)
    if mode not in ("column", "row") and not (expert and mode is None):
        _refuse(f"{type(layer).__qualname__} with parallel_mode={mode!r} (a duplicated TE linear)",
                f"the mode covers TE's column- and row-parallel linears and routed experts' linears; {_LOCAL}")


def _bias(layer):
    """The layer's bias parameter, or None (TE keeps an empty tensor when it has none)."""
    return layer.bias if getattr(layer, "use_bias", False) and layer.bias.numel() else None


def _returns_bias(layer) -> bool:
    return bool(getattr(layer, "te_return_bias", False))


def _column(layer, x):
    """``(output, bias or None)``: the column-parallel block GEMMs on ``x`` ([s(/t), b, in])."""
    group, t = _tp(layer)
    if getattr(layer, "sequence_parallel", False) and t > 1:
        x = block_linear.GatherSequence.apply(x, group)  # the dgrad's tree sum, then this rank's slice
    weight, bias = layer.weight, _bias(layer)
    nb = tpi.blocks_per_rank(group)
    halves = getattr(weight, tpi.GATED_HALVES, 1)
    tpi.check_divisible(f"{type(layer).__name__} output features" + (" (each of gate, up)" if halves == 2 else ""),
                        weight.shape[0] // halves * t, weight.shape[0] // halves, group)
    inside = None if _returns_bias(layer) else bias
    out = block_linear.ColumnParallel.apply(x, weight, inside, group, t > 1, nb,
                                   fp32_output_linear.requested_output_dtype(), halves, False, None)
    return out, (bias if inside is None else None)


def _row(layer, x):
    group, t = _tp(layer)
    weight = layer.weight
    nb = tpi.blocks_per_rank(group)
    tpi.check_divisible(f"{type(layer).__name__} input features", weight.shape[1] * t, weight.shape[1], group)
    out = block_linear.RowParallel.apply(x, weight, group, nb, False, None)
    split = bool(getattr(layer, "sequence_parallel", False)) and t > 1
    if split:  # this rank's part of the sequence of the fixed-tree sum: upstream's reduce-scatter
        out = block_linear.ScatterSequence.apply(out, group)
    bias = _bias(layer)
    if bias is not None:  # its gradient sums over tokens: token blocks in the fixed tree
        bias = token_tree.TokenBlockedBias.apply(bias, out.shape, group, tpi.token_blocks(out, group, split), split)
    if _returns_bias(layer):
        return out, bias
    return (out + bias if bias is not None else out), None


def _expert(layer, x, call):
    """A routed expert's fc1 or fc2 (``TEColumnParallelLinear``/``TERowParallelLinear`` inside a
    ``SequentialMLP``, or expert ``call.index``'s weight of a grouped-GEMM layer's ``TEGroupedLinear``)
    as the mode runs a local expert's: the expert-TP group megatron-core gives the layer, the
    dispatcher's communication left to the dispatcher (TE's ``parallel_mode=None``: the input gathered
    and the dgrad summed by it, fc2's output kept on expert-TP rank 0 for its reduce-scatter), fc2's
    input scaled by the routing probabilities inside the fixed tree, each source rank's rows one block."""
    _check_linear(layer, expert=True)
    if getattr(layer, "use_bias", False):
        _refuse("expert biases with Transformer Engine expert layers (Megatron-LM: --disable-bias-linear)",
                "upstream's expert MLP adds them scaled by the routing probabilities outside the GEMM")
    group = getattr(layer, "_tp_group", None)  # megatron-core's: the expert-TP group for an expert
    nb = tpi.blocks_per_rank(group)
    dispatched = layer.parallel_mode is None  # the token dispatcher gathers and sums over expert TP
    t = tpi.group_size(group)
    weight = layer.weight if call.index is None else getattr(layer, f"weight{call.index}")
    if layer is call.mlp.linear_fc1:
        halves = getattr(weight, tpi.GATED_HALVES, 1)
        what = f"{type(layer).__name__} expert output features" + (" (each of gate, up)" if halves == 2 else "")
        tpi.check_divisible(what, weight.shape[0] // halves * t, weight.shape[0] // halves, group)
        out = block_linear.ColumnParallel.apply(x, weight, None, group, True, nb, None, halves, dispatched, call.sources)
        return out, None
    tpi.check_divisible(f"{type(layer).__name__} expert input features", weight.shape[1] * t, weight.shape[1], group)
    x = token_tree.ScaledRows.apply(x, call.probabilities, group, nb)
    return block_linear.RowParallel.apply(x, weight, group, nb, dispatched, call.sources), None


def _linear_forward(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    x = argument(args, kwargs, 0, "x")
    call = expert_call.of(instance)
    if call is not None:
        return _expert(instance, x, call)
    _check_linear(instance)
    return _column(instance, x) if instance.parallel_mode == "column" else _row(instance, x)


def _grouped_linear_forward(wrapped, instance, args, kwargs):
    """``TEGroupedLinear.forward(x, m_splits)``: under the mode, one expert's rows at a time (its
    ``TEGroupedMLP``'s wrapper runs the experts one by one), with that expert's weight."""
    if not tpi.active():
        return wrapped(*args, **kwargs)
    call = expert_call.of(instance)
    if call is None or call.index is None:
        _refuse(f"a {type(instance).__name__} outside a TEGroupedMLP's experts",
                "the mode runs a grouped linear one expert at a time, for its grouped-GEMM experts")
    return _expert(instance, argument(args, kwargs, 0, "x"), call)


def _normalise(layer):
    import torch.nn.functional as F

    shape = (layer.layer_norm_weight.shape[0],)
    if layer.normalization == "RMSNorm":
        return lambda x: F.rms_norm(x, shape, None, layer.eps)
    if layer.normalization == "LayerNorm":
        return lambda x: F.layer_norm(x, shape, None, None, layer.eps)
    _refuse(f"{type(layer).__qualname__} with normalization={layer.normalization!r}",
            "the mode covers LayerNorm and RMSNorm")


def _layernorm_linear_forward(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    _check_linear(instance)
    if getattr(instance, "return_layernorm_output", False):
        _refuse(f"{type(instance).__qualname__} returning its norm's output",
                "the norm's output is then used outside the layer, unrounded as TE keeps it")
    x = argument(args, kwargs, 0, "x")
    group, t = _tp(instance)
    weight = instance.layer_norm_weight
    if getattr(instance, "zero_centered_gamma", False):
        weight = weight + 1
    bias = getattr(instance, "layer_norm_bias", None) if instance.normalization == "LayerNorm" else None
    split = bool(getattr(instance, "sequence_parallel", False)) and t > 1
    normed = token_tree.TokenBlockedAffine.apply(_normalise(instance)(x.float()), weight, bias, group,
                                          tpi.token_blocks(x, group, split), split, x.dtype)
    return _column(instance, normed)


# -- attention -----------------------------------------------------------------------------------

_ATTENTION_PARAMS = ("config", "layer_number", "attn_mask_type", "attention_type", "attention_dropout",
                     "softmax_scale", "k_channels", "v_channels", "num_splits", "cp_comm_type", "pg_collection")


def _attention_init(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if tpi.active():
        setattr(instance, _ATTENTION_ARGS, {name: argument(args, kwargs, i, name, None)
                                            for i, name in enumerate(_ATTENTION_PARAMS)})
    return result


def _local_attention(te_attention):
    local = getattr(te_attention, _LOCAL_ATTENTION, None)
    if local is not None:
        return local
    recorded = getattr(te_attention, _ATTENTION_ARGS, None)
    if recorded is None:
        _refuse("a TEDotProductAttention built before tp_invariant was switched on",
                "the mode builds its per-head attention from the arguments the TE module was built with")
    if recorded["k_channels"] is not None or recorded["v_channels"] is not None:
        _refuse("TEDotProductAttention with k_channels/v_channels (multi-latent attention)",
                f"the local attention the mode runs has one head dimension; {_LOCAL}")
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    kwargs = {name: recorded[name] for name in ("attention_dropout", "softmax_scale", "cp_comm_type",
                                                 "pg_collection") if recorded[name] is not None}
    local = DotProductAttention(recorded["config"], recorded["layer_number"], recorded["attn_mask_type"],
                                recorded["attention_type"], **kwargs)
    # a plain attribute, not a submodule: no parameters, no state dict entries, checkpoints unchanged
    object.__setattr__(te_attention, _LOCAL_ATTENTION, local)
    return local


def _attention_forward(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    local = _local_attention(instance)
    local.train(instance.training)
    # packed (THD) sequences too: the mode's local attention attends each sequence of the bin alone
    # and returns TE's THD output layout, [t, heads x dim]; a CP group in them is refused there
    return local(argument(args, kwargs, 0, "query"), argument(args, kwargs, 1, "key"),
                 argument(args, kwargs, 2, "value"), argument(args, kwargs, 3, "attention_mask"),
                 attn_mask_type=argument(args, kwargs, 4, "attn_mask_type", None),
                 attention_bias=argument(args, kwargs, 5, "attention_bias", None),
                 packed_seq_params=argument(args, kwargs, 6, "packed_seq_params", None))


# -- construction --------------------------------------------------------------------------------

def _linear_init(wrapped, instance, args, kwargs):
    """Refuse, when a TE linear layer is built, what the mode does not cover (``tp_invariant``'s
    block construction refuses TE modules other than the covered ones)."""
    result = wrapped(*args, **kwargs)
    if tpi.active():
        config = argument(args, kwargs, 99, "config", None)
        refusals = te_refusals(config) if config is not None else []
        if refusals:
            _refuse(*refusals[0])
        _check_linear(instance, expert=bool(argument(args, kwargs, 99, "is_expert", False)))
    return result


def _preflight(config):
    """From a Megatron-LM job's flags (``megapatch doctor``): ``--transformer-impl`` says which layers."""
    if getattr(config, "transformer_impl", "local") != "transformer_engine":
        return None
    refusals = te_refusals(config)
    return "; ".join(f"does not support {what}: {why}" for what, why in refusals) or None


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.transformer_engine",
        summary="Transformer Engine layers under tp_invariant: TE column/row-parallel linears and the fused "
                "norm of TELayerNormColumnParallelLinear through the mode's block GEMMs and token tree, "
                "TE routed experts (SequentialMLP, grouped GEMM) as the local experts, TEDotProductAttention as "
                "megatron-core's local per-head attention (TE parameters and checkpoint names kept); "
                "FP8/FP4, comm overlap refused at construction",
        hook=TE,
        package="transformer-engine",  # megatron-core's TE wrappers: nothing to patch without TE
        # run on TE 2.20.2 only (the CPU runtime's release; CI's te stage): elsewhere megapatch warns
        supports={**MEGATRON_CORE_TP_INVARIANT_TESTED, "transformer-engine": "==2.20.2"},
        applies=tp_invariant_with_te,
        targets=(
            Target(TE, "TELinear.forward", _linear_forward, kind="method", params=("self", "x")),
            Target(TE, "TELayerNormColumnParallelLinear.forward", _layernorm_linear_forward, kind="method",
                   params=("self", "x")),
            Target(TE, "TEDotProductAttention.__init__", _attention_init, kind="method",
                   params=("self", "config", "layer_number", "attn_mask_type", "attention_type")),
            Target(TE, "TEDotProductAttention.forward", _attention_forward, kind="method",
                   params=("self", "query", "key", "value", "attention_mask", "attn_mask_type")),
            Target(TE, "TELinear.__init__", _linear_init, kind="method", params=("self", "input_size", "output_size")),
            Target(TE, "TELayerNormColumnParallelLinear.__init__", _linear_init, kind="method",
                   params=("self", "input_size", "output_size")),
            Target(TE, "TEGroupedLinear.forward", _grouped_linear_forward, kind="method", params=("self", "x")),
            Target(TE, "TEGroupedLinear.__init__", _linear_init, kind="method",
                   params=("self", "num_gemms", "input_size", "output_size")),
        ),
        preflight=_preflight,
    ),
)
