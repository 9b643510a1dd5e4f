"""tools/gpu_check.py cannot rot: its dry run (the same code on CPU at toy sizes) passes every
section, writes both reports, and its one-GPU collectives stand-in changes no bit and restores
torch.distributed."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO


@pytest.mark.slow
@pytest.mark.resumes  # CI's resumes stage: the README command's time budget (~40 s of dry run)
def test_the_gpu_check_dry_run_passes_every_section_and_writes_both_reports(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "gpu_check.py"), "--dry-run",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and set(report["sections"]) == {"block_gemm", "batch_invariance", "tp_invariant",
                                                                  "fp32_llama", "te_layers", "production"}
    sections = report["sections"]
    if importlib.util.find_spec("transformer_engine") is None:  # its dry run: CI's te stage (test_te_runtime.py)
        assert sections["te_layers"]["skipped"] == "Transformer Engine is not installed"
    assert all(s["ok"] and "error" not in s for s in sections.values()), sections
    assert sections["block_gemm"]["cases"] > 0 and sections["block_gemm"]["differing"] == []
    # the mode is bit-identical at TP 2 and 4 through the staged collectives; native is not
    assert sections["tp_invariant"]["invariant_bit_identical_to_tp1"] == {"2": True, "4": True}
    assert sections["tp_invariant"]["native_bit_identical_to_tp1"] == {"2": False, "4": False}
    rows = {(r["mode"], r["tp"]): r for r in sections["fp32_llama"]["rows"]}
    assert rows[("fp32", 2)]["kl_vs_tp1"] < rows[("native", 2)]["kl_vs_tp1"]
    assert rows[("tp_invariant", 2)]["max_abs_dlogit"] == rows[("tp_invariant", 4)]["max_abs_dlogit"] == 0
    assert rows[("native", 4)]["max_abs_dlogit"] > 0
    assert set(sections["fp32_llama"]["cost_at_tp1"]) == {"native", "fp32", "fp32+logits", "tp_invariant"}
    cases = sections["batch_invariance"]["cases"]
    assert {c["rows"] for c in cases} == {1, 7} and all(
        isinstance(c[key], bool) for c in cases for key in ("n_block_same", "k_block_same", "plain_same"))
    # the production-shape section runs every mode at both run shapes on the code path the GPU runs, and
    # would run the shapes there (at least hidden 4096, FFN 14336, 32/8 heads, 4 layers, 4 x 4096)
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import gpu_check_production as production

    gpu = production.SHAPES["gpu"]
    assert gpu["model"]["hidden_size"] >= 4096 and gpu["model"]["ffn_hidden_size"] >= 14336
    assert (gpu["model"]["num_attention_heads"], gpu["model"]["num_query_groups"]) == (32, 8)
    assert gpu["model"]["num_layers"] >= 4 and dict(batch=4, seq=4096) in gpu["runs"]
    assert dict(batch=1, seq=16384) in gpu["runs"]
    shapes = {(r["mode"], r["batch"], r["seq"]) for r in sections["production"]["rows"]}
    assert shapes == {(m, r["batch"], r["seq"]) for m in production.MODES for r in production.SHAPES["dry"]["runs"]}
    assert all(r["step_s"] > 0 and r["ratio_vs_native"] > 0 for r in sections["production"]["rows"])
    text = (tmp_path / "gpu_check.md").read_text()
    assert "## production: ok" in text and "| tp_invariant | 1 x 128 |" in text
    assert "# GPU check (dry run on CPU)" in text and "do not bring BF16 below TP=1's BF16 error" in text


def test_the_one_gpu_collectives_stand_in_is_exact_and_restores_torch_distributed(tmp_path):
    import torch.distributed as dist

    from megapatch.testing.stand_ins.one_gpu_collectives import collectives_through_host

    before = dist.all_reduce
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        x = torch.tensor([1.0, 2.0 ** -30, 3.0], dtype=torch.float32)
        out = torch.empty(3)
        with collectives_through_host(lambda t: True):  # CPU tensors staged through copies
            assert dist.all_reduce is not before
            handle = dist.all_reduce(x, async_op=True)
            assert handle.wait() and handle.is_completed()
            dist.all_gather_into_tensor(out, x)
        assert torch.equal(out, x) and x[1].item() == 2.0 ** -30
    finally:
        dist.destroy_process_group()
    assert dist.all_reduce is before
