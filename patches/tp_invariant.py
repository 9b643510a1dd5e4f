"""Bitwise TP invariance (``tp_invariant=True``): megatron-core's local layers give the same bits
at every TP size dividing ``tp_invariant_width`` (W). The arithmetic is in ``megapatch.numerics.block_tree``.

Every TP-dependent computation of a GPT forward and backward, and where it is handled:

* ``ColumnParallelLinear._forward_impl``: the GEMM runs per block of N/W output features; the
  dgrad (summed over TP upstream) goes through the fixed tree; wgrad and bias grad per block.
* ``RowParallelLinear.forward``: the K-split GEMM and its TP all-reduce become one fixed-tree sum
  of W blocks of K/W; dgrad/wgrad per block. The bias is added after the sum, as upstream.
* ``VocabParallelCrossEntropy.calculate_predicted_logits``: the sum of exp(logits) over the vocab
  goes through the fixed tree. Its result is handed to upstream's all-reduce on TP rank 0 only
  (zeros elsewhere): a sum of one value and zeros is exact, so upstream's reduction keeps the bits.
  The logits max and the target-logit sum (one non-zero per token) are exact in any order.
* ``MLP.forward``: refusals (Transformer Engine layers and activations, fused bias-activation),
  and, for a gated linear unit (SwiGLU), marks its fc1: rank r holds [gate_r; up_r], so the column
  blocks split gate and up apart and the dgrad tree pairs gate block k with up block k
  (``block_tree.column_blocks``). The activation is elementwise and position-independent.
* ``get_grad_norm_fp32`` (inside an optimizer's ``get_grad_norm``/``clip_grad_norm``): the sum of
  squared gradients per parameter goes through the fixed tree along its partition dim, parameters
  added in their fixed order; with pipeline parallelism the stages' totals are added in stage order.
* ``TransformerBlock.__init__`` and ``DistributedOptimizer.__init__``: what the mode cannot cover
  is refused when the model or optimizer is built, before any step (the forward-time checks stay,
  for a config changed after construction): config fields, and shapes the fixed tree cannot split
  (the TP size against the width, every TP-split dimension, in a Megatron-LM job the padded
  vocabulary: ``megapatch.numerics.block_shapes``, which ``megapatch doctor`` calls too).
  ``ColumnParallelLinear.__init__`` refuses an output size the width does not divide when the
  layer is built (a GPT's output layer, outside any block).

* Mixture of experts (expert TP = TP; ``tp_invariant.moe`` and the layers above): the
  router's gating GEMM runs per block of consecutive tokens (``TokenBlockedLinear``), its weight
  gradient through the token tree like a norm's; top-k routing runs once per token block, so
  every call sees the same rows at every TP size. An expert's fc1/fc2 are ``explicit_expert_comm``
  layers whose TP sums the token dispatcher does: fc2's fixed-tree sum, and fc1's dgrad tree sum,
  are handed to it on expert-TP rank 0 only (``block_tree.on_root``), so its reduce-scatter adds
  exact zeros. The routing probability scales the activation inside fc2's wrapper
  (``ScaledRows``): its gradient, a sum over the features expert TP splits, goes through the tree.
  A token's top-k outputs are added by upstream's unpermute in expert order on one rank (with
  alltoall the token's home rank, whatever the EP size); shared experts are ordinary MLPs. Aux- and
  z-loss gradients are per token (token counts are integers), their logged values are not made
  invariant. Expert parallelism (alltoall): each source data-parallel rank's tokens are one block
  of rows in every expert GEMM (``TokenSources``; the dispatcher's TP-major chunks reordered
  EP-major), and each source's FP32 partial of an expert's weight gradient, rounded on its own, is
  a term of the exact data-parallel sum (``block_tree.source_terms``: the EP size, the DP size and
  the micro-batch count do not move it; without DDP the fixed tree over the sources,
  ``source_sum``); the grad norm adds expert parameters in (layer, global expert) order gathered
  over EP.

Exact already, untouched: the vocab-parallel embedding's all-reduce (one non-zero per token),
all-gathers, the norms' per-token work and replicated parameters' gradients (same full tensors on every rank),
core attention (per head; patches/tp_invariant_attention.py gives it one arithmetic for training and
the dynamic engine's decode steps), the MLP activation, the loss average, Adam (elementwise).

Llama-shaped models (SwiGLU, RMSNorm, RoPE, grouped-query attention with at least as many KV
groups as the TP size, untied output layer, no biases) are covered.

The distributed optimizer is covered: Adam is elementwise on its flat shards, and the grad norm
reads the full-shaped gradients from the grad buffers (gathered over data-parallel ranks first).

Sequence parallelism is covered: the row-parallel fixed-tree sum is sliced to this rank's positions
(upstream's reduce-scatter), the column-parallel input all-gathered and its dgrad's tree sum
sliced; the norms' and row-parallel biases' gradients (sums over tokens) run as token blocks in the
tree at every TP size (``TokenBlockedAffine``/``TokenBlockedBias``), across TP when SP splits the tokens.

QK layernorm (Qwen3): the per-head q/k norms' weight gradients sum over tokens and the heads TP
splits as W leaves of the fixed tree (``block_tree._head_leaves``), handed to upstream's TP
all-reduce of those gradients on rank 0 only.

Refused in this mode (with the reason): QK layernorm on a head count W cannot cut, norms other than torch's, Transformer Engine modules other than those
``tp_invariant.transformer_engine`` runs, fused
bias-activation, fewer KV groups than the TP size, gradient-accumulation fusion, deferred embedding wgrad,
MoE settings outside the covered set (``_MOE_REFUSED``: expert parallelism with allgather, expert TP other than TP,
flex dispatcher, grouped GEMM without TE, permute/router fusion, shared-expert gate and overlap, token
dropping, ...), several distributed-optimizer instances, grad norms over other ranks than TP x PP
(x DP with the distributed optimizer; expert parameters over EP), and ``tp_reduce_dtype`` other than native
(this mode already sums in FP32 through its own tree).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import torch

from megapatch.numerics import block_shapes, exact_sum, expert_call, fp32_output_linear
from megapatch.numerics import block_tree as tpi
from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.core.scope import scoped
from megapatch.patches._common import (LAYERS, LEGACY_GROUPED_EXPERTS, refuse_tp_invariant, tp_group,
                                       tp_invariant_patch, tp_invariant_verified_upstream)

CROSS_ENTROPY = "megatron.core.tensor_parallel.cross_entropy"
MLP = "megatron.core.transformer.mlp"
OPTIMIZER = "megatron.core.optimizer.optimizer"
CLIP_GRADS = "megatron.core.optimizer.clip_grads"
ROUTER = "megatron.core.transformer.moe.router"
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
MOE_LAYER = "megatron.core.transformer.moe.moe_layer"  # imports the router, the dispatchers and moe_utils

_norm_owner = contextvars.ContextVar("megapatch_tp_invariant_norm_owner", default=None)
_gated_fc1 = contextvars.ContextVar("megapatch_tp_invariant_gated_fc1", default=None)
_router_blocks = contextvars.ContextVar("megapatch_tp_invariant_router_blocks", default=None)


_refuse = refuse_tp_invariant


# -- linear layers -------------------------------------------------------------------------------

def _column_forward_impl(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    input_ = argument(args, kwargs, 0, "input")
    weight = argument(args, kwargs, 1, "weight")
    bias = argument(args, kwargs, 2, "bias", None)
    if argument(args, kwargs, 3, "gradient_accumulation_fusion", False):
        _refuse("gradient_accumulation_fusion", "its fused wgrad GEMM accumulates by shape")
    sequence_parallel = argument(args, kwargs, 5, "sequence_parallel", False)
    if argument(args, kwargs, 6, "grad_output_buffer", None) is not None:
        _refuse("defer_embedding_wgrad_compute", "the deferred wgrad runs outside this layer")
    expert = _expert_layer(instance)
    group = tp_group(instance)
    groups = getattr(getattr(instance, "config", None), "num_query_groups", None)
    if groups is not None and groups < tpi.group_size(group):
        _refuse(*_few_kv_groups(groups, tpi.group_size(group)))
    allreduce_dgrad = argument(args, kwargs, 4, "allreduce_dgrad", False)
    if expert:  # the token dispatcher gathered the input over expert TP and sums the dgrad there
        allreduce_dgrad = True
    elif (tpi.group_size(group) > 1 and not (allreduce_dgrad or sequence_parallel)
          and torch.is_grad_enabled() and input_.requires_grad):  # no dgrad, nothing to reduce (inference)
        _refuse("a column-parallel layer whose dgrad is reduced outside it",
                "that reduction would sum TP partials natively")
    if sequence_parallel and tpi.group_size(group) > 1:
        # the dgrad's fixed-tree TP sum, then this rank's slice, replaces upstream's reduce-scatter
        input_ = tpi.GatherSequence.apply(input_, group)
        allreduce_dgrad = True
    nb = tpi.blocks_per_rank(group)
    halves = 2 if _gated_fc1.get() is instance else 1  # SwiGLU's fc1: [gate_r; up_r] on rank r
    tpi.check_divisible(f"{type(instance).__name__} output features" + (" (each of gate, up)" if halves == 2 else ""),
                        weight.shape[0] // halves * tpi.group_size(group), weight.shape[0] // halves, group)
    # logits_dtype="fp32" asks the LM head for its FP32 accumulator, unrounded
    out_dtype = fp32_output_linear.requested_output_dtype()
    return tpi.ColumnParallel.apply(input_, weight, bias, group, allreduce_dgrad, nb, out_dtype, halves, expert,
                                    expert_call.sources(instance))


def _expert_layer(layer) -> bool:
    """A routed expert's linear layer whose TP communication the token dispatcher does
    (``explicit_expert_comm``: with expert TP or expert parallelism)."""
    return bool(getattr(layer, "explicit_expert_comm", False))


def _column_init(wrapped, instance, args, kwargs):
    """A column-parallel layer whose outputs the width cannot split is refused when it is built:
    the layers of a transformer block are checked from its config before (``_block_init``), so
    this catches the others, a GPT's output layer (the padded vocabulary) first of all."""
    result = wrapped(*args, **kwargs)
    if tpi.active():
        group = tp_group(instance)
        tpi.blocks_per_rank(group)
        outputs = argument(args, kwargs, 1, "output_size")
        vocabulary = block_shapes.megatron_lm_vocabulary()
        if vocabulary is not None and vocabulary.padded_vocab_size == outputs:
            refusal = block_shapes.vocabulary_refusal(vocabulary, tpi.group_size(group))
            if refusal:
                _refuse(*refusal)
        tpi.check_divisible(f"the output features of a {type(instance).__name__} being built (a GPT's output "
                            f"layer: its padded vocabulary)", outputs, outputs // tpi.group_size(group), group)
    return result


def _row_forward(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    input_ = argument(args, kwargs, 0, "input_")
    expert = _expert_layer(instance)
    if getattr(instance, "gradient_accumulation_fusion", False):
        _refuse("gradient_accumulation_fusion", "its fused wgrad GEMM accumulates by shape")
    group = tp_group(instance)
    if not instance.input_is_parallel:
        from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region

        input_ = scatter_to_tensor_model_parallel_region(input_, group=group)
    weight = instance.weight
    nb = tpi.blocks_per_rank(group)
    tpi.check_divisible(f"{type(instance).__name__} input features",
                        weight.shape[1] * tpi.group_size(group), weight.shape[1], group)
    scale = expert_call.scale(instance)
    if scale is not None:  # an expert's activation times its routing probabilities
        input_ = tpi.ScaledRows.apply(input_, scale, group, nb)
    # an expert's output is summed over expert TP by the token dispatcher: kept on its rank 0
    output = tpi.RowParallel.apply(input_, weight, group, nb, expert, expert_call.sources(instance))
    if expert and instance.bias is not None:
        _refuse(*_MOE_BIAS)
    split = not expert and bool(getattr(instance, "sequence_parallel", False)) and tpi.group_size(group) > 1
    if split:  # this rank's part of the sequence of the fixed-tree sum: upstream's reduce-scatter
        output = tpi.ScatterSequence.apply(output, group)
    bias = instance.bias
    if bias is not None:  # its gradient sums over tokens: token blocks in the fixed tree
        bias = tpi.TokenBlockedBias.apply(bias, output.shape, group, tpi.token_blocks(output, group, split), split)
    if instance.skip_bias_add:
        return output, bias
    return (output + bias if bias is not None else output), None


# -- norm layers -----------------------------------------------------------------------------------

def _norm_affine(module):
    """``(normalise, weight, bias)`` of a norm layer the mode covers, else None: torch's
    ``LayerNorm``/``RMSNorm`` (the local spec without apex) and megatron-core's apex-backed
    ``FusedLayerNorm`` (the local spec with apex), whose affine part the mode computes itself."""
    import torch.nn.functional as F

    kind = type(module)
    if kind is torch.nn.LayerNorm and module.elementwise_affine:
        return (lambda x: F.layer_norm(x, module.normalized_shape, None, None, module.eps),
                module.weight, module.bias)
    if kind is torch.nn.RMSNorm and module.elementwise_affine:
        return lambda x: F.rms_norm(x, module.normalized_shape, None, module.eps), module.weight, None
    if kind.__name__ == "FusedLayerNorm" and kind.__module__ == "megatron.core.fusions.fused_layer_norm":
        weight = module.weight + 1 if module.zero_centered_gamma else module.weight
        return (lambda x: F.layer_norm(x, module.hidden_size, None, None, module.eps), weight, module.bias)
    if kind.__name__ in ("RMSNorm", "LayerNorm") and kind.__module__.startswith("transformer_engine.pytorch"):
        # Transformer Engine's norms (megatron-core's TENorm): per token, gamma zero-centred or not
        shape = tuple(module.weight.shape)
        weight = module.weight + 1 if getattr(module, "zero_centered_gamma", False) else module.weight
        if kind.__name__ == "RMSNorm":
            return lambda x: F.rms_norm(x, shape, None, module.eps), weight, None
        return lambda x: F.layer_norm(x, shape, None, None, module.eps), weight, module.bias
    return None


_QK_NORMS = ("q_layernorm", "k_layernorm")  # the attention's per-head norms (--qk-layernorm)


def _is_qk_norm(name: str, config) -> bool:
    """The attention's per-head query/key norm, named as upstream names it (and as its
    ``finalize_model_grads`` finds it); multi-latent attention's norms of that name act on the
    replicated latent, per token."""
    return name.rsplit(".", 1)[-1] in _QK_NORMS and not getattr(config, "multi_latent_attention", False)


def _token_blocked_norm(module, heads: bool = False, group=None) -> None:
    """Route a norm layer's affine part through ``TokenBlockedAffine`` (its weight and bias
    gradients sum over tokens, which sequence parallelism splits over TP; ``heads``: a QK norm's,
    over tokens and the heads TP splits); refuse norms with parameters that the mode does not know."""
    if getattr(module, "_megapatch_token_blocked", False):
        return
    if _norm_affine(module) is not None:
        module.forward = functools.partial(_norm_forward, module, module.forward, heads)
        module._megapatch_token_blocked = True
        module._megapatch_tp_group = group
    elif "norm" in type(module).__name__.lower() and any(True for _ in module.parameters(recurse=False)):
        _refuse(f"the norm layer {type(module).__qualname__}",
                "its weight gradient sums tokens in an order the mode does not control; torch's "
                "LayerNorm/RMSNorm and megatron-core's FusedLayerNorm are covered")


def _norm_forward(module, original, heads, hidden):
    if not tpi.active():
        return original(hidden)
    normalise, weight, bias = _norm_affine(module)  # per call: a zero-centred weight is w + 1
    # the model's own TP group: a rollout model at TP 1 beside a TP-2 trainer is not split
    group = getattr(module, "_megapatch_tp_group", None) or _tp_group_if_initialised()
    if heads:  # [s, b, heads or KV groups of this rank, head dim]
        if hidden.dim() != 4:
            _refuse(f"a QK norm's input of shape {tuple(hidden.shape)}",
                    "the mode sums its gradient over [sequence, batch, heads, head dim]")
        return tpi.TokenBlockedAffine.apply(normalise(hidden.float()), weight, bias, group,
                                            tpi.blocks_per_rank(group), False, hidden.dtype, True)
    split = bool(getattr(module.weight, "sequence_parallel", False)) and tpi.group_size(group) > 1
    return tpi.TokenBlockedAffine.apply(normalise(hidden.float()), weight, bias, group,
                                        tpi.token_blocks(hidden, group, split), split, hidden.dtype)


def _tp_group_if_initialised():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


# -- cross entropy -------------------------------------------------------------------------------

def _predicted_logits(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if not tpi.active():
        return result
    from megatron.core import parallel_state

    target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = result
    group = parallel_state.get_tensor_model_parallel_group()
    nb = tpi.blocks_per_rank(group)
    tpi.check_divisible("the vocabulary (cross entropy)", exp_logits.shape[-1] * tpi.group_size(group),
                        exp_logits.shape[-1], group)
    # handed to upstream's all-reduce on rank 0 only
    total = tpi.on_root(tpi.invariant_sum(tpi.sum_exp_partials(exp_logits, nb), group), group).view_as(sum_exp_logits)
    return target_mask, masked_target_1d, predicted_logits, total.to(sum_exp_logits.dtype), exp_logits


# -- MLP activation ------------------------------------------------------------------------------

def _mlp_forward(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    config = instance.config
    for field in ("use_te_activation_func", "bias_activation_fusion"):
        refusal = _field_refusal(config, field)
        if refusal:
            _refuse(*refusal)
    scale = argument(args, kwargs, 1, "per_token_scale", None)
    with contextlib.ExitStack() as scopes:
        if config.gated_linear_unit:
            _mark_gated_fc1(instance)  # also for a model built before the mode was switched on
            scopes.enter_context(scoped(_gated_fc1, instance.linear_fc1))  # its column blocks split gate and up
        if scale is None:
            return wrapped(*args, **kwargs)
        # a routed expert: the probabilities scale the activation inside fc2's wrapper, where the
        # sum of their gradient over the features expert TP splits runs in the fixed tree
        hidden = argument(args, kwargs, 0, "hidden_states")
        sources = expert_call.token_sources(instance, hidden.shape[0])
        scopes.enter_context(expert_call.running(expert_call.ExpertCall(instance, scale, sources)))
        rest = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "per_token_scale")}
        return wrapped(hidden, None, **rest)


# -- mixture of experts: the router ---------------------------------------------------------------

def _router_layout(router, tokens):
    """``(TP group, sequence parallel, token blocks)`` of a router's input or logits ``[s, b, ...]``."""
    group = getattr(router, "tp_group", None) or _tp_group_if_initialised()
    split = bool(getattr(router.config, "sequence_parallel", False)) and tpi.group_size(group) > 1
    return group, split, tpi.token_blocks(tokens, group, split)


def _router_gating(wrapped, instance, args, kwargs):
    """The gating GEMM per block of consecutive tokens (the same blocks at every TP size); its weight
    gradient, a sum over tokens, through the token tree -- across TP with sequence parallelism,
    where upstream all-reduces it as a sequence-parallel parameter (``finalize_model_grads``)."""
    if not tpi.active():
        return wrapped(*args, **kwargs)
    input_ = argument(args, kwargs, 0, "input")
    config = instance.config
    refusal = _field_refusal(config, "moe_router_dtype", _MOE_REFUSED)
    if refusal:
        _refuse(*refusal)
    dtype = torch.float32 if config.moe_router_dtype == "fp32" else input_.dtype
    for param in (instance.weight, instance.bias):
        if param is not None and param.device != input_.device:  # as upstream's gating does at its first call
            param.data = param.data.to(input_.device)
    group, split, nb = _router_layout(instance, input_)
    return tpi.TokenBlockedLinear.apply(input_, instance.weight, instance.bias, group, nb, split, dtype)


def _router_routing(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    _, _, nb = _router_layout(instance, argument(args, kwargs, 0, "logits"))
    with scoped(_router_blocks, nb):
        return wrapped(*args, **kwargs)


def _per_token_blocks(wrapped, instance, args, kwargs):
    """Top-k routing (and the aux loss's top-k) called once per token block of the router: every
    call sees the same rows at every TP size, so ties are broken the same way whatever kernel a row
    count would select. Under a router-replay action (recording or replaying, ``router_replay``)
    the call is left whole: upstream records and replays one tensor of indices per call."""
    nb = _router_blocks.get()
    replay = getattr(kwargs.get("router_replay"), "router_replay_action", None)
    if not tpi.active() or not nb or nb == 1 or replay is not None:
        return wrapped(*args, **kwargs)
    logits = argument(args, kwargs, 0, "logits")
    mask = kwargs.get("padding_mask")
    rest = {k: v for k, v in kwargs.items() if k != "logits"}
    parts = []
    for rows in tpi.slices(logits.shape[0], nb):
        if mask is not None:
            rest["padding_mask"] = mask[rows]
        parts.append(wrapped(logits[rows], *args[1:], **rest))
    return tuple(torch.cat(outputs) for outputs in zip(*parts))


# -- mixture of experts: where an expert's tokens come from --------------------------------------

_SOURCES = expert_call.SOURCES  # on an expert MLP (or GroupedExpert): its rows' TokenSources (EP > 1)
_EXPERTS = "_megapatch_local_experts"  # on a token dispatcher: its layer's local experts (MLPs, GroupedExperts)
_EXPERT_KEY = "_megapatch_expert_key"  # on an expert parameter: (layer, global expert, parameter)
_RESTORE = "_megapatch_restore"  # on a token dispatcher: the inverse of its EP-major row order
_PARTITION_DIM = "_megapatch_partition_dim"  # on an expert's fc2 weight: the dim TP splits


_data_parallel = expert_call.data_parallel


def _ep_data_parallel_ranks(dispatcher):
    """The data-parallel rank of each EP rank of the dispatcher's group, in EP rank order."""
    found = getattr(dispatcher, "_megapatch_ep_dp_ranks", None)
    if found is None:
        rank, _, _ = _data_parallel()
        ranks = [torch.zeros(1, dtype=torch.long) for _ in range(dispatcher.ep_size)]
        torch.distributed.all_gather(ranks, torch.tensor([rank]), group=dispatcher.ep_group)
        found = dispatcher._megapatch_ep_dp_ranks = [int(r) for r in ranks]
    return found


def _alltoall_dispatch_postprocess(wrapped, instance, args, kwargs):
    """With expert parallelism each local expert's rows arrive from (TP rank, EP rank) chunks in
    TP-major order; they are reordered EP-major, so that each source data-parallel rank's rows are
    one block in sequence order (as they are on that rank without expert parallelism), and the
    blocks are recorded for the expert's GEMMs and weight gradient (``TokenSources``)."""
    tokens, tokens_per_expert, probs = wrapped(*args, **kwargs)
    if not tpi.active() or instance.ep_size == 1:
        return tokens, tokens_per_expert, probs
    chunks = getattr(instance, "num_global_tokens_per_local_expert", None)
    if instance.num_local_experts == 1 or chunks is None:
        _refuse(f"one expert per EP rank ({instance.ep_size} EP ranks; Megatron-LM: --num-experts)",
                "the dispatcher then keeps no per-source token counts; use more experts than EP ranks")
    tp, ep, local = instance.tp_size, instance.ep_size, instance.num_local_experts
    counts = chunks.reshape(tp, ep, local).tolist()
    _, size, group = _data_parallel()
    leaves = tuple(_ep_data_parallel_ranks(instance))
    order, sources, start = [], [], 0
    for e in range(local):
        begin = {}
        for j in range(tp):
            for k in range(ep):
                begin[j, k] = start
                start += counts[j][k][e]
        for k in range(ep):
            for j in range(tp):
                order += range(begin[j, k], begin[j, k] + counts[j][k][e])
        sources.append(tpi.TokenSources(tuple(sum(counts[j][k][e] for j in range(tp)) for k in range(ep)),
                                        leaves, group, size))
    order = torch.tensor(order, dtype=torch.long, device=tokens.device)
    setattr(instance, _RESTORE, torch.argsort(order))  # the inverse permutation, for the combine
    experts = getattr(instance, _EXPERTS, None)
    if experts is None or len(experts) != local:
        _refuse("an expert-parallel MoE layer built before tp_invariant was switched on",
                "the mode links each layer's experts to its dispatcher when the model is built")
    for expert, found in zip(experts, sources):
        setattr(expert, _SOURCES, found)
    return tokens.index_select(0, order), tokens_per_expert, probs.index_select(0, order)


def _alltoall_combine_preprocess(wrapped, instance, args, kwargs):
    if not tpi.active() or instance.ep_size == 1:
        return wrapped(*args, **kwargs)
    hidden = argument(args, kwargs, 0, "hidden_states")
    return wrapped(hidden.index_select(0, getattr(instance, _RESTORE)))


def _mark_experts(name: str, module) -> None:
    """Link a layer's dispatcher to its local experts (a ``SequentialMLP``'s expert MLPs, a grouped-GEMM
    layer's ``GroupedExpert``s), key each expert parameter by (layer, global expert, parameter) for the
    grad norm's order across EP ranks, and mark the dim TP splits where TE marks it otherwise."""
    experts, dispatcher = getattr(module, "experts", None), getattr(module, "token_dispatcher", None)
    if experts is None or dispatcher is None:
        return
    if hasattr(experts, "local_experts"):
        local = list(experts.local_experts)
        params = [list(expert.parameters()) for expert in local]
        fc2s = [getattr(getattr(expert, "linear_fc2", None), "weight", None) for expert in local]
        # TE marks a routed expert's fc2 weight with partition_dim 0 (TE runs it with parallel_mode=None
        # and marks every linear but "row" so); it holds input features
        fc2s = [w for w in fc2s if w is not None and getattr(w, "tensor_model_parallel", False)]
    elif type(experts).__name__ == "TEGroupedMLP":  # weight<i> of fc1 and fc2 are expert i's
        local = expert_call.grouped_experts(experts)
        params = [[getattr(experts.linear_fc1, f"weight{i}"), getattr(experts.linear_fc2, f"weight{i}")]
                  for i in range(len(local))]
        fc2s = [fc2 for _, fc2 in params]  # TE gives them no TP attributes at all (parallel_mode=None)
        for fc1, _ in params:
            setattr(fc1, _PARTITION_DIM, 0)
            if getattr(experts.config, "gated_linear_unit", False):
                setattr(fc1, _GATED, 2)
    else:
        _refuse(f"experts of type {type(experts).__qualname__} ({name}.experts)", _LEGACY_GROUPED)
    setattr(dispatcher, _EXPERTS, local)
    layer = int(next((p for p in reversed(name.split(".")) if p.isdigit()), 0))
    first = dispatcher.local_expert_indices[0]
    for i, expert_params in enumerate(params):
        for j, param in enumerate(expert_params):
            setattr(param, _EXPERT_KEY, (layer, first + i, j))
    for fc2 in fc2s:
        setattr(fc2, _PARTITION_DIM, 1)


_LEGACY_GROUPED = (LEGACY_GROUPED_EXPERTS, "their kernels choose their blocking by the tokens each expert receives")


# -- refusals at model and optimizer construction -------------------------------------------------

def _fused_activation_flag(config) -> str:
    # Megatron-LM sets bias_activation_fusion from --bias-swiglu-fusion for --swiglu, else from
    # --bias-gelu-fusion: only one of the two flags counts for a given model
    swiglu = getattr(config, "gated_linear_unit", False)
    return f"on by default; {'--no-bias-swiglu-fusion' if swiglu else '--no-bias-gelu-fusion'}"


#: config field -> (is it refused for this value, Megatron-LM flag that sets it (or a function of
#: the config giving it), why)
_REFUSED_CONFIG = {
    "gradient_accumulation_fusion": (bool, "on by default; --no-gradient-accumulation-fusion",
                                     "its fused wgrad GEMM accumulates by shape"),
    "bias_activation_fusion": (bool, _fused_activation_flag,
                               "the fused kernels are not verified for this mode yet"),
    "use_te_activation_func": (bool, "--use-te-activation-func",
                               "Transformer Engine kernels choose their blocking by shape"),
    "defer_embedding_wgrad_compute": (bool, "--defer-embedding-wgrad-compute",
                                      "the deferred wgrad runs outside the layer"),
    # off by default in Megatron-LM, on by default in Megatron-Bridge's GPTModelProvider: Bridge's
    # pretrain at TP 2 printed other losses than at TP 1 with it (results/bridge.md)
    "cross_entropy_loss_fusion": (
        bool, "--cross-entropy-loss-fusion; Megatron-Bridge: provider.cross_entropy_loss_fusion=False",
        "megatron-core's fused vocab-parallel cross entropy all-reduces the TP partials of its "
        "sum of exponentials itself, outside the fixed tree"),
    # issue 37 item 8: the one layout axis the mode does not cover (megatron-core's local attention,
    # the only one the mode runs, asserts CP == 1 after this check would have passed)
    "context_parallel_size": (lambda size: (size or 1) > 1, "--context-parallel-size; run 1",
                              "context parallelism splits each sequence's attention over ranks and combines "
                              "their partial softmax results outside the fixed tree"),
    # issue 39 item 7: upstream's batch-invariant kernels (megatron-core >= 0.16) replace aten mm/addmm,
    # log_softmax and mean and TE's GEMM and RMSNorm, and need flash attention; the mode replaces those
    # layers' GEMMs with its FP32 block GEMMs (mm with an FP32 out dtype, not among them), its attention
    # with torch GEMMs and its TP sums with the fixed tree: on together, neither promise would be kept
    "batch_invariant_mode": (bool, "--batch-invariant-mode (Megatron-LM main); megatron-core >= 0.16: "
                             "TransformerConfig.batch_invariant_mode",
                             "upstream's batch-invariant kernels and the mode replace the same GEMMs, attention "
                             "and norms with different arithmetic; tp_invariant gives the same bits across "
                             "layouts (and on CPU across batch shapes), batch_invariant_mode across batch "
                             "composition at one layout on GPUs -- they do not compose, run one of them"),
}


_MOE_EP = ("expert_model_parallel_size > 1 with the allgather dispatcher (Megatron-LM: "
           "--expert-model-parallel-size with --moe-token-dispatcher-type allgather; alltoall is covered)",
           "each EP rank adds its own experts' outputs for a token before the reduce-scatter adds the "
           "ranks' sums, an order that depends on the EP size")
_MOE_BIAS = ("expert biases (add_bias_linear=True with --num-experts; Megatron-LM: on by default; "
             "--disable-bias-linear)", "upstream's expert MLP adds them scaled by the routing "
             "probabilities, outside the mode's layers")

#: like _REFUSED_CONFIG, for models with expert layers (--num-experts)
_MOE_REFUSED = {
    "moe_token_dispatcher_type": (
        lambda v: v is not None and v not in ("allgather", "alltoall"),
        "--moe-token-dispatcher-type; covered: allgather, alltoall",
        "its fused all-to-all (DeepEP/HybridEP) combines the experts' outputs inside its kernels"),
    "moe_permute_fusion": (bool, "--moe-permute-fusion; leave it off",
                           "Transformer Engine's fused unpermute adds a token's expert outputs in its own order"),
    "moe_router_fusion": (bool, "--moe-router-fusion; leave it off",
                          "Transformer Engine's fused top-k and score kernels are not verified for this mode"),
    "moe_shared_expert_overlap": (bool, "--moe-shared-expert-overlap; leave it off",
                                  "the overlapped shared expert runs its TP communication inside the "
                                  "dispatcher, outside the fixed tree"),
    "moe_shared_expert_gate": (bool, "--moe-shared-expert-gate",
                               "the gate's weight gradient sums this rank's tokens outside the token blocks"),
    "moe_expert_capacity_factor": (lambda v: v is not None, "--moe-expert-capacity-factor",
                                   "token dropping ranks an expert's tokens among this rank's, which "
                                   "sequence parallelism splits"),
    "moe_input_jitter_eps": (lambda v: v is not None, "--moe-input-jitter-eps", "its noise is drawn per rank"),
    "moe_router_force_load_balancing": (bool, "--moe-router-force-load-balancing",
                                        "its random logits are drawn per rank"),
    "moe_latent_size": (bool, "--moe-latent-size", "the latent projections are Transformer Engine layers"),
    "moe_router_dtype": (lambda v: v == "fp64", "--moe-router-dtype; fp32 is covered",
                         "the mode's gating GEMM blocks compute in FP32"),
    "moe_router_load_balancing_type": (
        lambda v: "sinkhorn" in (v if isinstance(v, (list, tuple)) else [v]), "--moe-router-load-balancing-type",
        "Sinkhorn normalises over this rank's tokens, which sequence parallelism splits"),
    "add_bias_linear": (bool, "on by default; --disable-bias-linear", _MOE_BIAS[1]),
}


def _moe_coverage() -> str:
    """What ``tp_invariant.moe`` covers and what the mode refuses in expert layers (status, doctor,
    the job-log line), from the refusal table itself."""
    refused = [f"{field} ({flag})" for field, (_, flag, _) in _MOE_REFUSED.items()]
    refused += [_MOE_EP[0], "one expert per EP rank", "expert_tensor_parallel_size other than the TP size",
                "calculate_per_token_loss with an aux or z loss", _LEGACY_GROUPED[0]]
    return ("router gating GEMM and top-k per token block, routed experts (SequentialMLP, or TE's grouped GEMM: "
            "TEGroupedMLP; expert TP = TP) and shared experts through the fixed tree, aux and z losses; dispatchers "
            "allgather (EP 1) and alltoall (any EP, each source rank's tokens one block); bit-identical across TP, "
            "EP and data-parallel sizes "
            "(each source rank's expert weight gradient a term of the exact data-parallel sum) and micro-batch "
            "sizes (tp_invariant.moe_micro_batch: a micro-batch's sequences one at a time, aux and z losses per "
            "sequence); refused at construction: "
            + "; ".join(refused))


def _moe_refusals(config, layout=None) -> list:
    """``[(what, why), ...]`` for a model with expert layers: the fields above, expert parallelism
    with the allgather dispatcher or one expert per EP rank, expert TP other than TP, and the
    per-token loss scaling of the aux and z losses. ``layout``: the (EP, expert TP) sizes the
    model is built with where known (megatron's parallel state), else the config's."""
    if not getattr(config, "num_moe_experts", None):
        return []
    found = [r for r in (_field_refusal(config, field, _MOE_REFUSED) for field in _MOE_REFUSED) if r]
    if getattr(config, "moe_grouped_gemm", False) and getattr(config, "transformer_impl", None) == "local":
        found.append(_LEGACY_GROUPED)  # (a built layer is judged by its experts' type: _mark_experts)
    ep, etp = layout or (getattr(config, "expert_model_parallel_size", 1) or 1,
                         getattr(config, "expert_tensor_parallel_size", None))
    if ep > 1 and getattr(config, "moe_token_dispatcher_type", None) == "allgather":
        found.append(_MOE_EP)
    if ep > 1 and config.num_moe_experts == ep:
        found.append((f"num_moe_experts={config.num_moe_experts} with expert_model_parallel_size={ep} "
                      f"(Megatron-LM: --num-experts, --expert-model-parallel-size)",
                      "with one expert per EP rank the alltoall dispatcher keeps no per-source token counts, "
                      "which the mode needs to run each source's tokens as one block; use more experts than "
                      "EP ranks"))
    tp = block_shapes.tp_size(config)
    if etp is not None and etp != tp:
        found.append((f"expert_tensor_parallel_size={etp} at TP {tp} (Megatron-LM: --expert-tensor-parallel-size)",
                      "the experts' TP sums are covered with expert TP = TP; with fewer expert TP ranks, "
                      "TP ranks become expert data-parallel replicas whose weight gradients are summed "
                      "across ranks outside the fixed tree"))
    aux = getattr(config, "moe_aux_loss_coeff", 0) or getattr(config, "moe_z_loss_coeff", None)
    if getattr(config, "calculate_per_token_loss", False) and aux:
        found.append(("calculate_per_token_loss=True with an MoE aux or z loss (Megatron-LM: "
                      "--calculate-per-token-loss)",
                      "upstream scales those losses' gradients by this rank's token count, which sequence "
                      "parallelism divides by the TP size"))
    return found


def _field_refusal(config, field, table=None):
    """``(what, why)`` when ``config``'s ``field`` has a value the mode cannot cover, else None."""
    refused, flag, why = (table or _REFUSED_CONFIG)[field]
    value = getattr(config, field, None)
    if not refused(value):
        return None
    return f"{field}={value} (Megatron-LM: {flag(config) if callable(flag) else flag})", why


def _config_refusals(config, vocabulary=None, seq_length=None, layout=None):
    """``[(what, why), ...]``: every config field the mode cannot cover, then the TP size against
    the width, every TP-split dimension the width does not divide (the sequence with sequence
    parallelism: ``seq_length`` where the config has none) and the padded ``vocabulary``
    (``block_shapes``; None: not known)."""
    found = [r for r in (_field_refusal(config, field) for field in _REFUSED_CONFIG) if r]
    found += _moe_refusals(config, layout)
    tp = block_shapes.tp_size(config)
    groups = getattr(config, "num_query_groups", None) or config.num_attention_heads
    if groups < tp:
        found.append(_few_kv_groups(groups, tp))
    found += block_shapes.shape_refusals(config, seq_length)
    vocabulary_refusal = block_shapes.vocabulary_refusal(vocabulary, tp) if vocabulary is not None else None
    return found + ([vocabulary_refusal] if vocabulary_refusal else [])


def _few_kv_groups(groups: int, tp: int):
    return (f"num_query_groups={groups} (--num-query-groups) below the TP size {tp}",
            "the key/value gradients of one group are then summed across ranks outside the fixed tree")


def _described(refusals) -> str:
    """What a preflight check reports: the refusals the patch would raise, in its words."""
    return "; ".join(f"does not support {what}: {why}" for what, why in refusals) or None


def _check_config(config, pg_collection=None) -> None:
    # in a Megatron-LM job every stage's block refuses its padded vocabulary, naming the flags,
    # and (sequence parallelism) a --seq-length W does not divide, as the doctor does from the flags
    refusals = _config_refusals(config, block_shapes.megatron_lm_vocabulary(),
                                block_shapes.megatron_lm_sequence_length(config),
                                _collection_layout(pg_collection) or _expert_layout())
    if refusals:
        _refuse(*refusals[0])


def _collection_layout(pg_collection):
    """``(EP, expert TP)`` of the process groups a block is built with, where it is given its own
    (Megatron RL's rollout model at another TP/EP size than the trainer's parallel state)."""
    ep, etp = (getattr(pg_collection, name, None) for name in ("ep", "expt_tp"))
    if ep is None or etp is None:
        return None
    return ep.size(), etp.size()


def _expert_layout():
    """``(EP, expert TP)`` of megatron's parallel state (what the layers are built with, whatever
    the config says), or None before it is initialised."""
    if _tp_group_if_initialised() is None:
        return None
    from megatron.core import parallel_state

    return (parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size())


def _preflight_model(config):
    # Transformer Engine layers: tp_invariant.transformer_engine's preflight
    return _described(_config_refusals(config, config))  # the flags' config carries the vocabulary's fields


def _optimizer_instances(instances):
    return (f"num_distributed_optimizer_instances={instances} (Megatron-LM: "
            f"--num-distributed-optimizer-instances)",
            "the instances' gradient all-reduce is not under the fixed tree")


def _preflight_optimizer(config):
    instances = getattr(config, "num_distributed_optimizer_instances", 1) or 1
    distributed = getattr(config, "use_distributed_optimizer", False)
    return _described([_optimizer_instances(instances)] if distributed and instances > 1 else [])


#: Transformer Engine modules the mode runs (tp_invariant.transformer_engine; TE's norms here)
_TE_COVERED = ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear",
               "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear", "TEDotProductAttention", "RMSNorm",
               "LayerNorm")


def _transformer_engine(module, name: str) -> bool:
    """Whether ``module`` is a Transformer Engine module (refused unless the mode covers it)."""
    kind = type(module)
    if not kind.__module__.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine")):
        return False
    if kind.__name__ not in _TE_COVERED:
        _refuse(f"the Transformer Engine module {kind.__qualname__} ({name})",
                "the mode covers TE's column/row-parallel linears, LayerNormLinear, norms and "
                "DotProductAttention; use --transformer-impl local")
    return True


def _block_init(wrapped, instance, args, kwargs):
    """Refuse, before any step runs, what the mode cannot make invariant: the config first, then
    the layers the block built (Transformer Engine modules)."""
    if not tpi.active():
        return wrapped(*args, **kwargs)
    config = argument(args, kwargs, 0, "config")
    # TransformerBlock(config, spec, post_layer_norm, pre_process, post_process, pg_collection, ...)
    _check_config(config, argument(args, kwargs, 5, "pg_collection", None))
    result = wrapped(*args, **kwargs)
    te_covered = []  # a covered TE module's own TE submodules (attention backends) do not run under the mode
    own_group = getattr(getattr(instance, "pg_collection", None), "tp", None)
    for name, module in instance.named_modules():
        if any(name.startswith(prefix) for prefix in te_covered):
            continue
        if _transformer_engine(module, name):
            te_covered.append(name + ".")
            if type(module).__name__.endswith("Linear"):  # its fused norm: tp_invariant.transformer_engine
                continue
        _token_blocked_norm(module, _is_qk_norm(name, config), own_group)
        _mark_gated_fc1(module)
        _mark_experts(name, module)
    return result


_GATED = tpi.GATED_HALVES


def _mark_gated_fc1(module) -> None:
    """The grad norm cuts a gated fc1's gradient as its dgrad tree does (``column_blocks``): it
    finds the parameters by this mark (and, for an optimizer's FP32 copies, through the optimizer)."""
    config = getattr(module, "config", None)
    fc1 = getattr(module, "linear_fc1", None)
    if fc1 is not None and getattr(config, "gated_linear_unit", False):
        for param in (getattr(fc1, "weight", None), getattr(fc1, "bias", None)):
            if param is not None:
                setattr(param, _GATED, 2)


def _model_params(optimizer) -> dict:
    """``{id(parameter the optimizer steps): model parameter}`` for the FP32 main copies a
    mixed-precision optimizer made of model parameters (the marks -- gated fc1, expert key -- stay
    on the model parameter)."""
    import itertools

    model = itertools.chain.from_iterable(getattr(optimizer, "float16_groups", ()) or ())
    main = itertools.chain.from_iterable(getattr(optimizer, "fp32_from_float16_groups", ()) or ())
    return {id(main_param): model_param for model_param, main_param in zip(model, main)}


def _distributed_optimizer_init(wrapped, instance, args, kwargs):
    if tpi.active():
        for chunk in argument(args, kwargs, 4, "model_chunks", None) or ():
            instances = getattr(getattr(chunk, "ddp_config", None), "num_distributed_optimizer_instances", 1)
            if (instances or 1) > 1:
                _refuse(*_optimizer_instances(instances))
    return wrapped(*args, **kwargs)


# -- gradient norm -------------------------------------------------------------------------------

def _norm_owner_scope(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    with scoped(_norm_owner, instance):
        return wrapped(*args, **kwargs)


def _grad_norm_fp32(wrapped, instance, args, kwargs):
    norm_type = float(argument(args, kwargs, 1, "norm_type", 2))
    if not tpi.active() or norm_type == float("inf"):  # a max is order-independent
        return wrapped(*args, **kwargs)
    owner = _norm_owner.get()
    if owner is None:
        _refuse("get_grad_norm_fp32 outside an optimizer's get_grad_norm/clip_grad_norm",
                "the invariant norm needs the parameters' partition dims")
    if norm_type != 2.0:
        _refuse(f"a grad norm of type {norm_type}", "only the 2-norm (and inf) is invariant")
    return _invariant_grad_norm(owner, argument(args, kwargs, 2, "grad_stats_parallel_group", None))


def _chained_grad_norm(wrapped, instance, args, kwargs):
    """A chained optimizer's norm (dense and expert parameters), computed over all its optimizers
    at once: upstream adds the optimizers' norms as ``sqrt(a^2 + b^2)`` where their reduction
    groups differ (expert parallelism), and sums them as one where they do not."""
    if not tpi.active():
        return wrapped(*args, **kwargs)
    with scoped(_norm_owner, instance):
        return _invariant_grad_norm(instance, instance.chained_optimizers[0].get_grad_stats_parallel_group())


def _invariant_grad_norm(owner, stats_group) -> float:
    """The 2-norm of every gradient the ``owner``'s optimizers step: each parameter's sum of squares
    through the fixed tree along its partition dim (expert parameters gathered over the EP ranks,
    which hold other experts), the squares of every parameter of every pipeline stage added exactly
    (``exact_sum.scalar_sum``: correctly rounded whatever the order and the stages' cut)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import param_is_not_shared

    optimizers = _optimizers(owner)
    distributed = any(_is_distributed(o) for o in optimizers)
    tp_group = getattr(owner, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
    stages = _pipeline_stages(stats_group, tp_group, distributed)
    grads, dims, halves, keys = [], [], [], []
    for optimizer in optimizers:
        model_of = _model_params(optimizer)
        if _is_distributed(optimizer):
            pairs = _distributed_grads(optimizer)
        else:
            decoupled = getattr(optimizer.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
            pairs = ((p, getattr(p, "decoupled_grad", None) if decoupled else p.grad)
                     for p in optimizer.get_parameters())
        for param, grad in pairs:
            if grad is None or not param_is_not_shared(param):
                continue
            model = model_of.get(id(param), param)
            grads.append(grad)
            dim = getattr(model, _PARTITION_DIM, None)  # (TE's grouped expert weights: no TP attributes)
            if dim is None and getattr(param, "tensor_model_parallel", False):
                dim = param.partition_dim
            dims.append(dim)
            halves.append(getattr(model, _GATED, 1))
            keys.append(getattr(model, _EXPERT_KEY, None))
    squares = tpi.squared_norms(grads, dims, tp_group, halves)
    values = [value for value, key in zip(squares.tolist(), keys) if key is None]
    values += [float(value) for value in _expert_squares(squares, keys)]
    # every TP rank of a stage holds the same values; the sum over the stages is exact (correctly
    # rounded), so it does not depend on how the pipeline cuts the parameters into stages
    return math.sqrt(exact_sum.scalar_sum(values, stages))


def _expert_squares(squares, keys):
    """The expert parameters' sums of squares of every EP rank, in key order."""
    mine = [i for i, key in enumerate(keys) if key is not None]
    if not mine:
        return []
    from megatron.core import parallel_state

    values, key_rows = squares[mine], torch.tensor([keys[i] for i in mine], dtype=torch.long)
    group = parallel_state.get_expert_model_parallel_group()
    if tpi.group_size(group) > 1:
        every_value = [torch.empty_like(values) for _ in range(group.size())]
        every_key = [torch.empty_like(key_rows) for _ in range(group.size())]
        torch.distributed.all_gather(every_value, values.contiguous(), group=group)
        torch.distributed.all_gather(every_key, key_rows, group=group)
        values, key_rows = torch.cat(every_value), torch.cat(every_key)
    order = sorted(range(len(values)), key=lambda i: tuple(key_rows[i].tolist()))
    return [values[i] for i in order]


def _pipeline_stages(stats_group, tp_group, distributed: bool):
    """The pipeline group whose stage totals the norm adds (None: the norm spans TP only); refuses a
    norm over any other ranks (expert, or data-parallel without the distributed optimizer), which
    this mode does not make invariant. The distributed optimizer's norm spans its data-parallel
    shards too: ``_distributed_grads`` gathers them, so every data-parallel rank adds the same total."""
    tp = tpi.group_size(tp_group)
    if stats_group is None or stats_group.size() == tp:
        return None
    from megatron.core import parallel_state

    stages = parallel_state.get_pipeline_model_parallel_group()
    expected, shape = tp * stages.size(), f"TP {tp} x PP {stages.size()}"
    if distributed:
        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        expected, shape = expected * dp, f"{shape} x DP {dp}"
    if stats_group.size() != expected:
        _refuse(f"a grad norm over {stats_group.size()} ranks ({shape} expected)",
                "only the tensor- and pipeline-parallel sums are made invariant")
    return stages if stages.size() > 1 else None


def _is_distributed(optimizer) -> bool:
    return type(optimizer).__name__ == "DistributedOptimizer"


def _distributed_grads(optimizer):
    """``(model parameter, full-shaped gradient)`` for every parameter of a distributed optimizer,
    in buffer order (the same at every TP size). Its main-parameter shards are flat slices with no
    partition dim; the model parameters' ``main_grad`` views of the grad buffers have one. Each
    data-parallel rank holds only its own shard reduced, so with DP > 1 the shards are first
    all-gathered into a copy (the volume of the optimizer's own parameter all-gather)."""
    for buffer in optimizer.buffers:
        data = buffer.grad_data
        group = buffer.data_parallel_group
        if group.size() > 1:
            gathered = torch.empty_like(data)
            for (start, end), bucket in zip(buffer.bucket_indices, buffer.buckets):
                shards = list(gathered[start:end].chunk(group.size()))
                mine = bucket.grad_data.chunk(group.size())[group.rank()]
                torch.distributed.all_gather(shards, mine.contiguous(), group=group)
            data = gathered
        for param, (start, end, _bucket) in sorted(buffer.param_index_map.items(), key=lambda kv: kv[1][0]):
            yield param, data[start:end].view(param.shape)


def _optimizers(owner):
    return list(getattr(owner, "chained_optimizers", None) or [owner])


_verified_upstream = tp_invariant_verified_upstream
_invariant_patch = tp_invariant_patch

PATCHES = (
    _invariant_patch(
        name="tp_invariant.tensor_parallel",
        summary="TP-invariant linear layers and vocab-parallel cross entropy (fixed-tree FP32 sums)",
        hook="megatron.core.tensor_parallel",
        watches=(f"{LAYERS}:ColumnParallelLinear.forward", f"{CROSS_ENTROPY}:_VocabParallelCrossEntropy.forward"),
        targets=(
            Target(LAYERS, "ColumnParallelLinear._forward_impl", _column_forward_impl, kind="method",
                   params=("self", "input", "weight")),
            Target(LAYERS, "ColumnParallelLinear.__init__", _column_init, kind="method",
                   params=("self", "input_size", "output_size")),
            Target(LAYERS, "RowParallelLinear.forward", _row_forward, kind="method",
                   params=("self", "input_")),
            Target(CROSS_ENTROPY, "VocabParallelCrossEntropy.calculate_predicted_logits",
                   _predicted_logits, kind="staticmethod",
                   params=("vocab_parallel_logits", "target", "logits_max")),
        ),
    ),
    _invariant_patch(
        name="tp_invariant.mlp",
        summary="refuses MLP configurations tp_invariant does not cover (TE, fused); marks a gated fc1 (SwiGLU)",
        hook=MLP,
        targets=(Target(MLP, "MLP.forward", _mlp_forward, kind="method", params=("self", "hidden_states")),),
    ),
    _invariant_patch(
        name="tp_invariant.moe",
        summary="MoE under tp_invariant: router gating GEMM and top-k per token block (the gate's weight gradient "
                "through the token tree); with expert parallelism (alltoall) each source DP rank's tokens one "
                "block in the experts' GEMMs (experts: tp_invariant.tensor_parallel, tp_invariant.mlp)",
        hook=MOE_LAYER,
        backend=_moe_coverage,
        targets=(
            Target(ROUTER, "Router.gating", _router_gating, kind="method", params=("self", "input")),
            Target(ROUTER, "TopKRouter.routing", _router_routing, kind="method", params=("self", "logits")),
            Target(MOE_UTILS, "topk_routing_with_score_function", _per_token_blocks, params=("logits", "topk")),
            Target(MOE_UTILS, "compute_routing_scores_for_aux_loss", _per_token_blocks, params=("logits", "topk")),
            Target(DISPATCHER, "MoEAlltoAllTokenDispatcher.dispatch_postprocess", _alltoall_dispatch_postprocess,
                   kind="method", params=("self", "global_input_tokens", "global_probs")),
            Target(DISPATCHER, "MoEAlltoAllTokenDispatcher.combine_preprocess", _alltoall_combine_preprocess,
                   kind="method", params=("self", "hidden_states")),
        ),
    ),
    _invariant_patch(
        name="tp_invariant.construction",
        summary="refuses at model construction what tp_invariant does not cover (fusions, TE, MoE, few KV groups, shapes W cannot split)",
        hook="megatron.core.transformer.transformer_block",
        targets=(Target("megatron.core.transformer.transformer_block", "TransformerBlock.__init__",
                        _block_init, kind="method", params=("self", "config")),),
        preflight=_preflight_model,
    ),
    _invariant_patch(
        name="tp_invariant.distributed_optimizer",
        summary="refuses several distributed-optimizer instances at construction (their all-reduce is not under the tree)",
        hook="megatron.core.optimizer.distrib_optimizer",
        targets=(Target("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
                        _distributed_optimizer_init, kind="method",
                        params=("self", "optimizer", "config", "grad_scaler", "init_state_fn", "model_chunks")),),
        preflight=_preflight_optimizer,
    ),
    _invariant_patch(
        name="tp_invariant.grad_norm",
        summary="TP-invariant gradient norm for clipping (fixed-tree FP32 sum of squares)",
        hook=OPTIMIZER,
        targets=(
            Target(CLIP_GRADS, "get_grad_norm_fp32", _grad_norm_fp32,
                   params=("grads_for_norm", "norm_type", "grad_stats_parallel_group")),
            Target(OPTIMIZER, "MegatronOptimizer.get_grad_norm", _norm_owner_scope, kind="method",
                   params=("self",)),
            Target(OPTIMIZER, "MegatronOptimizer.clip_grad_norm", _norm_owner_scope, kind="method",
                   params=("self", "clip_grad")),
            Target(OPTIMIZER, "ChainedOptimizer.get_grad_norm", _chained_grad_norm, kind="method",
                   params=("self",)),
        ),
    ),
)
