"""The patches line: once the patches pending at activation are installed, rank 0 says which are
active (``report.patches_line``), once per activation; a patch installed after that line gets a line
of its own (``report.installed_later_line``). The activation line itself gives only counts.

When: at once where no patch is pending; else when the last pending one installs, or at the first call
into a patched function (in a job: as its model parallelism is set up or its model is built),
whichever comes first. Never on other ranks, and never where the activation line was muted (the
doctor's own imports, a worker process of an activated rank). The engine calls ``activated``,
``installed`` and ``reset``; this module knows no patch.
"""

from __future__ import annotations

import threading
from typing import Callable, List

from megapatch.core import report, wrappers

_lock = threading.RLock()
_due = False  # this activation's patches line is still to be said
_said = False  # ... and has been: a patch installed later gets a line of its own
_named: set = set()  # the patches named active on this activation's lines
_status: Callable = lambda: None


def reset() -> None:
    global _due, _said
    with _lock:
        _due = _said = False
        _named.clear()


def activated(current, status: Callable) -> None:
    """Log the activation line (``current``: the engine's status) and arrange the patches line."""
    global _due, _said, _status
    with _lock:
        _named.clear()
        _said, _status = False, status
        _due = report.job_line("info", report.activation_line(current))
        if _due and any(p.state == "pending-import" for p in current.patches):
            wrappers.on_first_call(say)
        elif _due:
            say()


def say() -> None:
    """The patches line, if it is still due (the status is read outside this module's lock: reading
    a backend may import a module, whose import hook takes the engine's lock)."""
    global _due, _said
    with _lock:
        if not _due:
            return
        _due = False
    current = _status()
    if current.enabled:
        _named.update(current.active)
        _said = report.job_line("info", report.patches_line(current))


def installed(names: List[str], module: str, status: Callable, pending: Callable[[], bool]) -> None:
    """Patches the import of ``module`` just installed (``pending``: whether any requested patch
    still waits for its modules)."""
    with _lock:
        due, late = _due, [name for name in names if name not in _named] if _said else []
        _named.update(late)
    if due and not pending():
        say()
    elif late:
        report.job_line("info", report.installed_later_line(status(), late, module))
