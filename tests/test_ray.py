"""Issue 28 item 7: megapatch in Ray actors, as RL frameworks start Megatron ranks (verl, NeMo-RL,
OpenRLHF): a local Ray cluster on CPU, two actors per job forming a gloo group, megatron-core's
parallel state at TP=2 and a tiny GPT trained one step; megapatch switched on only through each
actor's ``runtime_env`` ``env_vars`` (megapatch.testing.scenarios.ray_actors). One Ray session runs
every job: switched on, not switched on, and one actor with a different setting."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, environ_without_megapatch

pytest.importorskip("ray", reason="Ray is not installed (pip install '.[ray]')")
pytestmark = pytest.mark.resumes  # CI's resumes stage: the README command's time budget (one 63 s Ray job)

FP32 = {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_LOGITS_DTYPE": "fp32"}
JOBS = [
    {"name": "on", "env": [FP32, FP32]},
    {"name": "off", "env": [{}, {}]},
    {"name": "mismatch", "env": [FP32, {**FP32, "MEGAPATCH_TP_REDUCE_DTYPE": "native"}]},
]


@pytest.fixture(scope="module")
def ray_jobs():
    env = environ_without_megapatch()
    env.update(PYTHONWARNINGS="ignore", RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0")
    try:  # inside pytest's 600-s timeout, so a hung cluster shows its own output
        result = subprocess.run([sys.executable, "-m", "megapatch.testing.scenarios.ray_actors", json.dumps(JOBS)],
                                env=env, capture_output=True, text=True, timeout=540, cwd=REPO)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the Ray scenario did not finish in 540 s:\n{hung.stdout}\n{hung.stderr}")
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    line = [row for row in result.stdout.splitlines() if row.startswith("RESULT ")]
    assert len(line) == 1, result.stdout[-3000:]
    return json.loads(line[0][len("RESULT "):]), result.stdout + result.stderr


def test_runtime_env_variables_alone_switch_megapatch_on_in_every_actor(ray_jobs):
    results, _ = ray_jobs
    on, off = results["on"], results["off"]
    assert [r["status"] for r in on + off] == ["trained"] * 4, (on, off)
    for r in on:
        assert r["enabled"] and "tp_reduce.megatron_core" in r["active"], r
        assert r["settings"]["tp_reduce_dtype"] == "fp32" and r["logits_dtype"] == "torch.float32", r
    for r in off:  # the same actors without the variables: upstream as it is
        assert not r["enabled"] and r["logits_dtype"] == "torch.bfloat16", r
    assert len({r["pid"] for r in on + off}) == 4  # every actor its own worker process
    # the same model and batch: FP32 logits and reductions move the loss by rounding only
    assert on[0]["loss"] == on[1]["loss"] and abs(on[0]["loss"] - off[0]["loss"]) < 1e-2, (on, off)


def test_the_activation_line_appears_once_per_job(ray_jobs):
    _, log = ray_jobs
    lines = [row for row in log.splitlines() if "megapatch enabled:" in row]
    # jobs "on" and "mismatch" activate (rank 0 logs); "off" does not
    assert len(lines) == 2, lines
    assert all("tp_reduce_dtype=fp32 (env MEGAPATCH_TP_REDUCE_DTYPE)" in row for row in lines), lines


def test_an_actor_with_another_setting_is_refused_by_the_cross_rank_check(ray_jobs):
    results, _ = ray_jobs
    mismatch = results["mismatch"]
    assert [r["status"] for r in mismatch] == ["error", "error"], mismatch
    assert any("CrossRankMismatchError" in r["error"] and "tp_reduce_dtype" in r["error"] for r in mismatch), mismatch
