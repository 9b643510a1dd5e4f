"""How a megapatch refusal reads in a job of many ranks (issue 19 item 6).

Every rank meets the same refusal (the same configuration, the same check), so Python's default
report -- a traceback per rank -- turns one sentence into thousands of lines. While megapatch is
enabled, ``sys.excepthook`` reports an uncaught :class:`MegapatchError` as one line: the whole
message on rank 0, elsewhere a short line with its first words and the rank. The traceback goes to the
``megapatch`` logger at DEBUG level (``logging.basicConfig(level=logging.DEBUG)`` shows it). Every
other exception reaches the hook that was there before, untouched.

In a job of more than one rank, every rank waits ``GRACE_S`` seconds after its line before it
exits: a launcher such as torchrun stops the whole job when its first rank exits, which lost rank
0's full message whenever another rank got there first (seen in CI: only "the full message is on
rank 0" was printed), and the other ranks' lines whenever rank 0 did. A single process exits at once.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback

from megapatch.core.errors import MegapatchError
from megapatch.core.report import job_rank, job_size

log = logging.getLogger("megapatch")

SHORT_CHARS = 120
GRACE_S = 5.0


def lines(error: BaseException, rank: int) -> str:
    """What the hook prints for ``error`` on ``rank``: one line, ending in a newline."""
    kind = type(error).__name__
    message = " ".join(str(error).split())
    if rank == 0:
        return f"megapatch: {kind}: {message}\n"
    first = message.split(". ", 1)[0]
    if len(first) > SHORT_CHARS:
        first = first[:SHORT_CHARS - 3].rstrip() + "..."
    return f"megapatch: {kind}: {first} (rank {rank}; the full message is on rank 0)\n"


def _hook(kind, error, tb):
    if not isinstance(error, MegapatchError):
        return _previous(kind, error, tb)
    log.debug("megapatch: traceback of the refusal:\n%s", "".join(traceback.format_exception(kind, error, tb)))
    sys.stderr.write(lines(error, job_rank()))
    sys.stderr.flush()
    if job_size() > 1:
        time.sleep(GRACE_S)


_previous = sys.__excepthook__


def install() -> None:
    """Report megapatch's own errors by rank (idempotent; chains to the hook in place)."""
    global _previous
    if sys.excepthook is not _hook:
        _previous = sys.excepthook
        sys.excepthook = _hook


def uninstall() -> None:
    """Put the earlier hook back, unless someone installed another one after ours."""
    if sys.excepthook is _hook:
        sys.excepthook = _previous

