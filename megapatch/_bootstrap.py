"""Activation from ``MEGAPATCH_*`` variables in launchers that never import megapatch.

The wheel ships ``megapatch-startup.pth``; Python runs it at every interpreter start. It imports
this module only when a ``MEGAPATCH_*`` variable is set, and this module only registers
post-import hooks: megapatch is enabled when ``megatron.core`` or ``transformer_engine.pytorch``
is imported, so pip or any other tool in the same environment never pays for torch and is never
stopped by a bad value. A bad value stops the process that imports megatron, naming the variable.
"""

from __future__ import annotations

import wrapt

from . import engine, options
from .errors import OptionError

HOOKED_MODULES = ("megatron.core", "transformer_engine.pytorch")
_pending_error = None


def activate_from_environment() -> None:
    global _pending_error
    if options.env_disabled() or not options.env_requests():
        return
    try:
        options.resolve({})
    except OptionError as exc:
        _pending_error = exc
    for name in HOOKED_MODULES:
        wrapt.register_post_import_hook(_activate, name)


def _activate(_module) -> None:
    if _pending_error is not None:
        raise OptionError(f"megapatch (activated from the environment): {_pending_error}")
    if not engine.is_enabled():  # an explicit enable() in the script wins over the environment
        engine.enable()
