"""A process that has imported torch and the rest of the third-party stack once, and forks rank
processes from that state on request.

A rank started as a fresh interpreter spends seconds importing torch, its compiler stack
(``torch._dynamo``, ``torch._inductor``), sympy and triton before it does milliseconds of a test's
work; a 4-rank job on 2 cores pays that four times. The rank server pays it once per test session.

Contract:

* The server imports one profile of :data:`PROFILES` and never runs a torch operation, with every
  ``MEGAPATCH_*`` variable removed from its environment. ``base`` (:data:`PRELOAD`) is third-party
  modules only: what torchrun's workers run (a Megatron-LM checkout's ``pretrain_gpt.py`` imports
  the checkout's own ``megatron``) starts as a fresh interpreter would, megatron not imported.
  ``megatron`` adds the installed megatron-core's modules (:data:`MEGATRON_PRELOAD`), for
  ``run_ranks`` jobs. Neither imports ``transformer_engine`` or megapatch: a child has no parallel
  state and megapatch off, and imports megapatch itself (``tests/test_harness.py`` checks this after
  a job that left parallel state, megapatch enabled and a module attribute behind).
* A child takes its requester's stdin/stdout/stderr (passed as file descriptors), working directory,
  environment, ``sys.path`` and ``sys.argv``. Where the environment has a ``MEGAPATCH_*`` variable,
  megapatch's startup hook runs as the installed ``.pth`` file runs it at interpreter start.
  ``OMP_NUM_THREADS`` is applied with ``torch.set_num_threads`` and ``PYTHONWARNINGS`` as start-up
  applies it. What a child shares with the server and its siblings: the string hash seed.
* The child runs ``module:function(*args)`` and exits as a Python process would (``SystemExit``
  codes; an uncaught exception prints its traceback and gives 1); ``atexit`` handlers run, then
  ``os._exit``.
* A child dies (SIGKILL) as soon as its requester's connection closes: a requester that is killed
  leaves no orphan. The requester reads the child's pid first and its wait status last.
* The server exits when the process that started it closes its stdin (exits, or is killed).

:func:`forward` makes a thin process (what ``torchrun`` starts per rank) run its work in a child of
the server named by ``MPTEST_RANK_SERVER`` and exit with the child's status, forwarding signals;
:func:`request` is the same for a caller that manages the child itself (``run_ranks``).

The parts: the server process (:mod:`~megapatch.testing.ranks.rank_server_process`) and the
messages on its socket (:mod:`~megapatch.testing.ranks.rank_server_wire`); this module is the
requester's side and starts the servers.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any, Dict, List, Optional, Sequence

from megapatch.testing.ranks.rank_server_wire import _recv_qword, _send_request

#: the variable naming a rank server's socket; a requester's child never sees it (its own
#: subprocesses start as usual)
ENV = "MPTEST_RANK_SERVER"
#: imported once in the server: what megatron-core and Megatron-LM's training loop import from
#: torch and third-party packages (measured with ``python -X importtime``); missing ones are skipped
PRELOAD = (
    "torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx",
    "torch.distributed.tensor", "torch.distributed.tensor.experimental",
    "torch.distributed.checkpoint", "torch.utils.cpp_extension", "torch.utils.data",
    "numpy", "sympy", "networkx", "triton", "einops", "pydantic", "yaml", "regex", "psutil",
    "setuptools",
    # megatron.core.tokenizers imports transformers' AutoTokenizer at module level: 1.3 s of each
    # pretrain_gpt.py rank's 2.6 s of imports
    "transformers", "transformers.models.auto.tokenization_auto",
)
#: added for ``run_ranks`` jobs on the installed megatron-core (``address(preload="megatron")``): a
#: job that runs a Megatron-LM checkout's own ``megatron`` must not find another one imported
MEGATRON_PRELOAD = (
    "megatron.core", "megatron.core.parallel_state", "megatron.core.tensor_parallel",
    "megatron.core.transformer", "megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.pipeline_parallel",
)
PROFILES = {"base": PRELOAD, "megatron": PRELOAD + MEGATRON_PRELOAD}
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2)
_in_child = False  # True in a server's child while it runs its request


class RankServerError(RuntimeError):
    """The rank server could not be started or reached, or went away before its child finished."""


# --- requester side -------------------------------------------------------------------------------


class Child:
    """A server-forked process as the requester sees it (the parts of ``multiprocessing.Process``
    that :func:`megapatch.testing.ranks.harness.run_ranks` uses)."""

    def __init__(self, sock: socket.socket, pid: int):
        self._sock = sock
        self.pid = pid
        self._status: Optional[int] = None
        self._lost = False

    @property
    def sentinel(self) -> int:
        return self._sock.fileno()

    def _poll(self, timeout: Optional[float]) -> None:
        if self._status is not None or self._lost:
            return
        readable, _, _ = select.select([self._sock], [], [], timeout)
        if readable:
            status = _recv_qword(self._sock)
            if status is None:
                self._lost = True  # the server died: the child died with its connection
            else:
                self._status = status
            self._sock.close()

    @property
    def exitcode(self) -> Optional[int]:
        self._poll(0)
        if self._lost:
            return -signal.SIGKILL
        return None if self._status is None else os.waitstatus_to_exitcode(self._status)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def join(self, timeout: Optional[float] = None) -> None:
        self._poll(timeout)

    def close(self) -> None:
        if self._sock.fileno() != -1:
            self._sock.close()


def request(address: str, target: Optional[str], args: Sequence[Any] = (), *, env: Optional[Dict[str, str]] = None,
            fds: Sequence[int] = (0, 1, 2), cwd: Optional[str] = None, argv: Optional[List[str]] = None,
            path: Optional[List[str]] = None, pass_server_on: bool = False) -> Child:
    """Ask the server at ``address`` to fork a child that runs ``target`` (``module:function``) with
    ``args`` -- or, where ``target`` is None, this process's ``__main__`` module or script again, as
    ``__main__`` -- with this process's stdio (or ``fds``), cwd, environment (or ``env``), sys.path and argv.
    ``pass_server_on``: the child keeps ``$MPTEST_RANK_SERVER`` (a launcher whose workers forward too)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        _send_request(sock, {"target": target, "args": tuple(args),
                             "env": dict(os.environ if env is None else env),
                             "cwd": cwd or os.getcwd(), "path": list(sys.path if path is None else path),
                             "argv": list(sys.argv if argv is None else argv), "main": _main_module(),
                             "pass_server_on": pass_server_on},
                      fds)
        pid = _recv_qword(sock)
    except OSError as exc:
        sock.close()
        raise RankServerError(f"the rank server at {address} cannot be reached ({exc})") from exc
    if pid is None:
        sock.close()
        raise RankServerError(f"the rank server at {address} closed the connection before forking")
    return Child(sock, pid)


