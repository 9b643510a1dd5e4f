"""``logits.fp32_lm_head_mamba``: the hybrid/Mamba model calls its output layer as ``GPTModel`` does
(megatron-core >= 0.12), so it is marked the same way (helpers: ``_lm_head``)."""

from __future__ import annotations

from megapatch.patches.logits._lm_head import MAMBA, model_marking_patch

PATCHES = (
    model_marking_patch("logits.fp32_lm_head_mamba", MAMBA, "MambaModel",
                        "FP32 LM-head logits for MambaModel (same marking as GPTModel)"),
)
