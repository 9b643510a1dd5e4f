"""rl_report.mismatch: Megatron RL's train-vs-rollout mismatch as one job-log line per RL step (rank 0).

Against Megatron-LM core_v0.16.1's own ``update_inference_logprobs_group_stats`` (``megatron/rl/rl_utils.py``),
in a child process with the pinned checkout on ``PYTHONPATH`` (a test process that imported
``megatron.rl`` would change what later tests in it find), on planted log-probs: the line's figures are
upstream's ``RolloutStats`` as upstream fills them, and those and the bit-identical count agree with an
independent computation (NumPy: FP64 probabilities, the bits as unsigned integers). The line in a real
``train_rl.py`` job: tests/test_train_rl.py."""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import pinned_megatron_lm

NEEDS = ("wandb", "tensorboard", "zmq", "msgpack", "transformers", "fastapi", "uvicorn")

#: a line of rl_report.mismatch, its figures as groups
LINE = re.compile(
    r"megapatch rl_report\.mismatch: (?:iteration (?P<iteration>\d+): )?train vs rollout log-probs of "
    r"(?P<tokens>\d+) generated tokens \(rank 0, (?P<dtype>\w+)\): max \|p_train - p_inf\| (?P<max_diff>\S+), "
    r"mean (?P<mean_diff>\S+); p_old/p_inf min (?P<min_ratio>\S+), max (?P<max_ratio>\S+); "
    r"bit-identical (?P<identical>\d+)/(?P<compared>\d+) \((?P<share>[0-9.]+)%\)$")