def _main_module() -> Dict[str, str]:
    """How a child finds the requester's ``__main__`` (multiprocessing's spawn preparation data)."""
    from multiprocessing import spawn

    data = spawn.get_preparation_data("rank")
    return {k: v for k, v in data.items() if k in ("init_main_from_name", "init_main_from_path")}


def forward(target: Optional[str] = None, args: Sequence[Any] = (), *, pass_server_on: bool = False) -> None:
    """Run this process's work in a child of the server named by ``$MPTEST_RANK_SERVER`` and exit
    with its status: its ``__main__`` again (``target`` None: a launcher's entry point, or a script
    that set things up and then called it, runs from the start in the child), or
    ``target(*args)``. Signals this process receives (torchrun's SIGTERM) go to the child, and the
    child is killed when this process's parent goes away (as a worker of a killed torchrun).
    Returns at once, doing nothing, where the variable is unset, inside a server's child, or where
    ``__main__`` is no module or script (``python -c``)."""
    address = os.environ.get(ENV)
    if not address or _in_child:
        return
    if target is None and not _main_module():
        return
    child = request(address, target, args, pass_server_on=pass_server_on)
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda signum, _frame: os.kill(child.pid, signum))
    threading.Thread(target=_kill_when_orphaned, args=(child, os.getppid()), name="rank-server-orphan",
                     daemon=True).start()
    child.join(None)
    code = child.exitcode
    if child._lost:
        print(f"rank server at {address} went away while running {target or _main_module()}", file=sys.stderr,
              flush=True)
    if code is not None and code < 0:  # died by a signal: die by the same one
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(1 if code is None else code)


