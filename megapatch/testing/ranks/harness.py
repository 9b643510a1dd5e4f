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

The parts, one module each: the rank's context and megatron's parallel state for it
(:mod:`~megapatch.testing.ranks.rank_context`), what each rank process does
(:mod:`~megapatch.testing.ranks.rank_process`), and the ranks' result files, the parent's wait for
them and the failures it raises (:mod:`~megapatch.testing.ranks.rank_results`). This module starts
the ranks and runs the job.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import threading
from typing import Any, Callable, Iterator, List, Mapping, MutableMapping, Optional, Sequence

from megapatch.testing.ranks import rank_process
from megapatch.testing.ranks.rank_process import _RankSpec
from megapatch.testing.ranks.rank_results import RankFailure, RankTimeout, _kill_all, _wait_for_ranks

__all__ = ["run_ranks"]

_ENV_LOCK = threading.Lock()


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
            proc = mp.Process(target=rank_process._rank_main, args=(spec, payload),
                              name=f"megapatch-rank{spec.rank}", daemon=True)
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
        yield rank_server.request(address, f"{rank_process.__name__}:_rank_main", (spec, payload), env=child_env)


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
