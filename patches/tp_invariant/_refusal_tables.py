"""What ``tp_invariant`` refuses, as data: config fields (``REFUSED_CONFIG``) and MoE settings
(``MOE_REFUSED``) with the Megatron-LM flag and the reason, and the functions that turn a config
into ``[(what, why), ...]`` -- the same ones at model construction and in ``megapatch doctor``."""

from __future__ import annotations

from megapatch.numerics import block_shapes
from megapatch.patches._common import LEGACY_GROUPED_EXPERTS


def _fused_activation_flag(config) -> str:
    # Megatron-LM sets bias_activation_fusion from --bias-swiglu-fusion for --swiglu, else from
    # --bias-gelu-fusion: only one of the two flags counts for a given model
    swiglu = getattr(config, "gated_linear_unit", False)
    return f"on by default; {'--no-bias-swiglu-fusion' if swiglu else '--no-bias-gelu-fusion'}"


#: config field -> (is it refused for this value, Megatron-LM flag that sets it (or a function of
#: the config giving it), why)
REFUSED_CONFIG = {
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


MOE_BIAS = ("expert biases (add_bias_linear=True with --num-experts; Megatron-LM: on by default; "
             "--disable-bias-linear)", "upstream's expert MLP adds them scaled by the routing "
             "probabilities, outside the mode's layers")


#: like REFUSED_CONFIG, for models with expert layers (--num-experts)
MOE_REFUSED = {
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
    "add_bias_linear": (bool, "on by default; --disable-bias-linear", MOE_BIAS[1]),
}


LEGACY_GROUPED = (LEGACY_GROUPED_EXPERTS, "their kernels choose their blocking by the tokens each expert receives")


def moe_coverage() -> str:
    """What ``tp_invariant.moe`` covers and what the mode refuses in expert layers (status, doctor,
    the job-log line), from the refusal table itself."""
    refused = [f"{field} ({flag})" for field, (_, flag, _) in MOE_REFUSED.items()]
    refused += [_MOE_EP[0], "one expert per EP rank", "expert_tensor_parallel_size other than the TP size",
                "calculate_per_token_loss with an aux or z loss", LEGACY_GROUPED[0]]
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
    found = [r for r in (field_refusal(config, field, MOE_REFUSED) for field in MOE_REFUSED) if r]
    if getattr(config, "moe_grouped_gemm", False) and getattr(config, "transformer_impl", None) == "local":
        found.append(LEGACY_GROUPED)  # (a built layer is judged by its experts' type: mark_experts)
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


def field_refusal(config, field, table=None):
    """``(what, why)`` when ``config``'s ``field`` has a value the mode cannot cover, else None."""
    refused, flag, why = (table or REFUSED_CONFIG)[field]
    value = getattr(config, field, None)
    if not refused(value):
        return None
    return f"{field}={value} (Megatron-LM: {flag(config) if callable(flag) else flag})", why


def config_refusals(config, vocabulary=None, seq_length=None, layout=None):
    """``[(what, why), ...]``: every config field the mode cannot cover, then the TP size against
    the width, every TP-split dimension the width does not divide (the sequence with sequence
    parallelism: ``seq_length`` where the config has none) and the padded ``vocabulary``
    (``block_shapes``; None: not known)."""
    found = [r for r in (field_refusal(config, field) for field in REFUSED_CONFIG) if r]
    found += _moe_refusals(config, layout)
    tp = block_shapes.tp_size(config)
    groups = getattr(config, "num_query_groups", None) or config.num_attention_heads
    if groups < tp:
        found.append(few_kv_groups(groups, tp))
    found += block_shapes.shape_refusals(config, seq_length)
    vocabulary_refusal = block_shapes.vocabulary_refusal(vocabulary, tp) if vocabulary is not None else None
    return found + ([vocabulary_refusal] if vocabulary_refusal else [])


def few_kv_groups(groups: int, tp: int):
    return (f"num_query_groups={groups} (--num-query-groups) below the TP size {tp}",
            "the key/value gradients of one group are then summed across ranks outside the fixed tree")


def described(refusals) -> str:
    """What a preflight check reports: the refusals the patch would raise, in its words."""
    return "; ".join(f"does not support {what}: {why}" for what, why in refusals) or None


def optimizer_instances(instances):
    return (f"num_distributed_optimizer_instances={instances} (Megatron-LM: "
            f"--num-distributed-optimizer-instances)",
            "the instances' gradient all-reduce is not under the fixed tree")
