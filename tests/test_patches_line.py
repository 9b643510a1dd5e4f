"""Issue 48 item 4: the job log says which patches were installed.

The activation line comes when megapatch is switched on -- in a job, as megatron is first imported,
before the modules the patches wrap -- so it can only say that they are pending; it is now short
(settings, sources, counts). Once the pending patches are installed, one more line, once per job on
rank 0, names the active ones (and those still pending); ``megapatch.status()`` in the process says
the same; a patch installed after that line (its module imported late) gets a line of its own.
Before, a TE ``pretrain_gpt.py`` job's only line listed all 17 patches as ``pending-import`` and an
RL job's ran to 3,340 characters.
"""

import logging

import pytest

from conftest import run_python

JOB = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
import torch
import megatron.core  # activation from MEGAPATCH_*, as in a job: the patches' modules not imported yet
from megatron.core.tensor_parallel import mappings
import megapatch
print("STATUS AT ACTIVATION", megapatch.status().active)
try:  # the first patched call (in a job: as model parallelism is set up)
    mappings._reduce(torch.ones(2), None)
except Exception:
    pass
print("STATUS AFTER", ",".join(megapatch.status().active))
import megatron.core.models.gpt.gpt_model  # imported late: logits.fp32_lm_head installs now
print("STATUS LATE", ",".join(megapatch.status().active))
mappings._reduce  # noqa -- no second line from later calls
try:
    mappings._reduce(torch.ones(2), None)
except Exception:
    pass
"""


@pytest.fixture(scope="module")
def job():
    result = run_python(JOB, env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_LOGITS_DTYPE": "fp32",
                                  "MEGAPATCH_SKIP_PATCHES": "tp_reduce.transformer_engine"}, fresh=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout.splitlines()


def _status(lines, what):
    [line] = [line for line in lines if line.startswith(f"STATUS {what} ")]
    return line.split(" ", 2)[2]


def test_one_short_activation_line_with_counts_not_the_per_patch_list(job):
    [line] = [line for line in job if line.startswith("LOG megapatch enabled:")]
    assert "tp_reduce_dtype=fp32 (env MEGAPATCH_TP_REDUCE_DTYPE)" in line and "1 opted-out" in line, line
    assert " pending-import" in line and "tp_reduce.megatron_core" not in line and len(line) < 700, line


def test_once_the_pending_patches_are_installed_one_line_names_the_active_ones_as_status_does(job):
    installed = [line for line in job if line.startswith("LOG megapatch installed: ")]
    assert len(installed) == 1, job  # once, however many patched calls follow
    line = installed[0]
    assert job.index(line) > job.index(next(l for l in job if l.startswith("STATUS AT ACTIVATION")))
    active = line.split("patches active: ", 1)[1].split(";")[0].split(" | ")[0].split(", ")
    assert active == _status(job, "AFTER").split(","), (line, _status(job, "AFTER"))
    assert "tp_reduce.megatron_core" in active and "logits.fp32_output_layer" in active, line
    assert "pending-import: " in line and "logits.fp32_lm_head (until megatron.core.models.gpt.gpt_model is " \
                                          "imported)" in line, line
    assert "opted-out: tp_reduce.transformer_engine" in line, line


def test_a_patch_installed_after_that_line_gets_a_line_of_its_own(job):
    [late] = [line for line in job if line.startswith("LOG megapatch installed later: ")]
    assert late.startswith("LOG megapatch installed later: logits.fp32_lm_head (megatron.core.models.gpt.gpt_model "
                           "imported) | "), late
    assert "logits.fp32_lm_head" in _status(job, "LATE").split(","), job


def test_the_patches_line_comes_at_once_where_nothing_is_pending_and_only_on_rank_zero(monkeypatch, caplog):
    import megapatch
    import megatron.core.parallel_state  # noqa: F401 -- every module of the two patches imported
    import megatron.core.pipeline_parallel.schedules  # noqa: F401
    from megapatch.core import engine

    # the records of one option whose modules are all imported here (others, of any option, wait
    # for modules this environment may not have: Megatron RL's)
    kept = ("fp8.align_transposes", "cross_rank.publish_settings")
    monkeypatch.setattr(engine, "_patches", tuple(p for p in engine.patches() if p.name in kept))

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "megapatch"]

    try:
        with caplog.at_level(logging.INFO, logger="megapatch"):
            status = megapatch.enable(align_fp8_transposes=True)
        assert not [p for p in status.patches if p.state == "pending-import"], status
        [line] = [m for m in lines() if m.startswith("megapatch installed: ")]
        assert line.startswith(f"megapatch installed: patches active: {', '.join(status.active)} | "), line
        megapatch.disable()
        caplog.clear()
        monkeypatch.setenv("RANK", "1")
        with caplog.at_level(logging.INFO, logger="megapatch"):
            megapatch.enable(align_fp8_transposes=True)
        assert lines() == []
    finally:
        megapatch.disable()


def test_the_activation_line_of_many_pending_patches_stays_short():
    from megapatch.core import options
    from megapatch.core.report import PatchReport, Status, activation_line, patches_line

    reason = "installs when megatron.core.extensions.transformer_engine is imported"
    patches = tuple(PatchReport(f"tp_invariant.record_{i}", "tp_invariant", "", "pending-import", reason=reason,
                                backend="a coverage note of a hundred characters " * 3) for i in range(17))
    status = Status(True, {o.name: o.default for o in options.OPTIONS}, {}, {"torch": "2.5"}, patches)
    line = activation_line(status)
    assert "patches: 17 pending-import |" in line and "record_" not in line and len(line) < 400, line
    assert "record_16 (until megatron.core.extensions.transformer_engine is imported)" in patches_line(status)
    assert "coverage note" not in patches_line(status)  # backends: in status()
