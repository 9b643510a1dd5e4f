"""``logits.fp32_lm_head``: ``GPTModel`` marks its output layer for FP32 logits (helpers: ``_lm_head``)."""

from __future__ import annotations

from megapatch.core.registry import Target
from megapatch.patches._common import LAYERS
from megapatch.patches.logits._lm_head import GPT, LANGUAGE_MODULE, model_forward, model_marking_patch, preflight

PATCHES = (
    model_marking_patch(
        "logits.fp32_lm_head", GPT, "GPTModel",
        "FP32 LM-head logits with the GEMM accumulator kept (GPTModel marks its output layer)",
        watches=(f"{GPT}:GPTModel._postprocess", f"{LAYERS}:ColumnParallelLinear.__init__"),
        # the dynamic engine's MTP / speculative drafts (megatron-core >= 0.18) call the output
        # layer here, outside GPTModel.forward; one wrapper serves GPTModel and the hybrid model
        # (the inference wrapper imports gpt_model, so this hook fires before any MTP step)
        extra=(Target(LANGUAGE_MODULE, "LanguageModule.compute_mtp_single_step", model_forward,
                      kind="method", params=("self", "hidden_states", "next_token_ids", "position_ids"),
                      optional=True),),
        preflight=preflight),
)
