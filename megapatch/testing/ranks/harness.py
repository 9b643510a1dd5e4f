"""Spawn one CPU process per rank and run a function under real megatron-core.

Contract of :func:`run_ranks`:

* ``world_size`` processes are forked by this session's rank server
  (:mod:`megapatch.testing.ranks.rank_server`: torch, the third-party stack and
  the installed megatron-core imported once, megapatch not; without megatron
  where ``env`` sets ``PYTHONPATH``), or started with the
  multiprocessing *spawn* context (``start="spawn"``, or where the server
  cannot run).  Either way each child is a new process with no parallel
  state and megapatch off, and the ``env`` variables are in its environment
  before megatron or megapatch is imported (the ``MEGAPATCH_*`` start-up
  hook sees them as at interpreter start).  Each child limits torch to one
  thread, joins a gloo process group through a ``FileStore`` in a fresh
  temporary directory, initialises megatron's ``parallel_state`` and enters
  :func:`~megapatch.testing.stand_ins.cpu_compat.cpu_workarounds`.
* ``fn(ctx, *args, **kwargs)`` must be a module-level function (it is pickled
  by reference; the child imports its module) and must return a picklable
  value.  The parent returns the values in rank order.
* If a rank raises (or dies), the parent kills every other rank at once and
  raises :class:`RankFailure` carrying the rank and the child's traceback.  If
  ranks are still running after ``timeout`` seconds, all are killed and
  :class:`RankTimeout` names the ranks that did not finish.  All children are
  reaped before ``run_ranks`` returns or raises, and they die with the parent
  (their connection to it closing; spawned: ``PR_SET_PDEATHSIG`` on Linux, a
  watchdog thread elsewhere).
* Each rank tears down ``parallel_state`` and the process group, also on
  error, then exits without interpreter finalisation (``atexit`` handlers
  registered by ``fn`` do not run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Mapping, MutableMapping, Optional, Sequence

__all__ = ["run_ranks", "reinit_model_parallel", "RankContext", "RankFailure", "RankTimeout"]

_POLL_S = 0.05
_KILL_GRACE_S = 5.0
_ENV_LOCK = threading.Lock()


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


@dataclasses.dataclass
class RankContext:
    """Where a rank function runs: global rank and megatron's parallel layout.

    The groups are this process's live ``torch.distributed`` groups (``None``
    when megatron's parallel state was not initialised).  ``tmpdir`` is the
    job's scratch directory, shared by all ranks and removed afterwards.
    """

    rank: int
    world_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    vpp_size: Optional[int] = None
    dp_rank: int = 0
    dp_size: int = 1
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    tmpdir: str = ""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclasses.dataclass(frozen=True)
class _RankSpec:
    """Everything a child needs, except the user payload (pickled separately)."""

    rank: int
    world_size: int
    tp: int
    pp: int
    vpp: Optional[int]
    tmpdir: str
    timeout_s: float
    parent_pid: int
    init_megatron: bool
    workarounds: bool
    parallel_kwargs: Dict[str, Any]
    stderr_dir: Optional[str] = None
    backend: str = "gloo"
    forked_by_server: bool = False


# --- megatron parallel state ----------------------------------------------------


def _init_model_parallel(tp: int, pp: int, vpp: Optional[int], extra: Mapping[str, Any]) -> None:
    """Calls ``initialize_model_parallel`` with the arguments this version takes."""
    from megatron.core import parallel_state

    params = inspect.signature(parallel_state.initialize_model_parallel).parameters
    if vpp is not None and "virtual_pipeline_model_parallel_size" not in params:
        raise TypeError("this megatron-core's initialize_model_parallel takes no "
                        "virtual_pipeline_model_parallel_size")
    wanted = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp,
    }
    kwargs = {k: v for k, v in wanted.items() if k in params}
    kwargs.update(extra)
    parallel_state.initialize_model_parallel(**kwargs)


def _megatron_context(ctx: RankContext) -> RankContext:
    """``ctx`` with the ranks, sizes and groups of megatron's current parallel state."""
    from megatron.core import parallel_state as ps

    return dataclasses.replace(
        ctx,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
    )


def reinit_model_parallel(ctx: RankContext, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
                          **parallel_kwargs: Any) -> RankContext:
    """Re-initialises megatron's parallel state inside a running rank function.

    Every rank must call it with the same arguments (it creates process
    groups).  Destroys the current ``parallel_state`` (models built under it
    keep stale groups: build new ones) and returns the context of the new
    layout.  Lets one job compare several TP/PP layouts without paying the
    start-up (import) cost of a job per layout.
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _init_model_parallel(tp, pp, vpp, parallel_kwargs)
    return _megatron_context(ctx)


# --- child side -----------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """Ensures this child cannot outlive the process that spawned it."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(pr_set_pdeathsig, signal.SIGKILL) == 0 and os.getppid() == parent_pid:
            return
    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(1)

    def watchdog() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watchdog, name="megapatch-parent-watchdog", daemon=True).start()


def _report_path(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"rank{rank}.result")


