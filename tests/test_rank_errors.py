"""A megapatch refusal reads as one line per rank (issue 19 item 6): the whole message on rank 0, a
short line elsewhere, no traceback; every other exception keeps Python's report."""

import sys

import pytest

import megapatch
from megapatch.core import rank_errors
from megapatch.core.errors import UnsupportedConfigurationError

from conftest import environ_without_megapatch, run_python

MESSAGE = ("megapatch tp_invariant=True does not support num_moe_experts=8 (Megatron-LM: --num-experts): "
           "expert layers are not covered by this mode yet. tp_invariant was "
           "set by MEGAPATCH_TP_INVARIANT=1 in the environment; unset MEGAPATCH_TP_INVARIANT to change it.")


def test_rank_0_prints_the_whole_message_on_one_line_and_the_others_a_short_one():
    error = UnsupportedConfigurationError(MESSAGE.replace(". ", ".\n   ", 1))  # folded message
    first = rank_errors.lines(error, 0)
    assert first == f"megapatch: UnsupportedConfigurationError: {MESSAGE}\n"
    other = rank_errors.lines(error, 7)
    assert other.count("\n") == 1 and other.endswith("(rank 7; the full message is on rank 0)\n")
    assert other.startswith("megapatch: UnsupportedConfigurationError: megapatch tp_invariant=True does "
                            "not support num_moe_experts=8 (Megatron-LM: --num-experts)")
    assert len(other) < len(first) and "unset MEGAPATCH_TP_INVARIANT" not in other


def test_enable_installs_the_hook_and_disable_restores_the_one_before(monkeypatch):
    def theirs(*exc_info):
        pass

    monkeypatch.setattr(sys, "excepthook", theirs)
    megapatch.enable(logits_dtype="fp32")
    assert sys.excepthook is rank_errors._hook
    megapatch.enable(logits_dtype="fp32")  # idempotent: the user's hook stays the one chained to
    assert rank_errors._previous is theirs
    megapatch.disable()
    assert sys.excepthook is theirs


_RAISE = """
    import os, megapatch
    from megapatch.core.errors import UnsupportedConfigurationError
    megapatch.enable(logits_dtype="fp32")
    if os.environ["KIND"] == "megapatch":
        raise UnsupportedConfigurationError("megapatch refuses X. Unset MEGAPATCH_Y to change it.")
    raise ValueError("not megapatch's")
    """


@pytest.mark.parametrize("rank, expected", [
    ("0", "megapatch: UnsupportedConfigurationError: megapatch refuses X. Unset MEGAPATCH_Y to change it."),
    ("3", "megapatch: UnsupportedConfigurationError: megapatch refuses X (rank 3; the full message is on rank 0)"),
])
def test_an_uncaught_refusal_is_one_line_without_a_traceback(rank, expected):
    result = run_python(_RAISE, env={"RANK": rank, "KIND": "megapatch"})
    assert result.returncode == 1
    report = [line for line in result.stderr.strip().splitlines() if not line.startswith("megapatch enabled:")]
    assert report == [expected], result.stderr  # the activation line is rank 0's, before it


def test_other_exceptions_keep_their_traceback():
    result = run_python(_RAISE, env={"RANK": "0", "KIND": "other"})
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr and "ValueError: not megapatch's" in result.stderr


def test_a_long_first_sentence_is_cut_to_exactly_the_short_length_with_an_ellipsis():
    """Issue 28 item 8, third fresh sample: the short line's first sentence is at most
    ``SHORT_CHARS`` characters, the ellipsis included, and a cut sentence uses all of them."""
    words = " ".join(f"w{i:03d}" for i in range(60))  # 299 characters, no sentence end
    error = UnsupportedConfigurationError(words + ". The rest.")
    line = rank_errors.lines(error, 3)
    shown = line[len("megapatch: UnsupportedConfigurationError: "):line.index(" (rank 3;")]
    assert len(shown) == rank_errors.SHORT_CHARS == 120, (len(shown), shown)
    assert shown == words[:117] + "...", shown
    exact = "x" * 120
    assert exact + " (rank 1;" in rank_errors.lines(UnsupportedConfigurationError(exact + ". More."), 1)


@pytest.mark.parametrize("rank, world, waits", [(0, 1, False), (0, 2, True), (1, 2, True), (5, 8, True)])
def test_every_rank_of_a_job_waits_after_its_line_before_it_exits(monkeypatch, rank, world, waits):
    """torchrun stops the job when its first rank exits: in a job of several ranks each one waits
    after its line, so rank 0's whole message and the others' short lines all get out (CI lost
    rank 0's once, rank 1 having exited first, and rank 1's once, rank 0 having exited first); a
    single process exits at once."""
    slept, written = [], []
    monkeypatch.setattr(rank_errors.time, "sleep", slept.append)
    monkeypatch.setattr(rank_errors, "job_rank", lambda: rank)
    monkeypatch.setattr(rank_errors, "job_size", lambda: world)
    monkeypatch.setattr(sys, "stderr", type("Err", (), {"write": written.append, "flush": lambda self: None})())
    error = UnsupportedConfigurationError(MESSAGE)
    rank_errors._hook(type(error), error, None)
    assert written == [rank_errors.lines(error, rank)]
    assert slept == ([rank_errors.GRACE_S] if waits else []) and rank_errors.GRACE_S >= 2


def test_the_job_size_is_torchrun_s_world_size_before_torch_distributed_starts(monkeypatch):
    from megapatch.core import report

    for value, size in (("8", 8), ("1", 1), ("x", 1)):
        monkeypatch.setenv("WORLD_SIZE", value)
        assert report.job_size() == size
    monkeypatch.delenv("WORLD_SIZE")
    assert report.job_size() == 1


_LATE_RANK = """
    import os, time, megapatch
    from megapatch.core.errors import UnsupportedConfigurationError
    megapatch.enable(logits_dtype="fp32")
    if os.environ["RANK"] == os.environ["LATE_RANK"]:
        time.sleep(1.5)  # this rank reaches the refusal last, as in the CI runs that lost its line
    raise UnsupportedConfigurationError("megapatch refuses X. Unset MEGAPATCH_Y to change it.")
    """


@pytest.mark.parametrize("late", ["0", "1"])
def test_every_ranks_line_survives_torchrun_whichever_rank_refuses_first(tmp_path, late):
    """Through torchrun, which stops every rank once one has exited: one rank refuses 1.5 s after
    the other, and both lines are printed, rank 0's whole message and rank 1's short one."""
    import subprocess
    import textwrap

    script = tmp_path / "refuse.py"
    script.write_text(textwrap.dedent(_LATE_RANK))
    env = environ_without_megapatch()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", "0", str(script)],
                            env={**env, "PYTHONWARNINGS": "ignore", "LATE_RANK": late},
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "megapatch refuses X (rank 1; the full message is on rank 0)" in output, output
    assert "megapatch: UnsupportedConfigurationError: megapatch refuses X. Unset MEGAPATCH_Y to change it." \
        in output, output
