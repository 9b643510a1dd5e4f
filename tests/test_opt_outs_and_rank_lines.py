"""Issue 36 item 3 (the outside audit's engine items): behaviours no test checked. Opt-outs through
``Patch.requires`` and before ``import megatron.core``, an opted-out patch whose upstream moved, the
activation line for patches pending import, megatron imported before the start-up hook with wrapt
missing; a refusal's short line on ranks other than 0, the excepthook an application installs after
``enable()``, and the job's size and rank read from a live process group."""

from __future__ import annotations

import sys

import pytest

import megapatch
from megapatch.core import engine, rank_errors, report
from megapatch.core.errors import UnsupportedConfigurationError

from conftest import run_python
from tests.test_doctor import _flags_survey, _with_patch_replaced


# -- a refusal's short line on ranks other than 0 --------------------------------------------------

def test_the_short_line_keeps_the_dots_inside_its_first_sentence():
    """Versions, file names and decimals carry dots: the first sentence ends at ". ", not at a dot."""
    first = "megapatch needs megatron-core >= 0.16 (0.14.0 is here; docs/tp_invariant.md, width 0.5x)"
    line = rank_errors.lines(UnsupportedConfigurationError(first + ". Unset MEGAPATCH_TP_INVARIANT."), 2)
    assert line == f"megapatch: UnsupportedConfigurationError: {first} (rank 2; the full message is on rank 0)\n"


def test_disable_leaves_an_excepthook_the_application_installed_after_enable(monkeypatch):
    def before(*exc_info):
        pass

    def after(*exc_info):
        pass

    monkeypatch.setattr(sys, "excepthook", before)
    megapatch.enable(logits_dtype="fp32")
    assert sys.excepthook is rank_errors._hook
    sys.excepthook = after  # the application's, installed while megapatch is on
    megapatch.disable()
    assert sys.excepthook is after


def _live_group_job(ctx):
    """On a live gloo group, with the launcher's variables saying otherwise: the rank and the job's
    size are torch.distributed's, and the refusal line and grace wait follow them."""
    import os

    import torch.distributed as dist

    assert dist.is_initialized()
    os.environ["RANK"], os.environ["WORLD_SIZE"] = "5", "1"  # stale launcher values
    slept, written = [], []
    real_sleep, real_stderr = rank_errors.time.sleep, sys.stderr
    rank_errors.time.sleep = slept.append
    sys.stderr = type("Err", (), {"write": lambda self, text: written.append(text), "flush": lambda self: None})()
    try:
        error = UnsupportedConfigurationError("megapatch refuses X. Unset MEGAPATCH_Y to change it.")
        rank_errors._hook(type(error), error, None)
    finally:
        rank_errors.time.sleep, sys.stderr = real_sleep, real_stderr
    return report.job_size(), report.job_rank(), slept, written


def test_on_a_live_process_group_the_rank_line_and_the_grace_wait_follow_torch_distributed():
    from megapatch.testing import run_ranks

    results = run_ranks(_live_group_job, world_size=2, init_megatron=False, timeout=120)
    for rank, (size, seen_rank, slept, written) in enumerate(results):
        assert (size, seen_rank) == (2, rank)
        assert slept == [rank_errors.GRACE_S], (rank, slept)  # every rank of a 2-rank job waits
        assert written == [rank_errors.lines(UnsupportedConfigurationError(
            "megapatch refuses X. Unset MEGAPATCH_Y to change it."), rank)]


# -- opt-outs ----------------------------------------------------------------------------------------

def test_the_doctor_leaves_out_a_patch_with_the_one_it_builds_on(monkeypatch):
    """``tp_reduce.moe`` requires ``tp_reduce.megatron_core``: opting out of the latter leaves the
    MoE patch out too (the job does so), so the doctor neither installs it nor runs its preflight."""
    flags = ["--transformer-impl", "local", "--tensor-model-parallel-size", "2", "--num-experts", "8",
             "--moe-token-dispatcher-type", "flex"]
    kept = _flags_survey(monkeypatch, flags, MEGAPATCH_TP_REDUCE_DTYPE="fp32")
    assert "tp_reduce.moe" in kept["flags"]["refusals"]  # the preflight can refuse
    left = _flags_survey(monkeypatch, flags, MEGAPATCH_TP_REDUCE_DTYPE="fp32",
                         MEGAPATCH_SKIP_PATCHES="tp_reduce.megatron_core")
    [row] = [r for r in left["patches"] if r["name"] == "tp_reduce.moe"]
    assert row["requested"] and row["opted_out"] and not row["would_install"], row
    assert "tp_reduce.moe" not in left["flags"]["refusals"], left["flags"]["refusals"]