def _write_report(tmpdir: str, rank: int, status: str, payload: Any) -> None:
    """Atomically writes ``(status, payload, time)`` for the parent to read."""
    path = _report_path(tmpdir, rank)
    with open(path + ".tmp", "wb") as f:
        pickle.dump((status, payload, time.time()), f)
    os.replace(path + ".tmp", path)


def _run_user_fn(spec: _RankSpec, payload: bytes) -> Any:
    """Joins the job (gloo; nccl with one GPU per rank), sets up megatron, calls the user function."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.rank)
    fn, args, kwargs = pickle.loads(payload)
    store = dist.FileStore(os.path.join(spec.tmpdir, "store"), spec.world_size)
    dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.timeout_s))
    ctx = RankContext(rank=spec.rank, world_size=spec.world_size, tmpdir=spec.tmpdir)
    if not spec.init_megatron:
        return fn(ctx, *args, **kwargs)
    _init_model_parallel(spec.tp, spec.pp, spec.vpp, spec.parallel_kwargs)
    ctx = _megatron_context(ctx)
    guard = contextlib.nullcontext()
    if spec.workarounds:
        from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds

        guard = cpu_workarounds()
    with guard:
        return fn(ctx, *args, **kwargs)


def _teardown(spec: _RankSpec) -> None:
    """Destroys megatron's parallel state and the process group, if they exist."""
    import torch.distributed as dist

    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if spec.init_megatron and parallel_state is not None:
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _exit_now(code: int) -> None:
    """Exits without interpreter finalisation (it takes seconds with torch+megatron)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _redirect_stderr(path: str) -> None:
    """Points this process's fd 2 (Python warnings, C++ messages) at ``path``."""
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _rank_main(spec: _RankSpec, payload: bytes) -> None:
    """Child entry point: run, report ``ok``/``error``, tear down, exit.

    An error is reported *before* teardown, so the parent learns of the real
    failure before peers fail on the torn-down group.
    """
    if not spec.forked_by_server:  # a server's child dies with its connection to the parent
        _die_with_parent(spec.parent_pid)
    if spec.stderr_dir:
        _redirect_stderr(os.path.join(spec.stderr_dir, f"rank{spec.rank}.stderr"))
    try:
        pickled = pickle.dumps(_run_user_fn(spec, payload))
    except BaseException:
        _write_report(spec.tmpdir, spec.rank, "error", traceback.format_exc())
        try:
            _teardown(spec)
        finally:
            _exit_now(1)
    try:
        _teardown(spec)
    except BaseException:
        _write_report(spec.tmpdir, spec.rank, "error", "teardown failed:\n" + traceback.format_exc())
        _exit_now(1)
    _write_report(spec.tmpdir, spec.rank, "ok", pickled)
    _exit_now(0)


# --- parent side ----------------------------------------------------------------


@contextlib.contextmanager
def _child_environment(env: Mapping[str, Optional[str]]) -> Iterator[None]:
    """Applies ``env`` to ``os.environ`` while children are spawned, then restores it.

    Spawned children copy the parent's environment at creation; this is the
    only way to have the variables set before the child interpreter starts.
    ``None`` removes a variable.  Other threads of the parent see the change
    while the ranks start.
    """
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        try:
            _apply_env(os.environ, env)
            yield
        finally:
            _apply_env(os.environ, saved)


def _apply_env(target: MutableMapping[str, str], env: Mapping[str, Optional[str]]) -> None:
    """Sets each variable of ``env`` in ``target`` (``None`` removes it)."""
    for key, value in env.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = str(value)


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


START_ENV = "MPTEST_RANKS_START"
START_METHODS = ("server", "spawn")


def start_method(start: Optional[str] = None, backend: str = "gloo") -> str:
    """``start``, else ``$MPTEST_RANKS_START``, else the default: the rank server on Linux for gloo
    jobs, spawn for NCCL (a child forked from a process whose imports touched CUDA cannot use it)
    and elsewhere. Refuses a value that is none of :data:`START_METHODS`."""
    start = start or os.environ.get(START_ENV) or (
        "server" if sys.platform.startswith("linux") and backend == "gloo" else "spawn")
    if start not in START_METHODS:
        raise ValueError(f"start={start!r} (or ${START_ENV}); valid: {', '.join(START_METHODS)}")
    return start


def _spawn(specs: Sequence[_RankSpec], payload: bytes, env: Mapping[str, Optional[str]]) -> Iterator[Any]:
    mp = multiprocessing.get_context("spawn")
    with _child_environment(env):
        for spec in specs:
            proc = mp.Process(target=_rank_main, args=(spec, payload), name=f"megapatch-rank{spec.rank}",
                              daemon=True)
            proc.start()
            yield proc


