"""Cross-rank agreement on megapatch settings.

A rank that sums a TP reduction in FP32 while its peer sums in BF16 issues different collectives
and hangs or corrupts the job. A collective cannot detect that safely: on a peer without megapatch
it would pair with that peer's real all-reduce. So each rank publishes its settings in the
job's rendezvous store (at ``enable()`` and at model-parallel initialisation), and the first
patched collective on a group waits, with a timeout, for every peer's entry and compares them.

Entries are numbered by configuration generation (each ``enable()``/``disable()`` that changes
the configuration starts a new one), so a rank that reconfigures mid-job is compared with its
peers' matching reconfiguration, never with their stale entries.
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta

from .errors import CrossRankMismatchError

TIMEOUT_ENV = "MEGAPATCH_CHECK_TIMEOUT"
_KEY = "megapatch/settings/v2/gen{}/rank{}"
_lock = threading.Lock()
_checked: set = set()  # tuples of global ranks already verified
_checked_ids: set = set()  # id() of process groups already verified: the per-call fast path
_generation = 0


def _version() -> str:
    from . import __version__
    return __version__


def _dist():
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _store(dist):
    return dist.distributed_c10d._get_default_store()


def reconfigured(settings) -> None:
    """Start a new configuration generation: forget verified groups, publish the new settings."""
    global _generation
    with _lock:
        _generation += 1
        _checked.clear()
        _checked_ids.clear()
    publish(settings)


def publish(settings) -> None:
    """Record this rank's settings for its peers (no-op before torch.distributed is initialised)."""
    dist = _dist()
    if dist is None:
        return
    value = f"megapatch {_version()}: {settings.fingerprint()}"
    _store(dist).set(_KEY.format(_generation, dist.get_rank()), value)


def ensure_group_agrees(group, settings) -> None:
    """Raise CrossRankMismatchError unless every rank of ``group`` runs ``settings``. Once per group."""
    if id(group) in _checked_ids:
        return
    dist = _dist()
    if dist is None:
        return
    ranks = tuple(dist.get_process_group_ranks(group))
    with _lock:
        if ranks in _checked:
            _checked_ids.add(id(group))
            return
        publish(settings)
        store = _store(dist)
        timeout = float(os.environ.get(TIMEOUT_ENV, "300"))
        keys = [_KEY.format(_generation, r) for r in ranks]
        try:
            store.wait(keys, timedelta(seconds=timeout))
        except Exception:  # the store raises its own timeout type, which varies by store
            missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
            raise CrossRankMismatchError(
                f"megapatch: rank(s) {missing} of tensor-parallel group {list(ranks)} published no "
                f"megapatch settings for configuration #{_generation} within {timeout:.0f} s ({TIMEOUT_ENV}): megapatch is not enabled "
                f"there, or was enabled/reconfigured a different number of times. Every rank of a TP group must run with the same MEGAPATCH_* settings "
                f"(here: {settings.fingerprint()}).") from None
        seen = {r: store.get(k).decode() for r, k in zip(ranks, keys)}
        if len(set(seen.values())) > 1:
            lines = "; ".join(f"rank {r}: {v}" for r, v in seen.items())
            raise CrossRankMismatchError(
                f"megapatch settings differ across tensor-parallel group {list(ranks)}: {lines}. "
                f"Every rank of a TP group must run with the same MEGAPATCH_* settings.")
        _checked.add(ranks)
        _checked_ids.add(id(group))
