"""The model a Megatron-LM job will build, read from its command line (``megapatch doctor --
<flags>``): the megatron-core config fields megapatch's preflight checks look at, with
Megatron-LM core_v0.16.1's defaults for flags the command line leaves out
(``megatron/training/arguments.py``, the padded vocabulary as ``megatron/training/tokenizer``
pads it; ``tests/test_megatron_lm.py::test_doctor_reads_flags_as_megatron_lm_parses_them`` checks
them against that parser and that padding).

Only the flags below are read; anything else on the command line is ignored.
"""

from __future__ import annotations

import types
from typing import Dict, Optional, Sequence

from megapatch.numerics.block_shapes import padded_vocabulary


def _value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The flag's value; a flag given twice counts at its last occurrence, as argparse does."""
    found = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def _int(argv: Sequence[str], flag: str, default: Optional[int]) -> Optional[int]:
    text = _value(argv, flag)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not an integer") from None


def _padded_vocab_size(argv: Sequence[str], tp: int) -> Optional[int]:
    """``args.padded_vocab_size`` as Megatron-LM's ``build_tokenizer`` sets it: ``--padded-vocab-size``,
    else padded from ``--vocab-size``; None where only the tokenizer's files would tell."""
    padded = _int(argv, "--padded-vocab-size", None)
    if padded is not None:
        return padded
    return padded_vocabulary(_int(argv, "--vocab-size", None), _value(argv, "--tokenizer-type"),
                             _int(argv, "--make-vocab-size-divisible-by", 128), tp,
                             eod_added=_null_tokenizer_adds_eod())


def _null_tokenizer_adds_eod() -> bool:
    """Whether the importable megatron's NullTokenizer counts its EOD token on top of --vocab-size
    (core_v0.16.1: ``vocab_size + 1``) or inside it (Megatron-LM main): asked of upstream's own
    class; where it cannot be imported, core_v0.16.1's rule."""
    try:
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

        return NullTokenizer(8).vocab_size == 9
    except Exception:  # noqa: BLE001 -- no megatron here, or another tokenizer layout
        return True


def _float(argv: Sequence[str], flag: str) -> Optional[float]:
    text = _value(argv, flag)
    return None if text is None else float(text)


#: MoE config fields set by a switch of the field's name (``--moe-permute-fusion``; core_v0.16.1
#: generates them from ``TransformerConfig``), off by default
_MOE_SWITCHES = ("moe_permute_fusion", "moe_router_fusion", "moe_shared_expert_overlap", "moe_shared_expert_gate",
                 "moe_router_force_load_balancing")


def _moe_fields(argv: Sequence[str], flags: set, tp: int) -> Dict[str, object]:
    """The expert layers' fields, with Megatron-LM's defaults (``validate_args``: expert TP = TP
    unless given; the experts' FFN size = ``--ffn-hidden-size`` unless given)."""
    fields: Dict[str, object] = {name: f"--{name.replace('_', '-')}" in flags for name in _MOE_SWITCHES}
    fields.update(
        expert_model_parallel_size=_int(argv, "--expert-model-parallel-size", 1),
        expert_tensor_parallel_size=_int(argv, "--expert-tensor-parallel-size", tp),
        moe_ffn_hidden_size=_int(argv, "--moe-ffn-hidden-size", None),
        moe_shared_expert_intermediate_size=_int(argv, "--moe-shared-expert-intermediate-size", None),
        moe_expert_capacity_factor=_float(argv, "--moe-expert-capacity-factor"),
        moe_input_jitter_eps=_float(argv, "--moe-input-jitter-eps"),
        moe_latent_size=_int(argv, "--moe-latent-size", None),
        moe_router_dtype=_value(argv, "--moe-router-dtype"),
        moe_router_load_balancing_type=_value(argv, "--moe-router-load-balancing-type") or "aux_loss",
        moe_aux_loss_coeff=_float(argv, "--moe-aux-loss-coeff") or 0.0,
        moe_z_loss_coeff=_float(argv, "--moe-z-loss-coeff"),
        calculate_per_token_loss="--calculate-per-token-loss" in flags,
        add_bias_linear="--disable-bias-linear" not in flags,
    )
    return fields


