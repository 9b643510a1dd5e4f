"""Hugging Face mixture-of-experts checkpoints through Megatron-Bridge's ``AutoBridge`` on CPU ranks,
at several TP x EP layouts in one job, with every layer's expert choices recorded.

Used by ``benchmarks/moe_hf.py`` and ``tests/test_bridge.py``; the MoE counterpart of
:mod:`megapatch.testing.scenarios.bridge_llama` (whose provider settings and forward it reuses)
and :mod:`megapatch.testing.scenarios.llama_hf` (tokens, planted outliers' constants, metrics).

Two tiny models, written with transformers (seeded random weights, ``save_pretrained``, BF16,
the word-level tokenizer of ``llama_hf``):

* ``qwen3_moe`` (:func:`build_tiny_hf_moe`): ``Qwen3MoeForCausalLM``, every layer MoE, QK RMSNorm,
  softmax routing renormalised over the top-k (``norm_topk_prob=True``), GQA, untied head;
  Bridge's ``Qwen3MoEBridge``.
* ``hy_v3``: ``HYV3ForCausalLM`` (Tencent's Hy3 architecture), the shared-expert model: DeepSeek-V3-
  style MoE with GQA attention and QK RMSNorm: a dense first layer, then MoE layers with one
  always-on shared expert (no gate), sigmoid routing with a per-expert score-correction bias, top-k
  renormalised and scaled by ``router_scaling_factor``; Bridge's ``HYV3Bridge``, which sets
  ``moe_router_dtype='fp32'``. Not Qwen2-MoE (Bridge 0.6.2 maps none) nor DeepSeek-V3 (its
  multi-latent attention cannot be built without TE in megatron-core 0.19.2: the local
  ``DotProductAttention`` takes no ``k_channels``). Bridge 0.6.2's ``HYV3Bridge`` reads
  ``first_k_dense_replace``, which transformers 5.12's ``HYV3Config`` does not define (it has
  ``mlp_layer_types``): the config is saved with both, consistently.

**Planted outlier channels**, as in ``llama_hf`` (its constants): the delimiter token's embedding
carries ``DELIMITER_SCALE`` in hidden dimension 0; in layer 0's MLP and in the first MoE layer
(the same layer for Qwen3-MoE, layer 1 for Hy-V3), neurons ``OUTLIER_NEURON`` and
``ffn - OUTLIER_NEURON`` of *every routed expert*, of the shared expert and of the dense MLP
read dimension 0 through gate and up and write ``+OUTLIER_SCALE`` and
``-OUTLIER_SCALE * (1 - 1/128)`` into ``OUTLIER_DIMS``. The two neurons sit in the first and the
last expert-TP shard of fc1/fc2 at every TP size > 1, so the nearly cancelling partial sums meet in
the dispatcher's reduce-scatter (routed experts) or the layer's all-reduce (shared expert, dense
MLP), where BF16 loses the remainder.

**Provider settings** (:func:`moe_provider_fields`, on top of ``bridge_llama.configure_provider``'s
CPU settings): expert TP = TP, expert parallel size EP, sequence parallelism at TP > 1, the token
dispatcher (``alltoall`` or ``allgather``), ``moe_grouped_gemm=False`` (sequential experts: the
local spec; megapatch's ``fp32`` refuses grouped GEMM), ``moe_permute_fusion=False`` and
``moe_router_fusion=False`` (CUDA kernels), ``moe_shared_expert_overlap=False`` (it overlaps on a
CUDA stream). Hy-V3 keeps Bridge's own choice of spec for it, megatron-core's decoder-block spec
without TE (``get_gpt_decoder_block_spec(use_transformer_engine=False)``: dense and MoE layers),
which Bridge's ``local_layer_spec`` cannot express.

:func:`forward_layouts` (a rank function for :func:`megapatch.testing.run_ranks`, world = the
largest TP x EP; the other ranks are data-parallel replicas fed the same batch) builds the model
through AutoBridge at each layout in turn, runs the token batch forward and returns on rank 0, per
layout, the logits (all-gathered over TP, trimmed to the vocabulary, float32) and every MoE layer's
expert choice (``[tokens, experts]`` bool, sequence-major token order, gathered over TP:
:func:`megapatch.testing.scenarios.moe_tiny._record_routing`). :func:`hf_forward` is the oracle:
transformers' own forward of the same checkpoint and its routers' choices, in the same token
order. The mode comes from the job's ``MEGAPATCH_*`` variables only.

Nothing here imports torch, transformers or megatron at module level.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from megapatch.testing.scenarios import llama_hf as L

__all__ = ["MODELS", "build_tiny_hf_moe", "moe_provider_fields", "forward_layouts", "hf_forward",
           "routing_disagreement"]

#: the tiny models: transformers model and config classes, config fields; ``block_spec``: built with
#: megatron-core's decoder-block spec (dense and MoE layers), as Bridge chooses for it
MODELS: Dict[str, Dict[str, Any]] = {
    "qwen3_moe": dict(
        cls="Qwen3MoeForCausalLM", config="Qwen3MoeConfig",
        fields=dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=8,
                    num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                    vocab_size=256, rms_norm_eps=1e-6, router_aux_loss_coef=0.0)),
    "hy_v3": dict(
        cls="HYV3ForCausalLM", config="HYV3Config", block_spec=True,
        fields=dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
                    mlp_layer_types=["dense", "sparse", "sparse"], first_k_dense_replace=1,
                    num_attention_heads=8, num_key_value_heads=4,
                    head_dim=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1, vocab_size=256,
                    rms_norm_eps=1e-5)),
}


def build_tiny_hf_moe(out_dir, model: str = "qwen3_moe", *, seed: int = 1234, outliers: bool = True,
                      **fields: Any) -> dict:
    """Saves one of :data:`MODELS` (``fields`` override its config) with seeded random weights in
    BF16 to ``out_dir`` with ``save_pretrained``, plus ``llama_hf``'s tokenizer; returns its
    config.json. Weights: norm gains 1 + 0.1 N(0, 1), every matrix N(0, 1) * 0.5 / sqrt(fan-in),
    Hy-V3's score-correction biases 0.05 N(0, 1) (so a mapping cannot hide behind zeros);
    ``outliers``: the planted channels of the module docstring."""
    import json

    import torch
    import transformers

    spec = MODELS[model]
    config_fields = dict(spec["fields"], max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2, **fields)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    L._tokenizer(config_fields["vocab_size"]).save_pretrained(str(out))
    torch.manual_seed(seed)
    hf = getattr(transformers, spec["cls"])(getattr(transformers, spec["config"])(**config_fields))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            scale = 0.1 if name.endswith("norm.weight") else 0.5 / math.sqrt(param.shape[-1])
            param.copy_((1.0 if name.endswith("norm.weight") else 0.0) + scale * noise)
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
        if outliers:
            _plant_outliers(hf, config_fields["hidden_size"])
    hf = hf.to(torch.bfloat16)
    hf.config.torch_dtype = torch.bfloat16
    hf.save_pretrained(str(out), safe_serialization=True)
    return json.loads((out / "config.json").read_text())


def _plant_outliers(hf, hidden: int) -> None:
    """Module docstring: layer 0's MLP and the first MoE layer (the same layer where every layer
    is MoE). transformers 5 holds the routed experts fused: ``gate_up_proj`` ``[experts, 2 * ffn,
    hidden]`` (gate rows first, as its forward's ``chunk(2)`` reads them) and ``down_proj``
    ``[experts, hidden, ffn]``; ``save_pretrained`` writes them per expert."""
    import torch

    if max(L.OUTLIER_DIMS) >= hidden:
        raise ValueError(f"hidden {hidden} too small for the outlier dimensions {L.OUTLIER_DIMS}")
    hf.model.embed_tokens.weight[L.DELIMITER, 0] = L.DELIMITER_SCALE
    layers = hf.model.layers
    first_moe = next(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
    pairs = ((L.OUTLIER_NEURON, L.OUTLIER_SCALE), (-L.OUTLIER_NEURON, -L.OUTLIER_SCALE * (1 - 1 / 128)))
    for mlp in {id(layers[i].mlp): layers[i].mlp for i in (0, first_moe)}.values():
        for dense in (mlp, getattr(mlp, "shared_experts", None)):
            if dense is None or not isinstance(getattr(dense, "down_proj", None), torch.nn.Linear):
                continue
            ffn = dense.down_proj.weight.shape[1]
            for neuron, scale in pairs:
                dense.gate_proj.weight[neuron % ffn, 0] = dense.up_proj.weight[neuron % ffn, 0] = 1.0
                dense.down_proj.weight[list(L.OUTLIER_DIMS), neuron % ffn] = scale
        routed = getattr(mlp, "experts", None)
        if routed is not None:
            ffn = routed.down_proj.shape[-1]
            for neuron, scale in pairs:
                routed.gate_up_proj[:, neuron % ffn, 0] = routed.gate_up_proj[:, ffn + neuron % ffn, 0] = 1.0
                routed.down_proj[:, list(L.OUTLIER_DIMS), neuron % ffn] = scale


# --- transformers: the oracle ---------------------------------------------------------------------


def hf_forward(hf_dir, token_batch, dtype: str = "fp32") -> Dict[str, Any]:
    """transformers' own forward of the checkpoint (``fp32``: the BF16 weights upcast; ``bf16``):
    ``{"logits": float32 [batch, seq, vocab], "routing": [per MoE layer [tokens, experts] bool]}``,
    the expert choices read from the arguments transformers hands its experts module (the router's
    ``top_k_index``), tokens reordered sequence-major as megatron orders them."""
    import torch
    import transformers

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch_dtype).eval()
    batch, seq = token_batch.shape
    found = []

    def hook(module, args, kwargs):
        index = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
        chosen = torch.zeros(index.shape[0], module.num_experts, dtype=torch.bool)
        chosen.scatter_(1, index.long(), True)
        found.append(chosen.view(batch, seq, -1).transpose(0, 1).reshape(batch * seq, -1))

    handles = [layer.mlp.experts.register_forward_pre_hook(hook, with_kwargs=True)
               for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    try:
        with torch.no_grad():
            logits = model(token_batch).logits.float()
    finally:
        for handle in handles:
            handle.remove()
    return {"logits": logits, "routing": found}


# --- megatron-core through AutoBridge -------------------------------------------------------------


def moe_provider_fields(tp: int, ep: int, dispatcher: str = "alltoall") -> Dict[str, Any]:
    """The MoE provider settings of the module docstring for one layout."""
    return {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": tp,
            "sequence_parallel": tp > 1, "moe_token_dispatcher_type": dispatcher,
            "moe_grouped_gemm": False, "moe_permute_fusion": False, "moe_router_fusion": False,
            "moe_shared_expert_overlap": False}


def _bridge_spec(hf_dir: str):
    """Where ``local_layer_spec`` cannot build the model (dense and MoE layers mixed): Bridge's own
    choice for it, megatron-core's decoder-block spec, without TE as Bridge sets it here."""
    import json

    model_type = json.loads((Path(hf_dir) / "config.json").read_text())["model_type"]
    if not MODELS.get(model_type, {}).get("block_spec"):
        return None
    from functools import partial

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return partial(get_gpt_decoder_block_spec, use_transformer_engine=False)


def forward_layouts(ctx, hf_dir: str, tokens_path: str, vocab: int, layouts: Sequence[Tuple[int, int]],
                    dispatcher: str = "alltoall", bf16: bool = True,
                    overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Rank function (module docstring): each ``(tp, ep)`` of ``layouts`` in turn."""
    import torch

    import megapatch
    from megapatch.testing import reinit_model_parallel
    from megapatch.testing.scenarios.bridge_llama import _build, _forward
    from megapatch.testing.scenarios.moe_tiny import _record_routing
    from megapatch.testing.stand_ins import bridge_compat

    bridge_compat.import_bridge()
    tokens = torch.load(tokens_path)
    spec = _bridge_spec(hf_dir)
    out: Dict[str, Any] = {"logits": {}, "routing": {}, "logits_dtype": {}}
    for tp, ep in layouts:
        ctx = reinit_model_parallel(ctx, tp=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp)
        fields = dict(moe_provider_fields(tp, ep, dispatcher), **(overrides or {}))
        if spec is not None:
            fields.setdefault("transformer_layer_spec", spec)
        module = _build(hf_dir, tp, bf16, fields)
        inner = module.module if hasattr(module, "module") else module
        out["moe_router_dtype"] = inner.config.moe_router_dtype  # Bridge's choice (None: the activations')
        routing = _record_routing(inner, ctx)
        seen: Dict[str, str] = {}
        out["logits"][(tp, ep)], _ = _forward(module, tokens, vocab, seen)
        out["routing"][(tp, ep)] = [r.clone() for r in routing]
        out["logits_dtype"][(tp, ep)] = seen.get("dtype", "?")
        del module
    status = megapatch.status()
    out.update(enabled=status.enabled, sources=dict(status.sources), active=list(status.active))
    return out if ctx.rank == 0 else {}


# --- metrics --------------------------------------------------------------------------------------


def routing_disagreement(routing, reference) -> float:
    """Share of (token, MoE layer) pairs whose top-k expert set differs from ``reference``'s
    (lists of ``[tokens, experts]`` bool, one per MoE layer, same token order)."""
    if len(routing) != len(reference) or not routing:
        raise ValueError(f"{len(routing)} vs {len(reference)} MoE layers recorded")
    changed = sum(int((a != b).any(-1).sum()) for a, b in zip(routing, reference))
    return changed / sum(int(a.shape[0]) for a in routing)


def rerouted_error_share(logits, routing, ref_logits, ref_routing) -> Dict[str, float]:
    """How much of the squared logit error against ``ref`` sits on the tokens whose top-k expert set
    differs from the reference's in at least one MoE layer: ``{"tokens": share of such tokens,
    "error": their share of ||logits - ref||^2}``. Logits ``[batch, seq, vocab]``; routing as
    :func:`routing_disagreement` (sequence-major tokens)."""
    batch, seq = logits.shape[:2]
    changed = sum((a != b).any(-1) for a, b in zip(routing, ref_routing)).bool()
    changed = changed.view(seq, batch).transpose(0, 1)  # -> [batch, seq] as the logits
    squared = (logits.double() - ref_logits.double()).pow(2).sum(-1)
    total = float(squared.sum())
    return {"tokens": float(changed.double().mean()),
            "error": float(squared[changed].sum()) / total if total else 0.0}
