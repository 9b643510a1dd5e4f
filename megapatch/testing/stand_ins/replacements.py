"""How every CPU stand-in module replaces an upstream attribute for a scope and puts it back: a
:class:`Workaround` record (the attribute, the CUDA-only call it replaces, how to build the
replacement), resolving its target, and :class:`Replacements` (apply, then restore the exact
originals, last first). Used by ``cpu_compat``, ``megatron_lm_compat``, the dynamic engine's,
the converter's, Megatron-Bridge's and RL's stand-ins, and the TE CPU runtime."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["Workaround", "Replacements"]


@dataclass(frozen=True)
class Workaround:
    """One attribute replaced for the duration of :func:`cpu_workarounds`.

    ``module``/``attr`` name the patched object (``attr`` may be dotted, e.g.
    ``"CudaRNGStatesTracker.add"``); ``replaces`` names the upstream CUDA-only
    call(s) that made the patch necessary; ``make`` builds the replacement from
    the original attribute.
    """

    module: str
    attr: str
    replaces: str
    make: Callable[[Any], Any]
    optional: bool = False  # skipped when this megatron-core lacks the target
    creates: bool = False  # the module may lack the attribute (``make`` then gets None)


def _resolve(workaround: Workaround) -> Optional[Tuple[Any, str]]:
    """(owner object, leaf name) of the patch target; None if an optional one is missing."""
    import importlib

    try:
        owner = importlib.import_module(workaround.module)
        *path, leaf = workaround.attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        if not workaround.creates:
            getattr(owner, leaf)
    except (ImportError, AttributeError) as exc:
        if workaround.optional:
            return None
        raise RuntimeError(
            f"cpu_workarounds: cannot patch {workaround.module}.{workaround.attr} "
            f"(needed for: {workaround.replaces}); this megatron-core version is not "
            "supported by megapatch.testing") from exc
    return owner, leaf


class Replacements:
    """Attributes replaced by CPU stand-ins, and how to put each back: the one apply/restore
    mechanism of ``cpu_workarounds`` and ``megatron_lm_workarounds``."""

    def __init__(self) -> None:
        self._saved: List[Tuple[Any, str, Any, bool]] = []

    def replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """``owner.name = make(original)``, remembering the original (own or inherited)."""
        original = getattr(owner, name, None)
        self._saved.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, make(original))

    def restore(self) -> None:
        """Undoes every replacement, last first."""
        while self._saved:
            owner, name, original, had_own = self._saved.pop()
            if had_own:
                setattr(owner, name, original)
            elif name in vars(owner):
                delattr(owner, name)
