"""The current configuration, read by every wrapper when it is called.

Kept in its own tiny module so that wrappers (in ``megapatch.patches``) depend on it and not on
the engine. Swapping the whole frozen ``Settings`` object is atomic, so a wrapper running on an
autograd thread always sees one consistent configuration.
"""

from __future__ import annotations

from megapatch.core.options import NATIVE, Settings

_current: Settings = NATIVE


def current() -> Settings:
    return _current


def set_current(settings: Settings) -> None:
    global _current
    _current = settings
