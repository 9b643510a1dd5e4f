"""The model a Megatron-LM job will build, read from its command line (``megapatch doctor --
<flags>``): the megatron-core config fields megapatch's preflight checks look at, with
Megatron-LM core_v0.16.1's defaults for flags the command line leaves out
(``megatron/training/arguments.py``; ``tests/test_doctor.py`` checks them against that parser).

Only the flags below are read; anything else on the command line is ignored.
"""

from __future__ import annotations

import types
from typing import Dict, Optional, Sequence


def _value(argv: Sequence[str], flag: str) -> Optional[str]:
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


def config_from_flags(argv: Sequence[str]) -> types.SimpleNamespace:
    """The config fields (and ``transformer_impl``, ``use_distributed_optimizer``,
    ``num_distributed_optimizer_instances``) a Megatron-LM
    job started with ``argv`` builds its model and optimizer with."""
    flags = set(a.split("=", 1)[0] for a in argv)
    swiglu = "--swiglu" in flags
    heads = _int(argv, "--num-attention-heads", None)
    fields: Dict[str, object] = dict(
        tensor_model_parallel_size=_int(argv, "--tensor-model-parallel-size", 1),
        pipeline_model_parallel_size=_int(argv, "--pipeline-model-parallel-size", 1),
        num_attention_heads=heads,
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
        transformer_impl=_value(argv, "--transformer-impl") or "transformer_engine",
        use_distributed_optimizer="--use-distributed-optimizer" in flags,
        num_distributed_optimizer_instances=_int(argv, "--num-distributed-optimizer-instances", 1),
        # Megatron-LM main's --output-logit-dtype {bf16,fp32} (dest logit_dtype; PR #6252)
        logit_dtype=_value(argv, "--output-logit-dtype"),
    )
    if heads is None:
        fields["num_attention_heads"] = fields["num_query_groups"] or 1
    return types.SimpleNamespace(**fields)
