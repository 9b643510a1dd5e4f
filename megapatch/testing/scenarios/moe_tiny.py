"""A tiny Qwen3-MoE-shaped megatron-core model on CPU ranks, run once per megapatch mode.

Shape (Qwen3-30B-A3B scaled down, as Megatron-LM's ``examples/rl/model_configs/qwen3_30b_a3b_moe.sh``
builds it): every layer MoE, softmax top-k routing renormalised over the chosen experts
(``moe_router_pre_softmax=False``), SwiGLU experts, QK RMSNorm, grouped-query attention, RoPE,
RMSNorm, no biases, untied output layer; expert TP = TP; sequence parallelism at TP > 1. The
local (non-TE) spec with sequential experts; MoE runs on CPU through the labelled stand-ins of
:mod:`megapatch.testing.stand_ins.moe_cpu`.

:func:`moe_forward` is a rank function for :func:`megapatch.testing.run_ranks` (world = TP x EP,
the EP ranks being data-parallel replicas fed the same batch). Rank 0 returns, per mode, the
full logits (FP32 copies of what the model produced), every layer's top-k expert choice per token
(``[tokens, experts]`` bool, tokens in sequence-major order as at TP=1), the output dtype and, if
asked, the loss and unsharded gradients.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

#: what each mode asks of megapatch.enable (``native``: megapatch off)
MODES: Dict[str, Dict[str, Any]] = {
    "native": {},
    "fp32": {"tp_reduce_dtype": "fp32"},
    "fp32-accumulate": {"tp_reduce_dtype": "fp32-accumulate"},
    "fp32+logits": {"tp_reduce_dtype": "fp32", "logits_dtype": "fp32"},
}

VOCAB, SEQ, BATCH = 128, 32, 2


def qwen3_moe_config(tp: int, dispatcher: str = "alltoall", experts: int = 8, topk: int = 2,
                     params_dtype: torch.dtype = torch.bfloat16, **overrides: Any):
    import torch.nn.functional as F

    from megapatch.testing.models.tiny_gpt import tiny_gpt_config

    fields = dict(
        num_attention_heads=8, num_query_groups=2, qk_layernorm=True, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        num_moe_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=32,
        moe_token_dispatcher_type=dispatcher, moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
        expert_tensor_parallel_size=tp, params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16)
    fields.update(overrides)
    fields.setdefault("sequence_parallel", tp > 1)
    return tiny_gpt_config(tp, **fields)


#: a Transformer Engine spec's parameter name -> the local spec's name of the same weight (the
#: attention's input norm, which TE fuses into ``linear_qkv``); every other name is the same in both
TE_TO_LOCAL = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def local_name(name: str) -> str:
    """The local spec's name of a TE spec's parameter (a grouped expert's ``experts.linear_fc1.weight3``:
    ``experts.local_experts.3.linear_fc1.weight``)."""
    for te, local in TE_TO_LOCAL.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return re.sub(r"experts\.linear_fc(\d)\.weight(\d+)(?=\.|$)", r"experts.local_experts.\2.linear_fc\1.weight",
                  name)


def layer_spec(config, spec: str = "local"):
    """None for the local spec (``build_tiny_gpt``'s default), else megatron-core's Transformer
    Engine spec (``TELayerNormColumnParallelLinear``, TE experts in a ``SequentialMLP``, TE norms and
    attention): built inside the TE CPU runtime (``megapatch.testing.stand_ins.te_runtime``)."""
    if spec == "local":
        return None
    if spec not in SPECS:
        raise ValueError(f"spec={spec!r}: one of {', '.join(SPECS)}")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts,
                                                      moe_grouped_gemm=spec == "te-grouped",
                                                      qk_layernorm=config.qk_layernorm)


#: ``local``: megatron-core's local layers, sequential experts; ``te``: its Transformer Engine spec with
#: sequential TE experts; ``te-grouped``: the TE spec with grouped-GEMM experts (``TEGroupedMLP``,
#: Megatron-LM's ``--moe-grouped-gemm``)
SPECS = ("local", "te", "te-grouped")


def build(config, seed: int = 1234, vocab: int = VOCAB, seq_len: int = SEQ, spec: str = "local"):
    import dataclasses

    from megapatch.testing.models.tiny_gpt import build_tiny_gpt

    if spec == "te-grouped" and not config.moe_grouped_gemm:
        config = dataclasses.replace(config, moe_grouped_gemm=True)
    return build_tiny_gpt(config, vocab_size=vocab, seq_len=seq_len, seed=seed, position_embedding_type="rope",
                          layer_spec=layer_spec(config, spec))


def _global_expert_name(name: str, first_local_expert: int) -> str:
    # sequential experts: ...experts.local_experts.<i>.linear_fc1.weight; grouped (TE's GroupedLinear):
    # ...experts.linear_fc1.weight<i>
    match = re.search(r"local_experts\.(\d+)\.", name) or re.search(r"experts\.linear_fc\d\.weight(\d+)(?=\.|$)", name)
    if match is None:
        return name
    return f"{name[:match.start(1)]}{first_local_expert + int(match.group(1))}{name[match.end(1):]}"


def _shard(full: torch.Tensor, param, name: str, gated: bool, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of ``full`` (by shape: TE's grouped expert weights carry no TP attributes)."""
    if tuple(full.shape) == tuple(param.shape):
        return full
    from megapatch.testing.models.tiny_gpt import partition_dim

    dim = partition_dim(name, param)
    if gated and ".linear_fc1." in f".{name}" and dim == 0:  # rank r: [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


def is_expert_parameter(name: str) -> bool:
    """A routed expert's parameter (sequential or grouped experts)."""
    return "local_experts." in name or re.search(r"\.experts\.linear_fc\d\.", name) is not None


def build_full_then_shard(ctx, ep: int, config, seed: int = 1234, vocab: int = VOCAB, seq_len: int = SEQ,
                          full_weights: Optional[Callable[[Dict[str, torch.Tensor]], None]] = None,
                          spec: str = "local"):
    """The model at this rank's TP x EP layout holding the weights the TP=1, EP=1 model is built
    with (upstream's CPU initialisation draws expert weights from an expert-parallel RNG stream,
    so a model built at EP=2 would hold other experts): the full model is built first at TP=1,
    then each parameter of the sharded model takes its slice (its global expert's, at EP > 1).
    ``full_weights`` may rewrite the full (TP=1) state dict in place first, e.g.
    :func:`outlier_weights`."""
    import dataclasses

    from megatron.core import parallel_state

    from megapatch.testing.ranks.rank_context import reinit_model_parallel

    tp = config.tensor_model_parallel_size
    reinit_model_parallel(ctx, tp=1)
    full_config = dataclasses.replace(config, tensor_model_parallel_size=1, expert_tensor_parallel_size=1,
                                      sequence_parallel=False)
    full = {k: v.detach().clone() for k, v in build(full_config, seed, vocab, seq_len, spec).state_dict().items()
            if not k.endswith("_extra_state")}
    if full_weights is not None:
        full_weights(full)
    etp = config.expert_tensor_parallel_size or tp
    reinit_model_parallel(ctx, tp=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model = build(config, seed, vocab, seq_len, spec)
    local = config.num_moe_experts // ep
    first = parallel_state.get_expert_model_parallel_rank() * local
    with torch.no_grad():
        for name, param in model.named_parameters():
            expert = is_expert_parameter(name)
            rank = (parallel_state.get_expert_tensor_parallel_rank() if expert
                     else parallel_state.get_tensor_model_parallel_rank())
            source = full[_global_expert_name(name, first)]
            param.copy_(_shard(source, param, name, config.gated_linear_unit, rank, etp if expert else tp))
    return model


def weights_of(spec: str, seed: int = 1234, config_overrides: Optional[Dict[str, Any]] = None):
    """A ``full_weights`` rewrite (:func:`build_full_then_shard`): the weights the ``spec`` model is
    built with, under the names of the model being built (e.g. the local spec's weights in a
    ``te-grouped`` model, whose experts draw theirs in another order): the same weights in two specs.
    The ``spec`` model is built once, at the first layout (its weights do not depend on the layout)."""
    drawn: Dict[str, torch.Tensor] = {}

    def rewrite(full: Dict[str, torch.Tensor]) -> None:
        if not drawn:
            config = qwen3_moe_config(1, **(config_overrides or {}))
            drawn.update({local_name(k): v.detach().clone() for k, v in build(config, seed, spec=spec)
                          .state_dict().items() if not k.endswith("_extra_state")})
        names = {local_name(k): k for k in full}
        if drawn.keys() != names.keys():
            raise ValueError(f"the {spec} model's weights do not fill the model: {sorted(drawn.keys() ^ names.keys())}")
        full.update({names[k]: v for k, v in drawn.items()})
    return rewrite


def outlier_weights(seed: int, ffn: int):
    """A ``full_weights`` rewrite (:func:`build_full_then_shard`) giving the model the weight
    statistics and planted outlier channels of ``bridge_moe.build_tiny_hf_moe`` (the Qwen3-MoE of
    results/moe_hf.md), with llama_hf's constants: norm gains 1 + 0.1 N(0, 1), every matrix
    N(0, 1) * 0.5 / sqrt(fan-in) (seeded by ``seed``); the delimiter token carries
    ``DELIMITER_SCALE`` in hidden dimension 0; in layer 0's MoE, neurons ``OUTLIER_NEURON`` and
    ``ffn - OUTLIER_NEURON`` of every routed expert read it through gate and up and write
    ``+OUTLIER_SCALE`` and ``-OUTLIER_SCALE * (1 - 1/128)`` into ``OUTLIER_DIMS``: nearly cancelling
    partial sums on the first and the last expert-TP rank, which meet in the dispatcher's
    reduce-scatter."""
    import math

    from megapatch.testing.scenarios import llama_hf as L

    def rewrite(full: Dict[str, torch.Tensor]) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name in sorted(full):
            value = full[name]
            if not value.is_floating_point():
                continue
            noise = torch.randn(value.shape, generator=generator)
            norm = name.endswith("norm.weight")
            value.copy_((1.0 if norm else 0.0) + (0.1 if norm else 0.5 / math.sqrt(value.shape[-1])) * noise)
        full["embedding.word_embeddings.weight"][L.DELIMITER, 0] = L.DELIMITER_SCALE
        planted = 0
        for name, value in full.items():
            if not name.startswith("decoder.layers.0.mlp.experts."):
                continue
            for neuron, scale in ((L.OUTLIER_NEURON, L.OUTLIER_SCALE),
                                  (ffn - L.OUTLIER_NEURON, -L.OUTLIER_SCALE * (1 - 1 / 128))):
                if name.endswith("linear_fc1.weight"):  # [gate; up]
                    value[neuron, 0] = value[ffn + neuron, 0] = 1.0
                    planted += 1
                elif name.endswith("linear_fc2.weight"):
                    value[list(L.OUTLIER_DIMS), neuron] = scale
        if not planted:
            raise ValueError("no routed expert in layer 0 to plant the outlier channels in")

    return rewrite


def delimited_batch(batch_seed: int, batch: int, seq_len: int, vocab: int):
    """``make_batch``'s layout with llama_hf's delimiter token every 16 positions (from 3)."""
    from megapatch.testing.models.tiny_gpt import make_batch
    from megapatch.testing.scenarios import llama_hf as L

    made = make_batch(seed=batch_seed, batch=batch, seq_len=seq_len, vocab=vocab)
    made.tokens[:, 3::16] = L.DELIMITER
    return made


def _record_routing(model, ctx) -> list:
    """Every router's top-k choice per token, gathered over the TP group (sequence-parallel
    shards) with plain torch."""
    from megatron.core.transformer.moe.router import TopKRouter

    found: list = []

    def hook(module, args, output):
        routing_map = output[1].detach().contiguous()
        if module.config.sequence_parallel and ctx.tp_size > 1:
            parts = [torch.empty_like(routing_map) for _ in range(ctx.tp_size)]
            torch.distributed.all_gather(parts, routing_map, group=ctx.tp_group)
            routing_map = torch.cat(parts, dim=0)
        found.append(routing_map)

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(hook)
    return found


def moe_forward(ctx, modes: Sequence[str], dispatcher: str = "alltoall", ep: int = 1, batch_seed: int = 5,
                grads: bool = False, config_overrides: Optional[Dict[str, Any]] = None,
                spec: str = "local") -> Optional[dict]:
    import megapatch
    from megapatch.core.errors import MegapatchError
    from megapatch.testing.models.tiny_gpt import gather_full_grads, gather_tp_logits

    model = build_full_then_shard(ctx, ep, qwen3_moe_config(ctx.tp_size, dispatcher, **(config_overrides or {})),
                                  spec=spec)
    routing = _record_routing(model, ctx)
    batch = make_batch_for_model(batch_seed)
    results: Dict[str, Any] = {}
    for mode in modes:
        megapatch.disable()
        if MODES[mode]:
            megapatch.enable(**MODES[mode])
        routing.clear()
        model.zero_grad(set_to_none=True)
        try:
            logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
        except MegapatchError as exc:
            results[mode] = {"refused": str(exc)}
            continue
        entry = {"logits": gather_tp_logits(logits, ctx).float(), "dtype": str(logits.dtype),
                 "routing": [r.clone() for r in routing], "active": megapatch.status().active}
        if grads:
            loss = _vocab_parallel_loss(logits, batch.labels)
            loss.backward()
            entry["loss"] = loss.detach().float()
            entry["grads"] = gather_full_grads(model, ctx)
        results[mode] = entry
    megapatch.disable()
    return results if ctx.rank == 0 else None


def _vocab_parallel_loss(logits, labels):
    from megatron.core import tensor_parallel

    return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels).mean()


def make_batch_for_model(batch_seed: int = 5):
    from megapatch.testing.models.tiny_gpt import make_batch

    return make_batch(seed=batch_seed, batch=BATCH, seq_len=SEQ, vocab=VOCAB)


def fp32_reference(ctx, batch_seed: int = 5, dispatcher: str = "alltoall",
                   config_overrides: Optional[Dict[str, Any]] = None, spec: str = "local") -> Optional[dict]:
    """The same weights (the BF16 model's, held in FP32) run in FP32 at TP=1, EP=1 in the local
    spec's layers: logits and expert choices, the yardstick for every layout and mode. ``spec``: the
    spec the weights are drawn in (a TE model's weights run through the local layers: an independent
    path)."""
    overrides = config_overrides or {}
    bf16_model = build(qwen3_moe_config(1, dispatcher, **overrides), spec=spec)
    model = build(qwen3_moe_config(1, dispatcher, params_dtype=torch.float32, **overrides))
    weights = {local_name(k): v for k, v in bf16_model.state_dict().items() if not k.endswith("_extra_state")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any(not k.endswith("_extra_state") for k in missing):
        raise ValueError(f"the {spec} model's weights do not fill the FP32 reference: missing {missing}, "
                         f"unexpected {unexpected}")
    routing = _record_routing(model, ctx)
    batch = make_batch_for_model(batch_seed)
    with torch.no_grad():
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask).float()
    return {"logits": logits, "routing": [r.clone() for r in routing]} if ctx.rank == 0 else None


def reduce_data_parallel_grads(model) -> None:
    """What megatron-core's DDP does with the gradients at the end of a step (this harness trains
    without its wrapper): scaled by 1 / DP and summed over the data-parallel group, expert
    parameters (``allreduce=False``) over the expert-data-parallel group."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    if dp == 1:
        return
    groups = {True: parallel_state.get_data_parallel_group(),
              False: parallel_state.get_expert_data_parallel_group()}
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(1.0 / dp)
            group = groups[getattr(param, "allreduce", True)]
            if group.size() > 1:
                torch.distributed.all_reduce(param.grad, group=group)


def _over_experts(found: Dict[str, torch.Tensor], local: int) -> Dict[str, torch.Tensor]:
    """Tensors keyed by parameter name, local expert indices (``local`` experts per EP rank) made
    global, gathered over the EP group."""
    from megatron.core import parallel_state

    first = parallel_state.get_expert_model_parallel_rank() * local
    mine = {_global_expert_name(name, first): value for name, value in found.items()}
    group = parallel_state.get_expert_model_parallel_group()
    if group.size() == 1:
        return mine
    every: list = [None] * group.size()
    torch.distributed.all_gather_object(every, mine, group=group)
    return {name: value for part in every for name, value in part.items()}


def invariant_training(ctx, layouts: Sequence[Tuple[int, int]], dispatcher: str, steps: int = 3,
                       clip: float = 0.05, modes: Sequence[str] = ("tp_invariant",),
                       config_overrides: Optional[Dict[str, Any]] = None, spec: str = "local",
                       full_weights: Optional[Callable[[Dict[str, torch.Tensor]], None]] = None):
    """Per mode and (TP, EP) layout (expert TP = TP; sequence parallelism at TP > 1; DP = the world
    size / TP, each data-parallel rank fed its own batches, gradients reduced as megatron's DDP
    reduces them): step 0's logits, every router's expert choices and the per-token losses of
    data-parallel rank 0, the unsharded gradients (every expert's, gathered over EP), then ``steps``
    clipped AdamW steps (megatron's BF16 optimizer): their grad norms and the parameters and Adam
    moments after them. ``tp_invariant``: megapatch's mode; ``native``: megapatch off.
    ``full_weights``: as for :func:`build_full_then_shard`."""
    import megapatch
    from megatron.core import parallel_state

    from megapatch.testing.models.tiny_gpt import (
        build_bf16_optimizer, cuda_type_names, gather_full_grads, gather_full_weights, gather_tp_logits,
        sum_tp_replicated_grads)
    from megapatch.testing.ranks.rank_context import _megatron_context

    out: Dict[Any, Any] = {}
    for mode in modes:
        for tp, ep in layouts:
            megapatch.disable()
            if mode == "tp_invariant":
                megapatch.enable(tp_invariant=True)
            config = qwen3_moe_config(tp, dispatcher, expert_model_parallel_size=ep, **(config_overrides or {}))
            model = build_full_then_shard(ctx, ep, config, spec=spec, full_weights=full_weights)
            local = config.num_moe_experts // ep
            ctx = _megatron_context(ctx)  # the layout build_full_then_shard set up
            dp_rank = parallel_state.get_data_parallel_rank()
            routing = _record_routing(model, ctx)
            optimizer = build_bf16_optimizer(model, clip_grad=clip)
            norms = []
            for step in range(steps + 1):
                batch = make_batch_for_model(5 + step + 1000 * dp_rank)
                optimizer.zero_grad()
                routing.clear()
                losses = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
                losses.float().mean().backward()
                sum_tp_replicated_grads(ctx, model)
                reduce_data_parallel_grads(model)
                if step == 0:
                    with torch.no_grad():
                        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
                    entry = {"logits": gather_tp_logits(logits, ctx).float(), "losses": losses.detach().float(),
                             "routing": [r.clone() for r in routing[-config.num_layers:]],
                             "grads": _over_experts(gather_full_grads(model, ctx), local)}
                    if not steps:
                        break
                with cuda_type_names():
                    ok, norm, _ = optimizer.step()
                assert ok
                norms.append(norm)
            entry["norms"] = norms
            entry["params"] = _over_experts({n: p.float() for n, p in gather_full_weights(model, ctx).items()}, local)
            entry["adam"] = _over_experts(adam_states(model, optimizer, ctx), local) if steps else {}
            out[(mode, tp, ep)] = entry
    megapatch.disable()
    return out if ctx.rank == 0 else None


def adam_states(model, optimizer, ctx) -> Dict[str, torch.Tensor]:
    """Unsharded Adam moments after the last step, ``"<param>.exp_avg"`` / ``".exp_avg_sq"``: the
    FP32 main copies megatron's BF16 optimizer steps (``fp32_from_float16_groups``) are matched to
    their model parameters and gathered as those are (a gated fc1 as [gate; up])."""
    import itertools

    from megapatch.testing.models.tiny_gpt import _gather_param

    names = {id(p): n for n, p in model.named_parameters()}
    pairs = zip(itertools.chain.from_iterable(optimizer.float16_groups),
                itertools.chain.from_iterable(optimizer.fp32_from_float16_groups))
    found = {}
    for param, main in pairs:
        state = optimizer.optimizer.state[main]
        for moment in ("exp_avg", "exp_avg_sq"):
            found[f"{names[id(param)]}.{moment}"] = _gather_param(names[id(param)], state[moment], param, model,
                                                                  ctx.tp_group).float()
    return found
