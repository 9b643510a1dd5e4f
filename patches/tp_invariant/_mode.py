"""How a ``tp_invariant`` record is made and how the mode refuses: every record serves
``tp_invariant=True``, admits no opt-out (the guarantee needs all of them) and refuses the
megatron-core releases the mode is not verified on; a refusal names what, why, and where the mode
was switched on."""

from __future__ import annotations

import functools

from megapatch.core import state
from megapatch.core.registry import Patch
from megapatch.patches._common import MEGATRON_CORE_TP_INVARIANT_TESTED, when


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


def tp_invariant_with_te(settings) -> bool:
    """Under the mode, where Transformer Engine is installed: without it megatron-core's TE wrappers
    are stand-ins built on a mock (``HAVE_TE = False``), nothing builds TE layers, and there is
    nothing to wrap (``applies`` of the mode's TE patches)."""
    import importlib.util

    return settings.tp_invariant is True and importlib.util.find_spec("transformer_engine") is not None
