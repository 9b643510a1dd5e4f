"""The NeMo-Run plugin sets megapatch's variables on a task's executor (needs the ``nemo-run`` extra).

The end-to-end test launches a tiny megatron-core GPT training step on two CPU ranks through a
NeMo-Run ``LocalExecutor`` (torchrun launcher) and reads megapatch's activation line from the job
log NeMo-Run writes; the same launch without the plugin shows that the plugin is what turned it on.
"""

import glob
import importlib.util
import logging
import os
import re
import sys
import time

import pytest

# Skip only where nemo-run is not installed. Installed but not importable (the leptonai 0.47 break
# the extra's pins avoid) is an error here, not a skip.
if importlib.util.find_spec("nemo_run") is None:
    pytest.skip("nemo-run is not installed (pip install '.[nemo-run]')", allow_module_level=True)

import nemo_run  # noqa: E402
from nemo_run import config as nemo_run_config  # noqa: E402
from torchx.specs import AppState  # noqa: E402 -- nemo_run's job states are torchx's

from megapatch.core import options  # noqa: E402
from megapatch.core.errors import OptionError  # noqa: E402
from megapatch.integrations import nemo_run as integration  # noqa: E402
from megapatch.integrations.nemo_run import MegapatchPlugin  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SCRIPT = os.path.join(REPO, "tests", "scripts", "nemo_run_tiny_gpt.py")


@pytest.fixture
def nemorun_home(tmp_path):
    """NeMo-Run's experiment directory under tmp_path. nemo_run reads NEMORUN_HOME once, at import,
    so setting the variable in a test would not move it: set_nemorun_home does."""
    previous = nemo_run_config.get_nemorun_home()
    home = tmp_path / "nemo_run_home"
    nemo_run_config.set_nemorun_home(str(home))
    yield home
    nemo_run_config.set_nemorun_home(previous)


def test_every_option_is_a_field():
    fields = set(MegapatchPlugin.__dataclass_fields__)
    assert {o.name for o in options.OPTIONS} <= fields


def test_setup_adds_the_variables_and_keeps_the_executors_own():
    plugin = MegapatchPlugin(tp_reduce_dtype="float32", strict=False,
                             skip_patches=["tp_reduce.transformer_engine"])
    executor = nemo_run.LocalExecutor(env_vars={"NCCL_DEBUG": "WARN"})
    plugin.setup(nemo_run.Script(inline="true"), executor)
    set_by = executor.env_vars.pop(options.SET_BY_ENV)
    assert executor.env_vars == {"NCCL_DEBUG": "WARN", "MEGAPATCH_TP_REDUCE_DTYPE": "fp32",
                                 "MEGAPATCH_STRICT": "0",
                                 "MEGAPATCH_SKIP_PATCHES": "tp_reduce.transformer_engine"}
    # what the plugin writes, the variables' parser reads back as the same settings, and a message
    # on a rank names the plugin field the user wrote
    settings, sources = options.resolve({}, environ={**executor.env_vars, options.SET_BY_ENV: set_by})
    assert (settings.tp_reduce_dtype, settings.strict) == ("fp32", False)
    assert sources["tp_reduce_dtype"] == ("env MEGAPATCH_TP_REDUCE_DTYPE set by NeMo-Run "
                                          "MegapatchPlugin(tp_reduce_dtype='float32')")
    assert options.origin("tp_reduce_dtype", "fp32", sources["tp_reduce_dtype"]).startswith(
        "NeMo-Run MegapatchPlugin(tp_reduce_dtype='float32'), which sets MEGAPATCH_TP_REDUCE_DTYPE=fp32")


def test_invalid_value_fails_when_the_plugin_is_built():
    with pytest.raises(OptionError, match=r"MegapatchPlugin.logits_dtype='fp16' is refused"):
        MegapatchPlugin(logits_dtype="fp16")
    with pytest.raises(OptionError, match="valid choices: native, fp32, fp32-accumulate"):
        MegapatchPlugin(tp_reduce_dtype="bf16")


def test_the_installed_nemo_run_is_a_tested_version():
    assert integration.warn_if_untested(nemo_run.__version__) is False
    from megapatch.core.upstream_versions import version_info
    assert version_info("nemo-run") == (nemo_run.__version__, "imported nemo_run")


def test_an_untested_nemo_run_version_warns_once_naming_both(monkeypatch, caplog):
    monkeypatch.setattr(integration, "_warned", set())
    monkeypatch.setattr(integration._versions, "version_of",
                        lambda package: "0.12.0" if package == "nemo-run" else None)
    with caplog.at_level(logging.WARNING, logger="megapatch"):
        MegapatchPlugin(logits_dtype="fp32")
        MegapatchPlugin(tp_reduce_dtype="fp32")  # same process, same version: not again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "nemo-run 0.12.0 is outside" in warnings[0]
    assert integration.TESTED_NEMO_RUN in warnings[0]
    assert integration.warn_if_untested("0.9.0") is True  # below the range too
    assert integration.warn_if_untested(None) is False  # version unknown: nothing to say


