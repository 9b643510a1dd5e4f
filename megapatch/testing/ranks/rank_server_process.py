"""The rank server process itself (started by :func:`megapatch.testing.ranks.rank_server.address`):
preload one profile of :data:`~megapatch.testing.ranks.rank_server.PROFILES`, listen, and fork a
child per request, which takes its requester's streams, directory, environment, ``sys.path`` and
``argv``, runs ``module:function(*args)`` (or the requester's ``__main__``) and exits as a Python
process would. The contract is in :mod:`megapatch.testing.ranks.rank_server`."""

from __future__ import annotations

import atexit
import importlib
import os
import select
import signal
import socket
import sys
import threading
import traceback
from typing import Any, Dict, List, Sequence

from megapatch.testing.ranks import rank_server
from megapatch.testing.ranks.rank_server import ENV, FORWARDED_SIGNALS, PROFILES, RankServerError
from megapatch.testing.ranks.rank_server_wire import _QWORD, _recv_request

_POLL_S = 0.05


def serve(address: str, sys_path: List[str], profile: str = "base") -> None:
    """Preload ``PROFILES[profile]``, listen on ``address``, fork a child per request until stdin closes."""
    sys.path[:] = sys_path
    for name in PROFILES[profile]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- an optional package that is absent or broken: the child imports it itself
            pass
    allowed = ("megatron",) if profile == "megatron" else ()
    leaked = [m for m in ("megatron", "transformer_engine", "megapatch.core.engine")
              if m in sys.modules and m not in allowed]
    if leaked:
        raise RankServerError(f"the rank server's preload imported {leaked}: children would not start fresh")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use CUDA
        raise RankServerError("the rank server's preload initialised CUDA: its children could not use it")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    print("ready", flush=True)
    children: Dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], _POLL_S)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            listener.close()
            os._exit(0)  # whoever started the server is gone; running children keep their connections
        if listener in readable:
            conn, _ = listener.accept()
            request, fds = _recv_request(conn)
            if request is None:
                conn.close()
            else:
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for other in children.values():
                        other.close()
                    _child(conn, request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                conn.sendall(_QWORD.pack(pid))
        _reap(children)


def _reap(children: Dict[int, socket.socket]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(_QWORD.pack(status))
            except OSError:  # the requester is gone
                pass
            conn.close()


def _die_with_requester(conn: socket.socket) -> None:
    """Block until the requester's end closes (it sends nothing after the request), then die."""
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _child(conn: socket.socket, request: Dict[str, Any], fds: Sequence[int]) -> None:
    for sig in (signal.SIGCHLD, *FORWARDED_SIGNALS):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt, as in a new interpreter
    for target_fd, fd in enumerate(fds):
        os.dup2(fd, target_fd)
        os.close(fd)
    threading.Thread(target=_die_with_requester, args=(conn,), name="rank-server-requester",
                     daemon=True).start()
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if not request.get("pass_server_on"):
            os.environ.pop(ENV, None)
        sys.path[:] = request["path"]
        sys.argv[:] = request["argv"]
        warning_options = os.environ.get("PYTHONWARNINGS")
        if warning_options:  # read at interpreter start: applied as start-up applies them
            import warnings

            warnings._processoptions([o for o in warning_options.split(",") if o])
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and threads.isdigit():
            import torch

            torch.set_num_threads(int(threads))
        if any(name.startswith("MEGAPATCH_") for name in os.environ):  # as megapatch-startup.pth does
            from megapatch.core import startup

            startup.activate_from_environment()
        if request["target"] is not None and request["main"]:  # the requester's __main__ as
            from multiprocessing import spawn  # __mp_main__, as spawn does (pickled functions)

            spawn.prepare(request["main"])
        rank_server._in_child = True  # a forward() in what runs here runs here (rank_server.forward reads it)
        if request["target"] is None:  # the requester's own __main__ again, as __main__
            import runpy

            main = request["main"]
            if "init_main_from_name" in main:
                runpy.run_module(main["init_main_from_name"], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(main["init_main_from_path"], run_name="__main__")
        else:
            module, _, function = request["target"].partition(":")
            getattr(importlib.import_module(module), function)(*request["args"])
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 -- as an uncaught exception at interpreter level
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1
