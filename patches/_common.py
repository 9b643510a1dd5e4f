"""What several patch modules share: the versions they were tested on, the megatron-core linear
Functions, a layer's tensor-parallel group, and the decision whether a TP sum runs in FP32."""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch.distributed import distributed_c10d as c10d

from megapatch.core import cross_rank, state
from megapatch.core.registry import Patch
from megapatch.numerics.dtypes import LOW_PRECISION

# Versions each patch was tested on (``Patch.supports``): the matrix re-runs them
# (``python tools/matrix.py``; docs/versions.md shows the generated table).
MEGATRON_CORE_TESTED = {"megatron-core": ">=0.12,<0.21"}
MEGATRON_CORE_TP_REDUCE_TESTED = {"megatron-core": ">=0.13,<0.21"}  # 0.12's _reduce has no group
# tests/test_tp_invariant.py passes on 0.16.1, 0.17.1, 0.18.2, 0.19.2 and main (docs/versions.md);
# below 0.16 the mode refuses (patches/tp_invariant.py: on 0.14.0 Llama-shaped models were not invariant)
MEGATRON_CORE_TP_INVARIANT_TESTED = {"megatron-core": ">=0.16,<0.21"}
TRANSFORMER_ENGINE_TESTED = {"transformer-engine": ">=2.9,<=2.20.2"}

LAYERS = "megatron.core.tensor_parallel.layers"
#: on a RowParallelLinear of an MoE layer's experts (patches/tp_reduce_moe.py): under fp32 it hands
#: on its FP32 accumulator unrounded, for the MoE layer to sum on and round once
MOE_FP32_SUM = "_megapatch_moe_fp32_sum"
#: megatron-core's linear autograd Functions (FP32 outputs, FP32 row-parallel accumulators)
LINEAR_FUNCTIONS = ("LinearWithGradAccumulationAndAsyncCommunication", "LinearWithFrozenWeight")


def when(option: str, value) -> Callable:
    """``Patch.applies`` for a patch that serves ``option`` set to ``value``."""
    return lambda settings: getattr(settings, option) == value


def tp_group(layer):
    """The tensor-parallel group of a megatron-core layer (its own, else the global one)."""
    group = getattr(layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group


def reduction_mode(tensor: torch.Tensor, group) -> Optional[str]:
    """The megapatch mode for summing ``tensor`` over ``group``, or None to run upstream's own
    collective (megapatch off, a group of one, or a tensor that is not BF16/FP16). The first call
    on a group verifies that every rank of the group runs the same settings."""
    settings = state.current()
    if settings.tp_reduce_dtype == "native":
        return None
    if group is None:
        group = c10d.group.WORLD
    if group.size() == 1:
        return None
    cross_rank.ensure_group_agrees(group, settings)
    if tensor.dtype not in LOW_PRECISION:
        return None
    return settings.tp_reduce_dtype


def refuse_tp_invariant(what: str, why: str):
    """Stop what ``tp_invariant`` cannot make invariant, naming it, the reason and where the mode
    was switched on."""
    from megapatch.core.errors import UnsupportedConfigurationError

    raise UnsupportedConfigurationError(
        f"megapatch tp_invariant=True does not support {what}: {why}. tp_invariant was set by "
        f"{state.origin('tp_invariant')}.")


_TP_INVARIANT_VERIFIED_FROM = "0.16"


def tp_invariant_verified_upstream():
    """The guarantee rests on upstream arithmetic the surface check cannot see whole: the version
    matrix found Llama- and Qwen-shaped models not bit-identical across TP sizes under the mode on
    megatron-core 0.14.0 (GPT-shaped ones were), with every target's surface accepted. So releases
    before the first verified one are refused, not run with a warning; an unknown version (a
    source checkout without metadata) is left to the surface check."""
    from megapatch.core.upstream_versions import in_range, version_of

    first = _TP_INVARIANT_VERIFIED_FROM
    version = version_of("megatron-core")
    if version is not None and not in_range(version, f">={first}.0a0"):  # its pre-releases too
        return (f"tp_invariant is verified on megatron-core >= {first} only, and {version} is "
                f"installed: on 0.14.0 Llama-shaped models were not bit-identical across TP sizes under "
                f"the mode, so an older release is refused rather than run without the guarantee")
    return None


#: a patch serving tp_invariant=True: the guarantee needs every one of them (no opt-out), and every
#: one refuses the releases the mode is not verified on
tp_invariant_patch = functools.partial(Patch, option="tp_invariant", applies=when("tp_invariant", True),
                                       guarantee=True, supports=MEGATRON_CORE_TP_INVARIANT_TESTED,
                                       probe=tp_invariant_verified_upstream)


#: what both modes refuse for ``--moe-grouped-gemm`` without TE, naming the flags (TE's grouped experts,
#: ``TEGroupedMLP``, are covered by both)
LEGACY_GROUPED_EXPERTS = ("grouped-GEMM experts without Transformer Engine (Megatron-LM: --moe-grouped-gemm with "
                          "--transformer-impl local, the grouped_gemm package's GroupedMLP; TE's grouped experts, "
                          "--transformer-impl transformer_engine, are covered)")


def tp_invariant_with_te(settings) -> bool:
    """Under the mode, where Transformer Engine is installed: without it megatron-core's TE wrappers
    are stand-ins built on a mock (``HAVE_TE = False``), nothing builds TE layers, and there is
    nothing to wrap (``applies`` of the mode's TE patches)."""
    import importlib.util

    return settings.tp_invariant is True and importlib.util.find_spec("transformer_engine") is not None