def test_the_task_sees_the_variables(tmp_path, nemorun_home):
    """End to end through NeMo-Run: a local task prints its MEGAPATCH_* environment."""
    out = tmp_path / "env.txt"
    nemo_run.run(nemo_run.Script(inline=f"env | grep ^MEGAPATCH_ > {out}"),
                 executor=nemo_run.LocalExecutor(),
                 plugins=[MegapatchPlugin(logits_dtype="fp32")], detach=False)
    assert sorted(out.read_text().splitlines()) == [
        "MEGAPATCH_LOGITS_DTYPE=fp32",
        "MEGAPATCH_SET_BY=MEGAPATCH_LOGITS_DTYPE=fp32|NeMo-Run MegapatchPlugin(logits_dtype='fp32')"]
    assert glob.glob(str(nemorun_home / "experiments" / "*"))  # NeMo-Run wrote under the tmp home


def _train(name, plugins, monkeypatch):
    """Launches the tiny GPT step as NeMo-Run does for a user: an experiment with one task, a
    LocalExecutor with 2 tasks per node and the torchrun launcher, attached until it ends.
    Returns (the finished job, its log text)."""
    # torchx starts `torchrun` by name: the venv's bin must be on PATH, as in an activated venv
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    executor = nemo_run.LocalExecutor(ntasks_per_node=2, launcher="torchrun")
    script = nemo_run.Script(path=TRAIN_SCRIPT, entrypoint="python")
    with nemo_run.Experiment(name) as exp:
        exp.add(script, executor=executor, name="train", plugins=plugins)
        exp.run(sequential=True, detach=False)
        (job,) = exp.jobs
    # job.state: what the attached run waited for (exp.status() asks the local scheduler again,
    # which can still say RUNNING). NeMo-Run's task log:
    # <job_dir>/nemo_run/<app id>/<task>/0/combined.log, the torchrun agent's output with every
    # rank's lines prefixed [default<rank>]:
    logs = glob.glob(os.path.join(job.executor.job_dir, "nemo_run", "*", "train", "0", "combined.log"))
    assert len(logs) == 1, (job.executor.job_dir, logs)
    with open(logs[0]) as fh:
        return job, fh.read()


@pytest.mark.resumes  # CI's resumes stage: the README command's time budget
@pytest.mark.timeout(300)
def test_local_torchrun_job_trains_with_megapatch_on(nemorun_home, monkeypatch):
    """A tiny megatron-core GPT at TP=2 on two CPU ranks, launched by NeMo-Run with the plugin:
    the job log has rank 0's activation line with the plugin's options and sources, the step
    finished, and the logits were FP32 (the model is BF16, so logits_dtype really took effect).
    The same launch without the plugin: no activation line, BF16 logits."""
    t0 = time.monotonic()
    job, log = _train("megapatch-nemo-run", [MegapatchPlugin(tp_reduce_dtype="fp32",
                                                                logits_dtype="fp32")], monkeypatch)
    assert job.state == AppState.SUCCEEDED, log[-3000:]
    enabled = re.findall(r"^\[default(\d+)\]:megapatch enabled: (.*)$", log, re.MULTILINE)
    assert [rank for rank, _ in enabled] == ["0"], log[-3000:]  # rank 0 only, once
    line = enabled[0][1]
    # the activation line names the plugin fields the user wrote (issue 19 item 7)
    assert ("tp_reduce_dtype=fp32 (env MEGAPATCH_TP_REDUCE_DTYPE set by NeMo-Run "
            "MegapatchPlugin(tp_reduce_dtype='fp32'))") in line
    assert "logits_dtype=fp32 (env MEGAPATCH_LOGITS_DTYPE set by NeMo-Run MegapatchPlugin(logits_dtype='fp32'))" in line
    # which patches: the patches line, once they are installed (issue 48 item 4)
    installed = re.findall(r"^\[default(\d+)\]:megapatch installed: (patches active: .*)$", log, re.MULTILINE)
    assert [rank for rank, _ in installed] == ["0"] and "tp_reduce.megatron_core" in installed[0][1], log[-3000:]
    done = re.findall(r"^\[default0\]:nemo_run_tiny_gpt step done: (.*)$", log, re.MULTILINE)
    assert len(done) == 1, log[-3000:]
    assert "world=2 logits_dtype=torch.float32" in done[0] and "step_ok=True" in done[0]
    assert "megapatch_enabled=True" in done[0]
    # the executor NeMo-Run recorded for the task carries the plugin's variables
    with open(os.path.join(job.executor.job_dir, "configs", "train_executor.yaml")) as fh:
        recorded = fh.read()
    assert "MEGAPATCH_TP_REDUCE_DTYPE: fp32" in recorded and "MEGAPATCH_LOGITS_DTYPE: fp32" in recorded

    job, log = _train("megapatch-nemo-run-control", [], monkeypatch)
    assert job.state == AppState.SUCCEEDED, log[-3000:]
    assert "megapatch enabled" not in log
    done = re.findall(r"^\[default0\]:nemo_run_tiny_gpt step done: (.*)$", log, re.MULTILINE)
    assert len(done) == 1 and "logits_dtype=torch.bfloat16" in done[0], log[-3000:]
    assert "megapatch_enabled=False" in done[0]
    print(f"two NeMo-Run launches (plugin, control): {time.monotonic() - t0:.1f} s")


def test_options_are_keyword_only_fields():
    """MegapatchPlugin(tp_reduce_dtype="fp32"), never MegapatchPlugin("fp32"): a positional value
    would land on whichever option comes first in the option table (issue 28 item 8, third fresh
    sample)."""
    with pytest.raises(TypeError, match="positional argument"):
        MegapatchPlugin("fp32")
    assert all(f.kw_only for f in MegapatchPlugin.__dataclass_fields__.values()
               if f.name in {o.name for o in options.OPTIONS})
