"""The rank server's contract (megapatch/testing/ranks/rank_server.py), from the side of a process
that forwards to it as torchrun's workers do: the child's exit status and death by a signal come
back as the forwarding process's own, signals it receives reach the child, the child dies with it,
and the child runs with the requester's environment, directory, argv and stdio, the MEGAPATCH_*
start-up hook included, but not the server's preloaded megatron (there is none)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, environ_without_megapatch
from megapatch.testing.ranks import rank_server

TESTS = os.path.join(REPO, "tests")


# --- targets, run in the server's children (imported there as test_rank_server) -------------------


def _exit_with(code):
    raise SystemExit(code)


def _raise():
    raise ValueError("boom in the child")


def _report(path):
    import megapatch

    with open(path, "w") as f:
        json.dump(dict(pid=os.getpid(), cwd=os.getcwd(), argv=sys.argv, var=os.environ.get("MPT_SERVER_PROBE"),
                       server_var=os.environ.get(rank_server.ENV), enabled=megapatch.is_enabled(),
                       megatron=[m for m in sys.modules if m.startswith("megatron")],
                       trigger=any(getattr(f, "megapatch_trigger", False) for f in sys.meta_path)), f)
    print("to the requester's stdout")
    sys.stdout.flush()


def _wait_forever(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    signal.pause()


# --- helpers ---------------------------------------------------------------------------------------


def _forwarding(target, *args, env=None, **popen):
    """A process that forwards ``target(*args)`` to the rank server, as a torchrun worker does."""
    code = _forwarding_code(target, *args)
    full_env = environ_without_megapatch()
    full_env.update({rank_server.ENV: rank_server.address()}, **(env or {}))
    return subprocess.Popen([sys.executable, "-c", code, "argument"], env=full_env, **popen)


def _pid_from(path, proc):
    for _ in range(2400):  # a failure deadline (2 minutes), generous for a loaded machine
        if os.path.exists(path) and open(path).read():
            return int(open(path).read())
        assert proc.poll() is None, proc.returncode
        time.sleep(0.05)
    raise AssertionError("the child never started")


def _gone(pid):
    for _ in range(1200):  # a failure deadline (1 minute)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


# --- tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("target, args, code", [("test_rank_server:_exit_with", (0,), 0),
                                                 ("test_rank_server:_exit_with", (3,), 3),
                                                 ("test_rank_server:_exit_with", (None,), 0),
                                                 ("test_rank_server:_raise", (), 1)])
def test_the_childs_exit_code_is_the_forwarding_process_s(target, args, code):
    proc = _forwarding(target, *args, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    if target.endswith("_raise"):  # the traceback on the requester's stderr, as an uncaught exception
        assert "ValueError: boom in the child" in err and "Traceback" in err, err


def test_the_child_runs_with_the_requesters_environment_directory_argv_and_stdout(tmp_path):
    report = tmp_path / "report.json"
    proc = _forwarding("test_rank_server:_report", str(report), cwd=str(tmp_path), stdout=subprocess.PIPE,
                       text=True, env={"MPT_SERVER_PROBE": "yes", "MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    seen = json.loads(report.read_text())
    assert out == "to the requester's stdout\n"
    assert seen["pid"] != proc.pid and seen["cwd"] == str(tmp_path) and seen["argv"] == ["-c", "argument"]
    assert seen["var"] == "yes" and seen["server_var"] is None  # its own subprocesses start as usual
    # MEGAPATCH_* set: the start-up hook armed its trigger, as megapatch-startup.pth does; no megatron yet
    assert seen["trigger"] is True and seen["megatron"] == [] and seen["enabled"] is False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_forwarding_process_reaches_the_child_and_its_death_comes_back(tmp_path, sig):
    """torchrun stops its workers with SIGTERM: the child gets it, and the worker dies of it too."""
    path = tmp_path / "pid"
    proc = _forwarding("test_rank_server:_wait_forever", str(path), stderr=subprocess.DEVNULL)
    child = _pid_from(path, proc)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    expected = -sig if sig == signal.SIGTERM else 1  # SIGINT: KeyboardInterrupt in the child, exit 1
    assert proc.returncode == expected
    assert _gone(child)


def test_a_killed_forwarding_process_takes_its_child_with_it(tmp_path):
    """SIGKILL cannot be forwarded: the child dies because the connection closed (no orphan)."""
    path = tmp_path / "pid"
    proc = _forwarding("test_rank_server:_wait_forever", str(path))
    child = _pid_from(path, proc)
    proc.kill()
    proc.wait(timeout=60)
    assert _gone(child)


def test_a_forwarding_process_whose_parent_dies_takes_its_child_with_it(tmp_path):
    """A worker of a torchrun that was killed (reparented) kills its child and exits."""
    path = tmp_path / "pid"
    code = (f"import subprocess, sys, os, time; "
            f"p = subprocess.Popen([sys.executable, '-c', {_forwarding_code('test_rank_server:_wait_forever', str(path))!r}]); "
            f"[time.sleep(0.05) for _ in range(1200) if not (os.path.exists({str(path)!r}) and open({str(path)!r}).read())]; "
            f"print(p.pid, flush=True); os._exit(0)")  # leaves once the worker's child runs
    env = dict(os.environ, **{rank_server.ENV: rank_server.address()})
    parent = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    worker = int(parent.stdout.split()[0])
    child = int(open(path).read())
    assert _gone(child) and _gone(worker)


def _forwarding_code(target, *args):
    return (f"import sys; sys.path.insert(0, {TESTS!r}); from megapatch.testing.ranks import rank_server; "
            f"rank_server.forward({target!r}, {args!r})")


def test_the_server_preloads_no_megatron_and_no_megapatch_engine():
    """The preload list holds third-party modules only: what megatron and megapatch import is
    imported in each child, after its environment is in place."""
    assert not [m for m in rank_server.PRELOAD if m.split(".")[0] in ("megatron", "megapatch", "transformer_engine")]
    assert "torch" in rank_server.PRELOAD


def test_an_unreachable_server_is_an_error_naming_it(tmp_path):
    with pytest.raises(rank_server.RankServerError, match="cannot be reached"):
        rank_server.request(str(tmp_path / "no-socket"), "test_rank_server:_raise")