def _kill_when_orphaned(child: Child, parent: int) -> None:
    while os.getppid() == parent:
        threading.Event().wait(0.5)
    child.kill()
    os._exit(1)


def _exec_code(code: str) -> None:
    """``python -c CODE`` in a server's child: the code runs in a fresh ``__main__`` namespace."""
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    finally:
        sys.modules["__main__"] = saved


def run_code(code: str, *, env: Dict[str, str], cwd: str, timeout: float,
             preload: str = "base") -> "subprocess.CompletedProcess[str]":
    """``subprocess.run([python, "-c", code], capture_output=True, text=True)`` where the process is
    a child of this process's rank server (``preload``): the same environment, directory and
    MEGAPATCH_* start-up hook, without paying the preload's imports. Not for what interpreter
    start-up itself does (``sys.modules`` at start, ``.pth`` files): those need a real interpreter."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as null:
        child = request(address(preload=preload), f"{__name__}:_exec_code", (code,), env=env, cwd=cwd,
                        fds=(null.fileno(), out.fileno(), err.fileno()), argv=["-c"])
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join(10)
            raise subprocess.TimeoutExpired(["<rank server>", "-c", code], timeout)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(["<rank server>", "-c", code], child.exitcode,
                                           out.read().decode(errors="replace"), err.read().decode(errors="replace"))


# --- starting a server ----------------------------------------------------------------------------

_servers: Dict[tuple, "_Server"] = {}
_lock = threading.Lock()


class _Server:
    def __init__(self, python: str, profile: str):
        self.dir = tempfile.mkdtemp(prefix="megapatch-rank-server-")
        self.address = os.path.join(self.dir, "socket")
        env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAPATCH_") and k != ENV}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        code = ("import sys, pickle; from megapatch.testing.ranks.rank_server_process import serve; "
                "serve(sys.argv[1], pickle.loads(bytes.fromhex(sys.argv[2])), sys.argv[3])")
        # the preload's own output (upstream import warnings) goes to a file, not the user's terminal:
        # each child's output goes to its requester's streams
        self.log = os.path.join(self.dir, "server.log")
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [python, "-c", code, self.address, pickle.dumps(list(sys.path)).hex(), profile],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, cwd=self.dir)
        ready = self.process.stdout.readline()
        self.process.stdout.close()
        if ready.strip() != b"ready":
            self.process.kill()
            with open(self.log, errors="replace") as log:
                tail = log.read()[-3000:]
            raise RankServerError(f"the rank server did not start ({python}, preload {profile!r}; exit "
                                  f"{self.process.wait()}):\n{tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def address(python: Optional[str] = None, preload: str = "base") -> str:
    """The socket of this process's rank server for ``python`` (default: this interpreter) and
    ``preload`` (a key of :data:`PROFILES`), started on first use (seconds: the preload) and
    stopped when this process exits."""
    if preload not in PROFILES:
        raise ValueError(f"preload={preload!r}; valid: {', '.join(PROFILES)}")
    key = (python or sys.executable, preload)
    with _lock:
        server = _servers.get(key)
        if server is None or server.process.poll() is not None:
            server = _servers[key] = _Server(*key)
        return server.address


@atexit.register
def _stop_all() -> None:
    for server in list(_servers.values()):
        server.stop()
    _servers.clear()
