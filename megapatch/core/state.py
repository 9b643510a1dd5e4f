"""The current configuration, read by every wrapper when it is called, and where each value came
from (so that a refusal names the keyword or variable the user really set).

Kept in its own tiny module so that wrappers (in ``megapatch.patches``) depend on it and not on
the engine. Swapping the whole frozen ``Settings`` object is atomic, so a wrapper running on an
autograd thread always sees one consistent configuration.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

from megapatch.core import options
from megapatch.core.options import NATIVE, Settings

_current: Settings = NATIVE
_sources: Dict[str, str] = {}


def current() -> Settings:
    return _current


def sources() -> Dict[str, str]:
    """``{option: "enable()" | "env MEGAPATCH_..." | "default"}`` for the current settings."""
    return {o.name: _sources.get(o.name, "default") for o in options.OPTIONS}


def set_current(settings: Settings, sources: Optional[Mapping[str, str]] = None) -> None:
    global _current, _sources
    _current, _sources = settings, dict(sources or {})


def origin(name: str) -> str:
    """How the current value of option ``name`` was set, as an error message says it."""
    return options.origin(name, getattr(_current, name), _sources.get(name, "default"))
