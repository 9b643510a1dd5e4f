"""Publish this rank's megapatch settings when megatron-core sets up model parallelism -- on every
rank where megapatch is enabled, native settings included -- and verify the tensor-parallel group
there (see ``megapatch.core.cross_rank``). Megatron-LM imports megatron before the process group exists,
so this is the first moment a rank explicitly set to ``native`` can tell its peers.

It is also the first moment a Megatron-LM job's arguments are known (``initialize_megatron``
parses them, then sets up model parallelism), before any model is built: where megapatch is
active (its settings ask for a change), a job with ``--transformer-impl transformer_engine`` whose
megatron-core cannot import Transformer Engine is stopped here, in megapatch's words (those of
``megapatch doctor -- <flags>``), instead of on upstream's ``NameError: TESpecProvider`` while the
layer specification is built. Megapatch enabled with native settings, or switched off, leaves
that job to upstream, untouched."""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional

from megapatch.core import cross_rank, state
from megapatch.core.errors import UnsupportedConfigurationError
from megapatch.core.registry import Patch, Target
from megapatch.numerics import block_shapes
from megapatch.patches._common import MEGATRON_CORE_TESTED

#: the module whose ``TESpecProvider`` Megatron-LM's GPT layer specs call: core_v0.16.1 leaves the
#: name undefined when its import of Transformer Engine fails (NameError), main sets it to None
GPT_LAYER_SPECS = "megatron.core.models.gpt.gpt_layer_specs"
TE_MISSING = "Transformer Engine is not installed"


def _transformer_engine_importable() -> bool:
    """Whether megatron-core's GPT layer specs have Transformer Engine: their own record where
    they are loaded (a TE that is installed but fails to import counts as missing, as it does
    there), else whether a ``transformer_engine`` package can be found."""
    specs = sys.modules.get(GPT_LAYER_SPECS)
    if specs is not None:
        return getattr(specs, "TESpecProvider", None) is not None
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_engine_missing(args) -> Optional[str]:
    """Why the Megatron-LM job of ``args`` (its parsed arguments, or the doctor's reading of its
    flags) has no Transformer Engine for the layers it asks for, in a few words, or None. A job
    with its own ``--spec`` or the legacy models builds no Transformer Engine spec from
    ``--transformer-impl``."""
    if (getattr(args, "transformer_impl", None) != "transformer_engine" or getattr(args, "spec", None)
            or getattr(args, "use_legacy_models", False) or _transformer_engine_importable()):
        return None
    if importlib.util.find_spec("transformer_engine") is not None:
        return "Transformer Engine is installed, but megatron-core cannot import it"
    return TE_MISSING


def transformer_engine_stop(args) -> Optional[str]:
    """Where the job of ``args`` would stop for lack of Transformer Engine, the whole reason and
    what to change, else None."""
    cause = transformer_engine_missing(args)
    if cause is None:
        return None
    return (f"{cause}, and --transformer-impl transformer_engine (Megatron-LM's default) needs it: the job "
            f"would stop while building its layer specification (upstream raises NameError: TESpecProvider). "
            f"Pass --transformer-impl local, or install transformer-engine")


def _refuse_missing_transformer_engine(settings) -> None:
    if not settings.requested():  # megapatch changes nothing here (native, or the kill switch)
        return
    stop = transformer_engine_stop(block_shapes.megatron_lm_args())
    if stop:
        raise UnsupportedConfigurationError(
            f"megapatch stops this Megatron-LM job at model-parallel initialisation, before any model is "
            f"built: {stop}.")


def _initialize_model_parallel(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    settings = state.current()
    cross_rank.model_parallel_initialized(settings)
    _refuse_missing_transformer_engine(settings)  # every rank: its peers have published first
    return result


PATCHES = (
    Patch(
        name="cross_rank.publish_settings",
        supports=MEGATRON_CORE_TESTED,
        option=None,
        summary="publish this rank's settings and check its TP group at model-parallel initialisation "
                "(and stop a Megatron-LM job that asks for Transformer Engine layers without TE)",
        hook="megatron.core.parallel_state",
        applies=lambda s: True,
        announces=True,
        targets=(Target("megatron.core.parallel_state", "initialize_model_parallel",
                        _initialize_model_parallel),),
    ),
)
