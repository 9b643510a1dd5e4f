"""Activation from MEGAPATCH_* variables alone, through the installed startup hook."""

import glob
import json
import os
import subprocess
import sys
import sysconfig

from conftest import REPO, environ_without_megapatch, run_python

SCRIPT = os.path.join(REPO, "tests", "scripts", "row_parallel_tp2.py")


def test_startup_hook_is_installed_in_site_packages():
    purelib = sysconfig.get_paths()["purelib"]
    assert os.path.exists(os.path.join(purelib, "megapatch-startup.pth")), (
        "megapatch is not pip-installed in this environment (the README's test command installs it)")


def _torchrun(tmp_path, env_extra):
    env = environ_without_megapatch()
    env.update(env_extra, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    prefix = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           SCRIPT, prefix]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.load(open(p)) for p in sorted(glob.glob(prefix + ".rank*.json"))]
    assert len(reports) == 2
    return reports, result.stdout + result.stderr


def test_torchrun_with_environment_only_activates_every_rank(tmp_path):
    patched, output = _torchrun(tmp_path, {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    for report in patched:
        assert report["megapatch_loaded"] and "tp_reduce.megatron_core" in report["active"]
        assert report["equals_oracle"], report  # FP32 accumulator reduced, rounded once
    # the job log says so exactly once (rank 0), with the settings' sources and the patches
    lines = [line for line in output.splitlines() if "megapatch enabled:" in line]
    assert len(lines) == 1, output[-4000:]
    assert "tp_reduce_dtype=fp32 (env MEGAPATCH_TP_REDUCE_DTYPE)" in lines[0]
    # which patches are active: the patches line, once they installed (issue 48 item 4)
    [installed] = [line for line in output.splitlines() if "megapatch installed: patches active: " in line]
    assert "tp_reduce.megatron_core" in installed, installed


def test_torchrun_without_environment_is_stock(tmp_path):
    stock, output = _torchrun(tmp_path, {})
    assert "megapatch" not in output
    for report in stock:
        assert not report["megapatch_loaded"]  # the startup hook costs nothing: not even an import
        assert not report["equals_oracle"], report  # BF16 partial sums: the oracle sees it


def test_invalid_value_stops_only_processes_that_import_megatron():
    env = {"MEGAPATCH_TP_REDUCE_DTYPE": "fp16"}
    unrelated = run_python("import json, sys; print('fine')", env=env)
    assert unrelated.returncode == 0 and unrelated.stdout.strip() == "fine"
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)
    assert pip.returncode == 0
    stopped = run_python("import megatron.core", env=env)
    assert stopped.returncode != 0
    assert "MEGAPATCH_TP_REDUCE_DTYPE='fp16' is not valid" in stopped.stderr
    assert "valid choices: native, fp32, fp32-accumulate" in stopped.stderr


def test_disable_variable_wins_over_requests():
    result = run_python("""
        import megatron.core, megapatch
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import layers, mappings
        from megapatch.core.wrappers import is_megapatch_wrapper
        print(megapatch.status().active)
        # the kill switch keeps only the publish-only hook (so peers fail fast, issue 19 item 12)
        print(is_megapatch_wrapper(parallel_state.initialize_model_parallel),
              is_megapatch_wrapper(mappings._reduce), is_megapatch_wrapper(layers.RowParallelLinear.forward))
        """, env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_DISABLE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-2:] == ["[]", "True False False"]


def test_explicit_enable_in_the_script_wins_over_the_environment():
    result = run_python("""
        import megapatch
        megapatch.enable(tp_reduce_dtype="fp32-accumulate")
        import megatron.core
        print(megapatch.status().settings["tp_reduce_dtype"])
    """, env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "fp32-accumulate"


def test_environment_activation_reports_its_source():
    result = run_python("import megatron.core, megapatch; s = megapatch.status(); "
                        "print(s.sources['tp_reduce_dtype'], s.active)",
                        env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    assert result.returncode == 0, result.stderr
    assert "env MEGAPATCH_TP_REDUCE_DTYPE" in result.stdout and "tp_reduce.megatron_core" in result.stdout
