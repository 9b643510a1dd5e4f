"""Where an expert's tokens come from (expert parallelism with the alltoall dispatcher): each source
data-parallel rank's rows are one block in every expert GEMM (``TokenSources``; the dispatcher's
TP-major chunks reordered EP-major), and each source's FP32 partial of an expert's weight gradient a
term of the exact data-parallel sum. At construction each layer's dispatcher is linked to its
local experts and every expert parameter keyed by (layer, global expert, parameter) for the grad
norm's order across EP ranks."""

from __future__ import annotations

import torch

from megapatch.core.call_args import argument
from megapatch.numerics import expert_call
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import gradient_terms
from megapatch.patches.tp_invariant._marks import EXPERT_KEY, EXPERTS, GATED, PARTITION_DIM, RESTORE, SOURCES
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant
from megapatch.patches.tp_invariant._parallel_state import data_parallel, ep_data_parallel_ranks
from megapatch.patches.tp_invariant._refusal_tables import LEGACY_GROUPED


DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"


def alltoall_dispatch_postprocess(wrapped, instance, args, kwargs):
    """With expert parallelism each local expert's rows arrive from (TP rank, EP rank) chunks in
    TP-major order; they are reordered EP-major, so that each source data-parallel rank's rows are
    one block in sequence order (as they are on that rank without expert parallelism), and the
    blocks are recorded for the expert's GEMMs and weight gradient (``TokenSources``)."""
    tokens, tokens_per_expert, probs = wrapped(*args, **kwargs)
    if not tpi.active() or instance.ep_size == 1:
        return tokens, tokens_per_expert, probs
    chunks = getattr(instance, "num_global_tokens_per_local_expert", None)
    if instance.num_local_experts == 1 or chunks is None:
        refuse_tp_invariant(f"one expert per EP rank ({instance.ep_size} EP ranks; Megatron-LM: --num-experts)",
                "the dispatcher then keeps no per-source token counts; use more experts than EP ranks")
    tp, ep, local = instance.tp_size, instance.ep_size, instance.num_local_experts
    counts = chunks.reshape(tp, ep, local).tolist()
    _, size, group = data_parallel()
    leaves = tuple(ep_data_parallel_ranks(instance))
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
        sources.append(gradient_terms.TokenSources(tuple(sum(counts[j][k][e] for j in range(tp)) for k in range(ep)),
                                        leaves, group, size))
    order = torch.tensor(order, dtype=torch.long, device=tokens.device)
    setattr(instance, RESTORE, torch.argsort(order))  # the inverse permutation, for the combine
    experts = getattr(instance, EXPERTS, None)
    if experts is None or len(experts) != local:
        refuse_tp_invariant("an expert-parallel MoE layer built before tp_invariant was switched on",
                "the mode links each layer's experts to its dispatcher when the model is built")
    for expert, found in zip(experts, sources):
        setattr(expert, SOURCES, found)
    return tokens.index_select(0, order), tokens_per_expert, probs.index_select(0, order)


def alltoall_combine_preprocess(wrapped, instance, args, kwargs):
    if not tpi.active() or instance.ep_size == 1:
        return wrapped(*args, **kwargs)
    hidden = argument(args, kwargs, 0, "hidden_states")
    return wrapped(hidden.index_select(0, getattr(instance, RESTORE)))


def mark_experts(name: str, module) -> None:
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
            setattr(fc1, PARTITION_DIM, 0)
            if getattr(experts.config, "gated_linear_unit", False):
                setattr(fc1, GATED, 2)
    else:
        refuse_tp_invariant(f"experts of type {type(experts).__qualname__} ({name}.experts)", LEGACY_GROUPED)
    setattr(dispatcher, EXPERTS, local)
    layer = int(next((p for p in reversed(name.split(".")) if p.isdigit()), 0))
    first = dispatcher.local_expert_indices[0]
    for i, expert_params in enumerate(params):
        for j, param in enumerate(expert_params):
            setattr(param, EXPERT_KEY, (layer, first + i, j))
    for fc2 in fc2s:
        setattr(fc2, PARTITION_DIM, 1)
