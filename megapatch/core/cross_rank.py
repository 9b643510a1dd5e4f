"""Cross-rank agreement on megapatch settings.

A rank that sums a TP reduction in FP32 while its peer sums in BF16 issues different collectives
and hangs or corrupts the job; a rank with FP32 logits beside a native one silently trains on a mix
of both. A collective cannot detect that safely: on a peer without megapatch it would pair with
that peer's real all-reduce. So each rank publishes its settings in the job's rendezvous store, and
a rank that asks for a change from upstream waits, with a timeout, for every tensor-parallel peer's
entry and compares them (every option marked ``compared`` in ``megapatch.core.options``).

When: at model-parallel initialisation (every rank where megapatch is loaded publishes, native
ranks included, and a rank with requests checks its TP group and the whole job: rank 0 against
every rank, the others against rank 0), on the first patched call of any patch after each
(re)configuration, and on the first patched collective on each group (the TP group there).

Two kinds of entries. At model-parallel initialisation, which every rank reaches the same number
of times, each rank writes an entry numbered by that count: a difference there is reported at
once, whichever rank is native. At the other check points each rank's latest entry (overwritten
when its settings change) is compared, so a rank that disables and re-enables the same settings
agrees with peers that never changed; a difference there is re-read for up to ``GRACE_S`` seconds
first (the peer may be about to reconfigure too). A missing entry is waited for up to the check
timeout (``MEGAPATCH_CHECK_TIMEOUT``, validated with the other options).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Dict, Optional

from megapatch.core.errors import CrossRankMismatchError
from megapatch.core.options import DISABLE_ENV, TIMEOUT_ENV, disabled

GRACE_S = 5.0
_POLL_S = 0.05
_KEY = "megapatch/settings/v3/latest/rank{}"
_INIT_KEY = "megapatch/settings/v3/init{}/rank{}"
_inits = 0  # model-parallel initialisations seen by this process
_lock = threading.RLock()
_checked: set = set()  # tuples of global ranks already verified
_checked_ids: set = set()  # id() of process groups already verified: the per-call fast path
#: True until the first patched call after a (re)configuration has verified the TP group.
pending = False


def _version() -> str:
    from megapatch.core.version import __version__

    return __version__


def _dist():
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _store(dist):
    return dist.distributed_c10d._get_default_store()


def _asks_for_change(settings) -> bool:
    from megapatch.core.options import NATIVE

    return settings.fingerprint() != NATIVE.fingerprint()


def _entry(settings) -> str:
    switched_off = f" [kill switch {DISABLE_ENV} set]" if disabled() else ""
    return f"megapatch {_version()}{switched_off}: {settings.fingerprint()}"


def reconfigured(settings) -> None:
    """Settings changed: forget verified groups, re-arm the first-call check, publish."""
    global pending
    with _lock:
        _checked.clear()
        _checked_ids.clear()
        pending = _asks_for_change(settings)
    publish(settings)


def publish(settings) -> None:
    """Record this rank's settings for its peers (no-op before torch.distributed is initialised)."""
    dist = _dist()
    if dist is None:
        return
    _store(dist).set(_KEY.format(dist.get_rank()), _entry(settings))


def model_parallel_initialized(settings) -> None:
    """Called once megatron has built its groups, on every rank where megapatch is loaded: publish
    the numbered entry, and verify the TP group when this rank asks for anything (a native rank
    only publishes: it works with peers without megapatch)."""
    global pending, _inits
    dist = _dist()
    if dist is None:
        return
    with _lock:
        _inits += 1
        number = _inits
        publish(settings)
        _store(dist).set(_INIT_KEY.format(number, dist.get_rank()), _entry(settings))
        if not _asks_for_change(settings):
            return
        group = _tp_group()
        if group is None:
            return
        ranks = tuple(dist.get_process_group_ranks(group))
        _compare(dist, ranks, lambda r: _INIT_KEY.format(number, r), settings, grace=0.0)
        _checked.add(ranks)
        _checked_ids.add(id(group))
        _compare(dist, _job_ranks(dist), lambda r: _INIT_KEY.format(number, r), settings, grace=0.0,
                 scope="job")
        pending = False