def _fork_from_server(specs: Sequence[_RankSpec], payload: bytes, env: Mapping[str, Optional[str]],
                      preload: Optional[str]) -> Iterator[Any]:
    from megapatch.testing.ranks import rank_server

    child_env = dict(os.environ)
    _apply_env(child_env, env)
    # the installed megatron-core preloaded too, unless the job points PYTHONPATH at another one or
    # Transformer Engine is installed (megatron-core imports it then, and a rank must import TE itself,
    # after megapatch, as a job's rank does)
    fresh = "PYTHONPATH" in env or importlib.util.find_spec("transformer_engine") is not None
    address = rank_server.address(preload=preload or ("base" if fresh else "megatron"))
    for spec in specs:
        yield rank_server.request(address, f"{__name__}:_rank_main", (spec, payload), env=child_env)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    timeout: float = 180.0,
    env: Optional[Mapping[str, Optional[str]]] = None,
    init_megatron: bool = True,
    workarounds: bool = True,
    parallel_kwargs: Optional[Mapping[str, Any]] = None,
    stderr_dir: Optional[str] = None,
    backend: str = "gloo",
    start: Optional[str] = None,
    preload: Optional[str] = None,
) -> List[Any]:
    """Runs ``fn(ctx, *args, **kwargs)`` on ``world_size`` spawned CPU ranks.

    ``fn`` must be defined at module level (pickled by reference) and return a
    picklable value; ``ctx`` is a :class:`RankContext`.  A script that calls
    this needs the usual ``if __name__ == "__main__":`` guard (spawn imports
    the main module in every child).  ``tp``/``pp``/``vpp``
    go to megatron's ``initialize_model_parallel`` (``parallel_kwargs`` adds
    more of its keyword arguments).  ``env`` is set in every child from its
    start (``None`` unsets).  ``init_megatron=False`` gives a bare gloo job (no
    megatron import, no workarounds); ``workarounds=False`` skips
    :func:`cpu_workarounds`.  ``timeout`` (seconds) bounds the whole job,
    start-up included.  ``stderr_dir`` (an existing directory) receives each
    rank's stderr as ``rank{N}.stderr`` instead of the parent's (failures are
    still raised with their tracebacks).  ``backend="nccl"`` runs one rank per GPU (the GPU tests;
    ``workarounds`` then stays off: CUDA is real).  ``start``: ``"server"`` (forked by the rank
    server; the default on Linux for gloo) or ``"spawn"`` (fresh interpreters; the default for
    NCCL and off Linux, and wherever ``$MPTEST_RANKS_START=spawn``).  ``preload``: the server's profile, ``"megatron"``
    (the installed megatron-core already imported; the default) or ``"base"`` (imported by the rank,
    after ``fn`` could act first; the default where ``env`` sets ``PYTHONPATH``).  Returns the per-rank values in rank order; raises
    :class:`RankFailure` / :class:`RankTimeout` as the module doc says.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}; valid: gloo, nccl")
    if init_megatron and world_size % (tp * pp) != 0:
        raise ValueError(f"world_size {world_size} is not divisible by tp*pp = {tp * pp}")
    start = start_method(start, backend)
    payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
    job = dict(world_size=world_size, tp=tp, pp=pp, vpp=vpp, timeout=timeout, env=env,
               init_megatron=init_megatron, workarounds=workarounds, parallel_kwargs=parallel_kwargs,
               stderr_dir=stderr_dir, backend=backend, start=start, preload=preload)
    try:
        return _run_job(payload, **job)
    except RankFailure as failure:
        if not group_never_formed(failure):
            raise
        # Gloo's TCP pairs find each other by address only: with other gloo jobs on the machine
        # (pytest-xdist workers), a process still dialling a dead peer's port can reach a listener
        # of this job that got the same port, and the handshake breaks. fn never ran: run it again.
        print(f"megapatch.testing: the ranks' gloo group did not form (rank {failure.rank}: Gloo "
              f"connectFullMesh failed); running the job once more", file=sys.stderr, flush=True)
        return _run_job(payload, **job)


def group_never_formed(failure: "RankFailure") -> bool:
    """Whether every rank that reported failed inside ``init_process_group`` with a gloo
    connection error, before the job's function was called (nothing of the test ran)."""
    if isinstance(failure, RankTimeout) or not failure.tracebacks:
        return False
    return all("connectFullMesh" in text and "init_process_group(" in text and "return fn(ctx" not in text
               for text in failure.tracebacks.values())


def _run_job(payload: bytes, *, world_size, tp, pp, vpp, timeout, env, init_megatron, workarounds,
             parallel_kwargs, stderr_dir, backend, start, preload) -> List[Any]:
    tmpdir = tempfile.mkdtemp(prefix="megapatch-ranks-")
    procs: List[Any] = []
    try:
        specs = [_RankSpec(rank, world_size, tp, pp, vpp, tmpdir, float(timeout), os.getpid(),
                           init_megatron, workarounds and init_megatron and backend == "gloo",
                           dict(parallel_kwargs or {}), stderr_dir, backend, start == "server")
                 for rank in range(world_size)]
        if start == "server":
            procs.extend(_fork_from_server(specs, payload, env or {}, preload))
        else:
            procs.extend(_spawn(specs, payload, env or {}))
        return _wait_for_ranks(procs, tmpdir, timeout)
    finally:
        _kill_all(procs)
        for p in procs:
            if p.exitcode is not None:
                p.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
