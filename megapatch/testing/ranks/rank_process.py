"""What one rank process of :func:`~megapatch.testing.ranks.harness.run_ranks` does, forked by the
rank server or spawned: die with its parent, join the gloo (or NCCL) group, set up megatron's
parallel state and the CPU workarounds, call the job's function, report ``ok``/``error``, tear
down, and exit without interpreter finalisation. :func:`_rank_main` is its entry point (the
target the harness starts, by reference)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Dict, Optional

from megapatch.testing.ranks.rank_context import RankContext, _init_model_parallel, _megatron_context
from megapatch.testing.ranks.rank_results import _write_report


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
