"""The NeMo-Run plugin sets megapatch's variables on a task's executor (needs nemo_run)."""

import os

import pytest

nemo_run = pytest.importorskip(
    "nemo_run", reason="nemo_run is not installed (or not importable): the plugin needs it")

from megapatch.core import options  # noqa: E402
from megapatch.core.errors import OptionError  # noqa: E402
from megapatch.integrations.nemo_run import MegapatchPlugin  # noqa: E402


def test_every_option_is_a_field():
    fields = set(MegapatchPlugin.__dataclass_fields__)
    assert {o.name for o in options.OPTIONS} <= fields


def test_setup_adds_the_variables_and_keeps_the_executors_own():
    plugin = MegapatchPlugin(tp_reduce_dtype="float32", strict=False,
                             skip_patches=["tp_reduce.transformer_engine"])
    executor = nemo_run.LocalExecutor(env_vars={"NCCL_DEBUG": "WARN"})
    plugin.setup(nemo_run.Script(inline="true"), executor)
    assert executor.env_vars == {"NCCL_DEBUG": "WARN", "MEGAPATCH_TP_REDUCE_DTYPE": "fp32",
                                 "MEGAPATCH_STRICT": "0",
                                 "MEGAPATCH_SKIP_PATCHES": "tp_reduce.transformer_engine"}
    # what the plugin writes, the variables' parser reads back as the same settings
    settings, sources = options.resolve({}, environ=executor.env_vars)
    assert (settings.tp_reduce_dtype, settings.strict) == ("fp32", False)
    assert sources["tp_reduce_dtype"] == "env MEGAPATCH_TP_REDUCE_DTYPE"


def test_invalid_value_fails_when_the_plugin_is_built():
    with pytest.raises(OptionError, match=r"MegapatchPlugin.logits_dtype='fp16' is refused"):
        MegapatchPlugin(logits_dtype="fp16")
    with pytest.raises(OptionError, match="valid choices: native, fp32, fp32-accumulate"):
        MegapatchPlugin(tp_reduce_dtype="bf16")


def test_the_task_sees_the_variables(tmp_path, monkeypatch):
    """End to end through NeMo-Run: a local task prints its MEGAPATCH_* environment."""
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemo_home"))
    out = tmp_path / "env.txt"
    nemo_run.run(nemo_run.Script(inline=f"env | grep ^MEGAPATCH_ > {out}"),
                 executor=nemo_run.LocalExecutor(),
                 plugins=[MegapatchPlugin(logits_dtype="fp32")], detach=False)
    assert out.read_text().split() == ["MEGAPATCH_LOGITS_DTYPE=fp32"]
