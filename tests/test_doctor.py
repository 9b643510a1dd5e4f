"""`megapatch doctor`: versions, per-patch compatibility, what the environment would enable."""

import os
import shutil
import subprocess
import sys

from conftest import run_python

from megapatch.doctor import diagnose


def test_doctor_reports_versions_and_patches():
    result = run_python("import sys; from megapatch.cli import main; sys.exit(main(['doctor']))")
    assert result.returncode == 0, result.stderr
    for word in ("python", "torch", "megatron-core", "transformer-engine", "wrapt",
                 "tp_reduce.megatron_core", "compatible", "no MEGAPATCH_* variable set"):
        assert word in result.stdout


def test_doctor_console_script_and_module_entry_point():
    exe = shutil.which("megapatch", path=os.path.dirname(sys.executable))
    assert exe, "console script `megapatch` not installed next to this python"
    via_script = subprocess.run([exe, "doctor"], capture_output=True, text=True, timeout=120)
    via_module = run_python("import runpy; runpy.run_module('megapatch', run_name='__main__')")
    assert via_script.returncode == 0, via_script.stderr
    assert "result: OK" in via_script.stdout
    assert via_module.returncode == 2  # no sub-command: argparse usage error


def test_doctor_says_what_the_environment_enables():
    result = run_python("import sys; from megapatch.cli import main; sys.exit(main(['doctor']))",
                        env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    assert result.returncode == 0, result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("tp_reduce.megatron_core"))
    assert " yes " in line and "compatible" in line and "backend:" in line


def test_doctor_exit_2_on_invalid_environment():
    result = run_python("import sys; from megapatch.cli import main; sys.exit(main(['doctor']))",
                        env={"MEGAPATCH_LOGITS_DTYPE": "fp16"})
    assert result.returncode == 2
    assert "MEGAPATCH_LOGITS_DTYPE='fp16' is refused" in result.stdout


def test_doctor_exit_1_when_a_requested_patch_cannot_apply(monkeypatch):
    from megatron.core.tensor_parallel import mappings

    def _reduce(tensor, process_group):
        return tensor

    monkeypatch.setattr(mappings, "_reduce", _reduce)
    monkeypatch.setenv("MEGAPATCH_TP_REDUCE_DTYPE", "fp32")
    code, text = diagnose()
    assert code == 1
    assert "INCOMPATIBLE" in text and "mappings._reduce takes (tensor, process_group)" in text
    monkeypatch.delenv("MEGAPATCH_TP_REDUCE_DTYPE")
    code, _ = diagnose()
    assert code == 0  # not requested: reported, but not a failure