def _moved(monkeypatch, name="logits.fp32_inference"):
    """``name``'s upstream target moved (a symbol that does not exist)."""
    from megapatch.core.registry import Target

    patch = next(p for p in engine.patches() if p.name == name)
    gone = Target(patch.targets[0].module, "NoSuchClass.moved_away", patch.targets[0].wrapper)
    _with_patch_replaced(monkeypatch, name, targets=(gone,))
    return name


def test_the_doctor_passes_an_opted_out_patch_whose_upstream_moved(monkeypatch):
    name = _moved(monkeypatch)
    local = ["--transformer-impl", "local"]
    failing = _flags_survey(monkeypatch, local, MEGAPATCH_LOGITS_DTYPE="fp32")
    assert failing["result"]["code"] == 1 and name in failing["result"]["message"]  # the move is seen
    skipped = _flags_survey(monkeypatch, local, MEGAPATCH_LOGITS_DTYPE="fp32", MEGAPATCH_SKIP_PATCHES=name)
    assert skipped["flags"]["refusals"] == {} and skipped["result"]["code"] == 0, skipped["result"]


def test_strict_enable_takes_the_opt_out_its_own_message_suggests_for_a_moved_upstream(monkeypatch):
    import megatron.core.inference  # noqa: F401 -- the patch's hook is imported: strict checks it at once

    name = _moved(monkeypatch)
    hook = next(p for p in engine.patches() if p.name == name).hook
    __import__(hook)
    try:
        with pytest.raises(Exception, match=f"MEGAPATCH_SKIP_PATCHES={name}"):
            megapatch.enable(logits_dtype="fp32")
        status = megapatch.enable(logits_dtype="fp32", skip_patches=name)
        assert status.patch(name).state == "opted-out"
    finally:
        megapatch.disable()


def test_an_opt_out_given_before_megatron_is_imported_installs_nothing_of_that_patch():
    """The opted-out ``tp_reduce.megatron_core`` shares its hook module (megatron.core.tensor_parallel)
    with the FP32-logits patches, whose import installs them: it must stay out, and
    ``tp_reduce.moe``, which builds on it, too."""
    result = run_python("""
        import megapatch
        megapatch.enable(tp_reduce_dtype="fp32", logits_dtype="fp32", skip_patches="tp_reduce.megatron_core")
        from megatron.core import tensor_parallel
        from megatron.core.transformer.moe import moe_layer
        status = megapatch.status()
        print(*(status.patch(name).state for name in
                ("tp_reduce.megatron_core", "tp_reduce.moe", "logits.fp32_output_layer")))
        print(hasattr(moe_layer.MoELayer.__init__, "__wrapped__"))
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["opted-out", "opted-out", "active", "False"], result.stdout


def test_the_activation_line_names_patches_pending_import():
    """enable() before megatron is imported: the line counts the patches that install at import,
    not "none requested"; the patches line names them once installed (issue 48 item 4)."""
    result = run_python("""
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        import megapatch
        megapatch.enable(tp_reduce_dtype="fp32")
        print("megatron imported:", "megatron.core" in sys.modules)
        print(megapatch.status().patch("tp_reduce.megatron_core").reason)
        """)
    assert result.returncode == 0, result.stderr
    [line] = [l for l in result.stdout.splitlines() if l.startswith("megapatch enabled:")]
    assert "megatron imported: False" in result.stdout
    assert "none requested" not in line and " pending-import" in line, line
    assert "installs when megatron.core.tensor_parallel is imported" in result.stdout, result.stdout


def test_megatron_imported_before_the_startup_hook_with_wrapt_missing_stops_the_process():
    """A request megapatch cannot serve must not pass silently: site.py swallows an Exception from
    a .pth line, so the hook turns it into SystemExit naming wrapt."""
    result = run_python("""
        import sys, types
        sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "megapatch_trigger", False)]
        sys.modules["wrapt"] = None  # not installed
        sys.modules["megatron"] = types.ModuleType("megatron")  # imported before the hook ran
        from megapatch.core import startup
        startup._armed = False
        startup.activate_from_environment()
        print("job ran unpatched")
        """, env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "job ran unpatched" not in result.stdout
    assert "megapatch cannot activate" in result.stderr and "wrapt" in result.stderr, result.stderr