def check_first_call() -> None:
    """The first patched call after a (re)configuration that asks for a change (``pending``):
    verify the TP group once it exists. Until then each patched call costs two lookups."""
    global pending
    if _dist() is None:
        return
    group = _tp_group()
    if group is None:
        return
    from megapatch.core import state

    ensure_group_agrees(group, state.current())
    pending = False


def _job_ranks(dist) -> tuple:
    """Rank 0 compares every rank's entry with its own; every other rank compares with rank 0's:
    the whole job (data-parallel replicas and pipeline stages too) is checked at O(world) store
    reads in all, without a collective. Only at model-parallel initialisation, which every rank
    reaches the same number of times: later, ranks outside one TP group are not in step, and a
    replica that has already reconfigured would read as a difference."""
    me = dist.get_rank()
    return tuple(range(dist.get_world_size())) if me == 0 else (0, me)


def _tp_group():
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None:
        return None
    try:
        if not parallel_state.model_parallel_is_initialized():
            return None
        return parallel_state.get_tensor_model_parallel_group()
    except Exception:  # noqa: BLE001 -- groups torn down or half-built: nothing to check yet
        return None


def _differences(mine: str, theirs: str) -> str:
    """``logits_dtype=native (this rank: fp32)``: the options two entries disagree on."""
    def parse(text):
        version, _, fingerprint = text.partition(": ")
        pairs = dict(p.partition("=")[::2] for p in fingerprint.split(";") if p)
        pairs["megapatch version"] = version.replace("megapatch ", "")
        return pairs

    a, b = parse(mine), parse(theirs)
    return ", ".join(f"{k}={b.get(k)} (this rank: {a.get(k)})" for k in a if a.get(k) != b.get(k))


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
        _compare(dist, ranks, _KEY.format, settings, grace=GRACE_S)
        _checked.add(ranks)
        _checked_ids.add(id(group))


def _compare(dist, ranks, key_of, settings, grace: float, scope: str = "tp") -> None:
    """Wait for every rank's entry (up to the check timeout) and raise on a difference (after
    ``grace`` seconds of re-reading)."""
    store = _store(dist)
    timeout = float(settings.check_timeout)
    me = dist.get_rank()
    mine = _entry(settings)
    keys = {r: key_of(r) for r in ranks}
    where = (f"tensor-parallel group {list(ranks)}" if scope == "tp" else
             f"the job (world size {dist.get_world_size()}; rank 0 compares every rank, the others rank 0)")
    start = time.monotonic()
    while True:
        seen: Dict[int, Optional[str]] = {
            r: store.get(key).decode() if store.check([key]) else None for r, key in keys.items()}
        missing = [r for r, v in seen.items() if v is None]
        differ = {r: v for r, v in seen.items() if v is not None and v != mine}
        elapsed = time.monotonic() - start
        if not missing and not differ:
            return
        if differ and elapsed >= min(grace, timeout):
            published = "; ".join(f"rank {r}: {v}" for r, v in seen.items() if v is not None)
            diagnosis = "; ".join(
                f"rank {r} has megapatch switched off by the kill switch {DISABLE_ENV}" if DISABLE_ENV in v
                else f"rank {r} runs {_differences(mine, v)}" for r, v in differ.items())
            raise CrossRankMismatchError(
                f"megapatch settings differ across {where}: {diagnosis} "
                f"(this is rank {me}). Published: {published}. Every rank of a job must run "
                f"with the same MEGAPATCH_* settings.")
        if missing and elapsed >= timeout:
            raise CrossRankMismatchError(
                f"megapatch: rank(s) {missing} of {where} published no "
                f"megapatch settings within {timeout:g} s ({TIMEOUT_ENV}): megapatch is not "
                f"loaded there (no MEGAPATCH_* variable and no enable() on that rank), the kill "
                f"switch {DISABLE_ENV} is set there, or that rank is stuck before reaching "
                f"megatron. Every rank of a job must run with the same MEGAPATCH_* settings "
                f"(here: {settings.fingerprint()}).")
        time.sleep(_POLL_S)
