"""What stops a Megatron-LM job before any megapatch check could (``megapatch doctor -- <flags>``):
Megatron-LM's default Transformer Engine layers where TE is not installed, and Megatron-LM's and
megatron-core's own checks of MoE flags (grouped GEMM without CUDA, experts that the expert
parallel size does not divide, fused permutation without TE)."""

from __future__ import annotations

import importlib.util
from typing import List

_STOPS_FIRST = " (this stops the job before any megapatch check)"


def _upstream_stop_causes(config) -> List[tuple]:
    """``[(cause in a few words, the whole reason), ...]``: what stops the flags' job before any
    megapatch check could. Megatron-LM's default Transformer Engine layers where TE is not
    installed (the rule the run applies itself where megapatch is active:
    ``patches.cross_rank.transformer_engine_stop``), and Megatron-LM core_v0.16.1's own checks of
    MoE flags, which run before megatron-core's model-parallel state exists (``validate_args``,
    then ``TransformerConfig.__post_init__``): megapatch never gets to refuse those jobs."""
    from megapatch.patches.cross_rank.publish_settings import transformer_engine_missing, transformer_engine_stop

    found = []  # in the order upstream meets them
    experts, ep = getattr(config, "num_moe_experts", None), getattr(config, "expert_model_parallel_size", 1) or 1
    if getattr(config, "moe_grouped_gemm", False) and not _cuda_available():
        cause = "--moe-grouped-gemm without CUDA"
        found.append((cause, f"{cause}: Megatron-LM's validate_args asks torch.cuda for the GPU's compute "
                             f"capability (grouped GEMM needs >= 8.0) and fails on a machine without CUDA. "
                             f"Leave --moe-grouped-gemm off there"))
    if ep > 1 and (not experts or experts % ep):
        cause = (f"--num-experts {experts} is not a multiple of --expert-model-parallel-size {ep}" if experts
                 else f"--expert-model-parallel-size {ep} without --num-experts")
        found.append((cause, f"{cause}: Megatron-LM's validate_args refuses it (AssertionError: \"Number of experts "
                             f"should be a multiple of expert model parallel_size\"). Use a number of experts "
                             f"that {ep} divides, or another --expert-model-parallel-size"))
    if getattr(config, "moe_permute_fusion", False) and not _fused_permute_available():
        cause = "--moe-permute-fusion without Transformer Engine"
        found.append((cause, f"{cause}: megatron-core's TransformerConfig refuses it (ValueError: fused "
                             f"permutation is not available. Please install TE >= 2.1.0; or an ImportError "
                             f"of fused_permute where megatron-core has no such function). Leave "
                             f"--moe-permute-fusion off, or install transformer-engine >= 2.1"))
    stop = transformer_engine_stop(config)
    if stop:
        found.append((transformer_engine_missing(config), stop))
    return found


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 -- no torch, or a broken CUDA runtime: no GPU for upstream either
        return False


def _fused_permute_available() -> bool:
    """Whether megatron-core's MoE utilities have Transformer Engine's fused permutation (upstream's
    own record where it can be imported, else whether TE can be found)."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception:  # noqa: BLE001 -- no megatron here: TE is what upstream would need
        return importlib.util.find_spec("transformer_engine") is not None
    return all(getattr(moe_utils, name, None) is not None for name in ("fused_permute", "fused_unpermute"))


def _stop_lines(causes: List[tuple]) -> List[str]:
    return [f"{stop}{_STOPS_FIRST}" for _, stop in causes]


def _upstream_stops(config) -> List[str]:
    """What stops the flags' job before any megapatch check could, each reason in full."""
    return _stop_lines(_upstream_stop_causes(config))

