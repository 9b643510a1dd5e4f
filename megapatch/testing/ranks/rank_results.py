"""What a rank of :func:`~megapatch.testing.ranks.harness.run_ranks` reports and how the parent
waits for it: each rank's result file (``ok`` with its pickled value, or ``error`` with its
traceback), written atomically by the rank and read by the parent, which polls until every rank
succeeded, kills every rank at the first failure or at the deadline, and raises
:class:`RankFailure` / :class:`RankTimeout`."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import time
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["RankFailure", "RankTimeout"]

_POLL_S = 0.05
_KILL_GRACE_S = 5.0


class RankFailure(RuntimeError):
    """A rank raised or died; also the base of :class:`RankTimeout`.

    ``rank`` is the first rank that failed; ``tracebacks`` maps every rank that
    reported an exception to its formatted traceback text.
    """

    def __init__(self, message: str, rank: Optional[int] = None,
                 tracebacks: Optional[Dict[int, str]] = None):
        super().__init__(message)
        self.rank = rank
        self.tracebacks = dict(tracebacks or {})


class RankTimeout(RankFailure):
    """Ranks still running at the deadline; ``ranks`` lists them."""

    def __init__(self, message: str, ranks: Sequence[int]):
        super().__init__(message, rank=min(ranks) if ranks else None)
        self.ranks = list(ranks)


def _report_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"rank{rank}.result")


def _write_report(tmpdir: str, rank: int, status: str, payload: Any) -> None:
    """Atomically writes ``(status, payload, time)`` for the parent to read."""
    path = _report_path(tmpdir, rank)
    with open(path + ".tmp", "wb") as f:
        pickle.dump((status, payload, time.time()), f)
    os.replace(path + ".tmp", path)


def _read_report(tmpdir: str, rank: int) -> Optional[tuple]:
    try:
        with open(_report_path(tmpdir, rank), "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


def _kill_all(procs: List[multiprocessing.process.BaseProcess]) -> None:
    """SIGKILLs every live child and reaps all of them."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(_KILL_GRACE_S)


def _collect_reports(procs, tmpdir: str, reports: Dict[int, tuple]) -> None:
    """Adds every final report: an error, a success of an exited rank, or a death.

    The exit code is read *before* the report file, so a rank that wrote its
    report and then exited is never mistaken for one that died silently.
    """
    for r, p in enumerate(procs):
        if r in reports:
            continue
        exitcode = p.exitcode
        rep = _read_report(tmpdir, r)
        if rep is None and exitcode is not None:
            rep = ("died", f"exited with code {exitcode} without reporting", time.time())
        elif rep is not None and rep[0] == "ok" and exitcode not in (None, 0):
            rep = ("died", f"exited with code {exitcode} after reporting success", time.time())
        if rep is not None and (rep[0] != "ok" or exitcode is not None):
            reports[r] = rep


def _failure_from_reports(reports: Dict[int, tuple]) -> Optional[RankFailure]:
    """The RankFailure naming the earliest failing rank, or None if none failed."""
    failed = sorted((r for r, rep in reports.items() if rep[0] != "ok"),
                    key=lambda r: reports[r][2])
    if not failed:
        return None
    tracebacks = {r: reports[r][1] for r in failed if reports[r][0] == "error"}
    parts = [f"rank {r} raised:\n{reports[r][1]}" if reports[r][0] == "error"
             else f"rank {r} {reports[r][1]}" for r in failed]
    return RankFailure(f"rank {failed[0]} failed\n" + "\n".join(parts), rank=failed[0],
                       tracebacks=tracebacks)


def _wait_for_ranks(procs, tmpdir: str, timeout: float) -> List[Any]:
    """Polls reports until every rank succeeded; raises on failure or timeout."""
    deadline = time.monotonic() + timeout
    reports: Dict[int, tuple] = {}
    while True:
        _collect_reports(procs, tmpdir, reports)
        failure = _failure_from_reports(reports)
        if failure is not None:
            _kill_all(procs)
            raise failure
        if len(reports) == len(procs):
            return [pickle.loads(reports[r][1]) for r in range(len(procs))]
        if time.monotonic() > deadline:
            pending = [r for r in range(len(procs)) if r not in reports]
            _kill_all(procs)
            raise RankTimeout(f"ranks {pending} did not finish within {timeout:g} s "
                              "(all ranks were killed)", pending)
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None],
                                        timeout=_POLL_S)