def _ffn_hidden_size(argv: Sequence[str], hidden: Optional[int], swiglu: bool) -> Optional[int]:
    """``--ffn-hidden-size``, else Megatron-LM's default (``validate_args``)."""
    ffn = _int(argv, "--ffn-hidden-size", None)
    if ffn is not None or hidden is None:
        return ffn
    return int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden


def config_from_flags(argv: Sequence[str]) -> types.SimpleNamespace:
    """The config fields (and ``transformer_impl``, ``use_distributed_optimizer``,
    ``num_distributed_optimizer_instances``, the vocabulary's and the sequence's sizes) a
    Megatron-LM job started with ``argv`` builds its model and optimizer with."""
    flags = set(a.split("=", 1)[0] for a in argv)
    swiglu = "--swiglu" in flags
    heads = _int(argv, "--num-attention-heads", None)
    hidden = _int(argv, "--hidden-size", None)
    tp = _int(argv, "--tensor-model-parallel-size", 1)
    kv_channels = _int(argv, "--kv-channels", None)
    if kv_channels is None and hidden is not None and heads:
        kv_channels = hidden // heads
    fields: Dict[str, object] = dict(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=_int(argv, "--pipeline-model-parallel-size", 1),
        context_parallel_size=_int(argv, "--context-parallel-size", 1),
        num_attention_heads=heads,
        hidden_size=hidden,
        ffn_hidden_size=_ffn_hidden_size(argv, hidden, swiglu),
        kv_channels=kv_channels,
        # --num-query-groups counts only with --group-query-attention (else one group per head)
        num_query_groups=_int(argv, "--num-query-groups", 1) if "--group-query-attention" in flags else None,
        gated_linear_unit=swiglu,
        sequence_parallel="--sequence-parallel" in flags,
        qk_layernorm="--qk-layernorm" in flags,
        gradient_accumulation_fusion="--no-gradient-accumulation-fusion" not in flags,
        bias_activation_fusion=("--no-bias-swiglu-fusion" if swiglu else "--no-bias-gelu-fusion") not in flags,
        use_te_activation_func="--use-te-activation-func" in flags,
        defer_embedding_wgrad_compute="--defer-embedding-wgrad-compute" in flags,
        cross_entropy_loss_fusion="--cross-entropy-loss-fusion" in flags,
        num_moe_experts=_int(argv, "--num-experts", None),
        moe_token_dispatcher_type=_value(argv, "--moe-token-dispatcher-type") or "allgather",
        moe_grouped_gemm="--moe-grouped-gemm" in flags,
        **_moe_fields(argv, flags, tp),
        transformer_impl=_value(argv, "--transformer-impl") or "transformer_engine",
        # TE-only settings (core_v0.16.1 generates these flags from TransformerConfig's fields)
        fp8=_value(argv, "--fp8-format"),
        fp4=_value(argv, "--fp4-format"),
        tp_comm_overlap="--tp-comm-overlap" in flags,
        delay_wgrad_compute="--delay-wgrad-compute" in flags,
        spec=_value(argv, "--spec"),  # a job's own layer spec: no TE spec from --transformer-impl
        use_legacy_models="--use-legacy-models" in flags,
        use_distributed_optimizer="--use-distributed-optimizer" in flags,
        num_distributed_optimizer_instances=_int(argv, "--num-distributed-optimizer-instances", 1),
        # Megatron-LM main's --output-logit-dtype {bf16,fp32} (dest logit_dtype; PR #6252)
        logit_dtype=_value(argv, "--output-logit-dtype"),
        seq_length=_int(argv, "--seq-length", None),
        rl_use_sequence_packing="--rl-use-sequence-packing" in flags,  # train_rl.py's packed bins (THD)
        attention_backend=_value(argv, "--attention-backend") or "auto",  # AttnBackend's name
        # the vocabulary: the padded size the model is built with, and the flags that set it
        padded_vocab_size=_padded_vocab_size(argv, tp),
        vocab_size=_int(argv, "--vocab-size", None),
        make_vocab_size_divisible_by=_int(argv, "--make-vocab-size-divisible-by", 128),
        tokenizer_type=_value(argv, "--tokenizer-type"),
    )
    if fields["num_moe_experts"] and fields["moe_ffn_hidden_size"] is None:
        fields["moe_ffn_hidden_size"] = fields["ffn_hidden_size"]
    if heads is None:
        fields["num_attention_heads"] = fields["num_query_groups"] or 1
    return types.SimpleNamespace(**fields)