# The child: megapatch enabled with native settings (nothing changes numerics), upstream's function
# called as align_unpacked_inference_logprobs calls it, for each planted case; what the "megapatch"
# logger said and what upstream put into its statistics, as JSON.
CHILD = textwrap.dedent("""
    import io, json, logging, os, sys, types
    import torch
    import megapatch

    cases = json.loads(sys.argv[1])
    megapatch.enable(logits_dtype="native")
    from megatron.rl import rl_utils
    from megatron.training import global_vars

    said = io.StringIO()
    handler = logging.StreamHandler(said)
    logging.getLogger("megapatch").addHandler(handler)
    logging.getLogger("megapatch").setLevel(logging.INFO)
    out = []
    for case in cases:
        if case.get("disable"):
            megapatch.disable()
        os.environ["RANK"] = str(case.get("rank", 0))
        if case.get("iteration") is not None:
            global_vars._GLOBAL_ARGS = None
            global_vars.set_args(types.SimpleNamespace(curr_iteration=case["iteration"]))
        start = said.tell()
        stats = rl_utils.RolloutStats(*([None] * len(rl_utils.RolloutStats.__slots__)))
        rl_utils.update_inference_logprobs_group_stats(
            old_logprobs=torch.tensor(case["old"], dtype=getattr(torch, case["old_dtype"])),
            inference_logprobs=torch.tensor(case["inf"], dtype=getattr(torch, case["inf_dtype"])),
            mask=torch.tensor(case["mask"], dtype=torch.bool),
            group_stats=stats)
        lines = [l for l in said.getvalue()[start:].splitlines() if "rl_report.mismatch" in l]
        out.append({"lines": lines, "stats": {k: getattr(stats, k) for k in rl_utils.RolloutStats.__slots__}})
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def rl_checkout(tmp_path_factory):
    import importlib.util

    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Megatron-LM's megatron.rl needs {', '.join(missing)} (the `rl` extra)")
    return pinned_megatron_lm(tmp_path_factory)


def _run(checkout, cases):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGAPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["WANDB_MODE"] = "disabled"
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], cwd=str(checkout), env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [result] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(result[len("RESULT "):])


def _planted():
    """Log-probs of 3 rollouts x 8 tokens (float32) and the engine's for them: bit-identical at some
    generated tokens, off by one unit in the last place or by a few per mille at others, a -0.0
    against a 0.0 (the same value, other bits) at one; the prompt's tokens (mask off) far apart, so
    a figure that counts them is seen."""
    rng = np.random.default_rng(7)
    old = (-rng.uniform(0.01, 4.0, size=(3, 8))).astype(np.float32)
    mask = np.zeros((3, 8), dtype=bool)
    mask[0, 2:], mask[1, 5:], mask[2, 1:7] = True, True, True
    inf = old.copy()
    inf[0, 3] = np.nextafter(old[0, 3], np.float32(0))  # 1 ulp
    inf[0, 6] = old[0, 6] * np.float32(1.003)
    inf[2, 2] = old[2, 2] - np.float32(0.002)
    inf[1, 6] = old[1, 6] + np.float32(0.001)
    old[2, 5], inf[2, 5] = np.float32(0.0), np.float32(-0.0)
    inf[~mask] = np.float32(-0.0001)  # p_inf ~ 1 where old's p is small: far off, but not compared
    return old, inf, mask


def _reference(old, inf, mask):
    """What the line must say, computed apart from torch and upstream: FP64 probabilities; bits."""
    a, b = old.astype(np.float64)[mask], inf.astype(np.float64)[mask]
    diffs, ratios = np.abs(np.exp(a) - np.exp(b)), np.exp(a - b)
    bits = old.view(np.uint32)[mask] == inf.view(np.uint32)[mask]
    return dict(max_diff=diffs.max(), mean_diff=diffs.mean(), min_ratio=ratios.min(), max_ratio=ratios.max(),
                identical=int(bits.sum()), compared=int(mask.sum()))


def _case(old, inf, mask, **more):
    return dict(old=old.tolist(), inf=inf.tolist(), mask=mask.tolist(), old_dtype="float32",
                inf_dtype="float32", **more)


def test_the_mismatch_line_states_upstreams_figures_and_the_share_of_bit_identical_log_probs(rl_checkout):
    """One line per call on rank 0: upstream's own max/mean |p_train - p_inf| and min/max p_old/p_inf
    (read back from the RolloutStats upstream filled, equal to an FP64 computation within FP32
    rounding), and the bit-identical count over the generated tokens only (here 10 of 15: a value
    comparison would count the -0.0 as identical (11), a count over every token 10 of 24), labelled
    with Megatron-LM's iteration; nothing on rank 1 (upstream's statistics filled all the same); no
    generated token says so; mixed dtypes (a BF16 trainer, FP32 engine log-probs) compare as FP32;
    after ``megapatch.disable()`` upstream's function alone runs, its statistics unchanged."""
    old, inf, mask = _planted()
    ref = _reference(old, inf, mask)
    assert (ref["identical"], ref["compared"]) == (10, 15)  # the planted differences
    bf16 = (np.round(old * 64) / 64).astype(np.float32)  # multiples of 1/64 in [-4, 0]: exact in BF16
    engine = bf16.copy()
    engine[0, 4] += np.float32(1e-6)  # not a BF16 value: differs from every BF16 trainer log-prob
    cases = [
        _case(old, inf, mask, iteration=4),
        _case(old, inf, mask, rank=1),
        _case(old, inf, np.zeros_like(mask)),
        dict(_case(bf16, engine, mask), old_dtype="bfloat16"),
        _case(old, inf, mask, disable=True),
    ]
    first, other_rank, empty, mixed, after = _run(rl_checkout, cases)

    [line] = first["lines"]
    m = LINE.search(line)
    assert m, line
    stats = first["stats"]
    assert m["iteration"] == "5"  # curr_iteration 4 done: Megatron-LM logs the step these feed as 5
    assert (int(m["tokens"]), m["dtype"]) == (15, "float32")
    for group, field in (("max_diff", "max_inf_train_prob_abs_diff"), ("mean_diff", "mean_inf_train_prob_abs_diff"),
                         ("min_ratio", "min_piold_to_inf_prob"), ("max_ratio", "max_piold_to_inf_prob")):
        assert float(m[group]) == stats[field], (group, line, stats)  # upstream's figure, as it computed it
        assert float(m[group]) == pytest.approx(ref[group], rel=1e-5, abs=1e-7), (group, line, ref)
    assert (int(m["identical"]), int(m["compared"])) == (ref["identical"], ref["compared"])
    assert m["share"] == "66.66"  # 10/15 = 66.666...%, floored

    assert other_rank["lines"] == [] and other_rank["stats"] == stats  # rank 1: upstream alone
    assert empty["lines"] == ["megapatch rl_report.mismatch: iteration 5: train vs rollout log-probs: no generated tokens to "
                              "compare (rank 0)"]
    [mixed_line] = mixed["lines"]
    m = LINE.search(mixed_line)
    assert m and m["dtype"] == "float32" and (int(m["identical"]), int(m["compared"])) == (14, 15), mixed_line
    assert after["lines"] == [] and after["stats"] == stats


def test_the_patch_is_on_wherever_megapatch_is_enabled_and_leaves_with_skip_patches():
    """No option to set: any megapatch settings (native ones too) install it when megatron.rl.rl_utils is
    imported; MEGAPATCH_SKIP_PATCHES leaves it out; off when megapatch is."""
    import megapatch
    from megapatch.core import options
    from megapatch.patches.rl_report import mismatch

    [patch] = mismatch.PATCHES
    for settings in (options.Settings(), options.Settings(tp_invariant=True, logits_dtype="fp32"),
                     options.Settings(tp_reduce_dtype="fp32")):
        assert patch.applies(settings)
    assert patch.left_out(("rl_report.mismatch",))
    assert megapatch.status().patch("rl_report.mismatch").state == "inactive"  # megapatch off
