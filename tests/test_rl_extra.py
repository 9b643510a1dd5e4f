"""The `rl` extra installs what Megatron-LM core_v0.16.1's ``train_rl.py`` imports, and `rl-main` what
main's (d98e8a6) does: ``megatron.rl.rl_utils`` and ``train_rl.py`` itself import, and one GRPO step
runs, in a venv made with that extra alone, plus torch, megatron-core and pytest.

Only such a venv can show it (another extra would bring the missing package: fastapi came with the
others), so the test runs where ``MPTEST_RL_EXTRA`` names the extra the venv was built with (CI's
`rl-extra` stage builds it) and skips elsewhere, saying so. In that venv it first checks that nothing
else is installed: every distribution is in the requirement closure of ``megapatch[<extra>]``, torch,
megatron-core and pytest."""

import importlib.metadata
import os
import subprocess
import sys

import pytest

from conftest import pinned_megatron_lm

EXTRA_ENV = "MPTEST_RL_EXTRA"
#: the extra each Megatron-LM revision's train_rl.py needs
EXTRAS = {"core_v0.16.1": "rl", "main-d98e8a64": "rl-main"}
#: what the venv holds beside megapatch[<extra>] (the test's own runner, what venv puts in)
ROOTS = ("torch", "megatron-core", "pytest", "pytest-timeout")
BASE = ("pip", "setuptools", "wheel")


def _name(text: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(text)


def closure(roots) -> set:
    """The installed distributions that ``roots`` (requirement strings, extras included) require,
    transitively, markers evaluated for this interpreter and the extras asked for."""
    from packaging.requirements import Requirement

    seen, todo = set(), [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        for extra in sorted(req.extras) or [""]:
            key = (_name(req.name), extra)
            if key in seen:
                continue
            seen.add(key)
            try:
                dist = importlib.metadata.distribution(req.name)
            except importlib.metadata.PackageNotFoundError:
                continue  # an optional requirement that is not installed: nothing below it
            for text in dist.requires or ():
                sub = Requirement(text)
                if sub.marker is None or sub.marker.evaluate({"extra": extra}):
                    todo.append(sub)
    return {name for name, _ in seen}


def _installed() -> set:
    return {_name(d.metadata["Name"]) for d in importlib.metadata.distributions() if d.metadata["Name"]}


@pytest.fixture(params=sorted(EXTRAS))
def revision(request):
    from megapatch.testing.ranks import megatron_lm_runs as mlm

    built = os.environ.get(EXTRA_ENV)
    if built is None:
        pytest.skip(f"needs a venv made with one `rl` extra alone ({EXTRA_ENV}=rl or rl-main names it): "
                    f"CI's rl-extra stage; here other extras may bring what the extra lacks")
    if built != EXTRAS[request.param]:
        pytest.skip(f"this venv was made with the `{built}` extra; Megatron-LM {request.param}'s train_rl.py "
                    f"is checked in one made with `{EXTRAS[request.param]}`")
    too_old = mlm.python_too_old(request.param)
    if too_old:
        pytest.fail(f"the `{built}` extra's venv must be made with Python >= 3.12: {too_old}")
    return request.param


def test_the_venv_holds_the_extra_alone(revision):
    """Nothing but ``megapatch[<extra>]``, torch, megatron-core and pytest (and what they require)."""
    extra = EXTRAS[revision]
    wanted = closure([f"megapatch[{extra}]", *ROOTS]) | set(BASE)
    assert _name("fastapi") in wanted or extra != "rl", "the extra no longer asks for fastapi"
    others = sorted(_installed() - wanted)
    assert not others, f"installed beside megapatch[{extra}], torch, megatron-core and pytest: {others}"


def test_megatron_rl_and_train_rl_import_with_the_extra_alone(revision, tmp_path_factory):
    """``import megatron.rl.rl_utils`` and ``train_rl.py``'s own imports (run as ``import train_rl`` from
    the checkout's root, its ``__main__`` block not run), the checkout on ``PYTHONPATH`` as a user's
    launch has it."""
    try:
        checkout = pinned_megatron_lm(tmp_path_factory, revision)
    except pytest.skip.Exception as exc:  # here a missing training package is the extra's gap, not a skip
        pytest.fail(f"with the `{EXTRAS[revision]}` extra alone: {exc}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAPATCH_")}
    env.update(PYTHONPATH=str(checkout), WANDB_MODE="disabled")
    done = subprocess.run([sys.executable, "-c", "import megatron.rl.rl_utils, train_rl; print('imported')"],
                          cwd=str(checkout), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "imported" in done.stdout, (done.stdout[-2000:] + done.stderr[-4000:])


def test_train_rl_runs_a_grpo_step_with_the_extra_alone(revision, tmp_path_factory):
    """What train_rl.py imports as it runs (the rollout server, the agent, the tokenizer), not only at
    its start: one GRPO step of the tiny dense model on 2 CPU ranks (trainer TP 2, rollouts TP 1),
    megapatch enabled with native settings; the step's mismatch line is in its log."""
    from megapatch.testing.scenarios import train_rl

    try:
        checkout = pinned_megatron_lm(tmp_path_factory, revision)
    except pytest.skip.Exception as exc:
        pytest.fail(f"with the `{EXTRAS[revision]}` extra alone: {exc}")
    job, steps = train_rl.run(checkout, tmp_path_factory.mktemp("train-rl"), nproc=2, tp=2, rollout_tp=1, iters=1,
                              megapatch_env={"MEGAPATCH_LOGITS_DTYPE": "native"}, name="extra", revision=revision,
                              timeout=600)
    assert job.returncode == 0, job.tail()
    assert len(steps) == 1, steps
    assert "megapatch rl_report.mismatch: iteration 1:" in job.log, job.tail()
