"""Megatron-Bridge (issue 20 item 2): AutoBridge's Llama on CPU ranks with megapatch switched by
``MEGAPATCH_*`` only, Bridge's own training entry, the logit dtype, the version warning, and
installing megapatch into a Bridge environment.

The tests that need Bridge skip, saying so, where it is not installed (the default CI stage has
none); ``.ci/run``'s ``bridge`` stage builds the Bridge venv (docs/stack.md section 6) and runs
this file there. The first group needs no Bridge and runs everywhere.
"""

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, environ_without_megapatch, run_python

HAVE_BRIDGE = importlib.util.find_spec("megatron") is not None and \
    importlib.util.find_spec("megatron.bridge") is not None
needs_bridge = pytest.mark.skipif(
    not HAVE_BRIDGE, reason="Megatron-Bridge is not installed (its own Python 3.12 venv: .ci/run "
                            "stage 'bridge', docs/stack.md section 6)")


# -- without Bridge ----------------------------------------------------------------------------

def test_a_bridge_version_outside_the_tested_range_warns_once_naming_both(monkeypatch, caplog):
    from megapatch.core import upstream_versions as uv

    monkeypatch.setattr(uv, "_warned", set())
    versions = {"megatron-bridge": "0.7.0"}
    monkeypatch.setattr(uv, "version_of", lambda package: versions.get(package))
    with caplog.at_level(logging.WARNING, logger="megapatch"):
        assert uv.warn_if_untested_stack("megatron-bridge")
        assert not uv.warn_if_untested_stack("megatron-bridge")  # once per process and version
    [record] = [r for r in caplog.records if "megatron-bridge" in r.getMessage()]
    assert "megatron-bridge 0.7.0" in record.getMessage()
    assert uv.STACKS_TESTED["megatron-bridge"][1] in record.getMessage()
    for tested in ("0.6.2", "0.6.2+a1b2c3d"):  # a git checkout's version carries a local part
        versions["megatron-bridge"] = tested
        assert uv.untested_stack("megatron-bridge") is None
    versions.pop("megatron-bridge")  # absent: nothing to say
    assert uv.untested_stack("megatron-bridge") is None


def test_doctor_names_both_logit_dtype_settings_and_exits_1():
    result = subprocess.run([sys.executable, "-m", "megapatch", "doctor", "--", "--output-logit-dtype", "bf16"],
                            env={**environ_without_megapatch(),
                                 "MEGAPATCH_LOGITS_DTYPE": "fp32", "PYTHONWARNINGS": "ignore"},
                            capture_output=True, text=True, timeout=300, cwd="/")
    assert result.returncode == 1, result.stdout[-3000:]
    assert "REFUSED by logits.fp32_lm_head" in result.stdout
    assert "logit dtype is bf16" in result.stdout and "env MEGAPATCH_LOGITS_DTYPE" in result.stdout
    agreeing = subprocess.run([sys.executable, "-m", "megapatch", "doctor", "--", "--output-logit-dtype", "fp32"],
                              env={**environ_without_megapatch(),
                                   "MEGAPATCH_LOGITS_DTYPE": "fp32", "PYTHONWARNINGS": "ignore"},
                              capture_output=True, text=True, timeout=300, cwd="/")
    assert "REFUSED" not in agreeing.stdout, agreeing.stdout[-3000:]


# -- with Bridge -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The converter benchmark's Llama (benchmarks/llama_hf.py MODEL), its token batch, and
    transformers' own FP32 forward of it (the oracle)."""
    import torch

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from llama_hf import BATCH, MODEL, SEQ

    from megapatch.testing.scenarios import llama_hf as L

    root = tmp_path_factory.mktemp("bridge-llama")
    hf = root / "hf"
    config = L.build_tiny_hf(hf, **MODEL)
    tokens = L.tokens(BATCH, SEQ, config["vocab_size"])
    torch.save(tokens, root / "tokens.pt")
    return {"hf": str(hf), "tokens": str(root / "tokens.pt"), "vocab": config["vocab_size"],
            "ref32": L.hf_logits(hf, tokens, "fp32")}


def _forward(llama, env, bf16=True, overrides=None):
    from megapatch.testing import run_ranks
    from megapatch.testing.scenarios.bridge_llama import forward_tp1_tp2

    return run_ranks(forward_tp1_tp2, 2, tp=1, args=(llama["hf"], llama["tokens"], llama["vocab"], bf16, overrides),
                     env=env, timeout=900)[0]


@needs_bridge
def test_bridge_imports_without_te_and_megatron_core_sees_none():
    result = run_python("""
        import sys, torch
        from megapatch.testing.stand_ins import bridge_compat
        bridge_compat.import_bridge()
        import megatron.core.extensions.transformer_engine as ext
        from megatron.bridge.peft import lora_layers
        assert not [n for n in sys.modules if n.startswith("transformer_engine")]
        assert ext.HAVE_TE is False
        te = lora_layers.te  # the placeholder the module body saw
        assert te.__megapatch_stand_in__ and not isinstance(torch.nn.Linear(2, 2), te.Linear)
        try:
            te.ops.Sequential()
        except bridge_compat.TEStandInError as e:
            print("refused:", e)
        from megatron.core.utils import get_te_version
        print("te version", get_te_version())
    """, timeout=300, fresh=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: transformer_engine.pytorch.ops.Sequential: Transformer Engine is not installed" in result.stdout
    assert "te version 0.0.0" in result.stdout


@needs_bridge
@pytest.mark.slow
def test_autobridge_fp32_forward_matches_transformers_at_tp1_and_tp2(llama):
    """Bridge's LlamaBridge mapping and weight loading: its FP32 megatron-core forward equals
    transformers' own FP32 forward up to summation order, at TP 1 and 2."""
    from megapatch.testing.scenarios import llama_hf as L

    out = _forward(llama, {}, bf16=False)
    for tp in (1, 2):
        e = L.compare(out[f"tp{tp}"], llama["ref32"])
        assert e["rel_l2"] < 1e-5 and e["argmax_agree"] == 1.0, (tp, e)
    assert out["logits_dtype"] == {1: "torch.float32", 2: "torch.float32"}


@needs_bridge
@pytest.mark.slow
def test_fp32_reductions_and_logits_from_the_environment_shrink_bridge_tp_drift(llama):
    """BF16 at TP 1 and 2 through AutoBridge: with MEGAPATCH_TP_REDUCE_DTYPE=fp32 and
    MEGAPATCH_LOGITS_DTYPE=fp32 in the job's environment only, TP2 agrees with TP1 several times
    better than natively, the logits are FP32, and the ranks' settings came from those variables."""
    from megapatch.testing.scenarios import llama_hf as L

    native = _forward(llama, {})
    fp32 = _forward(llama, {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_LOGITS_DTYPE": "fp32"})
    assert not native["enabled"] and native["logits_dtype"] == {1: "torch.bfloat16", 2: "torch.bfloat16"}
    assert fp32["enabled"] and fp32["logits_dtype"] == {1: "torch.float32", 2: "torch.float32"}
    assert fp32["sources"]["tp_reduce_dtype"] == "env MEGAPATCH_TP_REDUCE_DTYPE"
    assert "tp_reduce.megatron_core" in fp32["active"]
    d_native, d_fp32 = (L.drift(r["tp2"], r["tp1"]) for r in (native, fp32))
    assert d_native["identical"] < 1.0  # the BF16 all-reduce really drifts here
    assert d_fp32["kl"] * 4 < d_native["kl"], (d_native, d_fp32)
    # not more accurate than a TP1 BF16 run: FP32 reductions make TP sizes agree, nothing more
    tp1 = L.compare(native["tp1"], llama["ref32"])["rel_l2"]
    assert L.compare(fp32["tp2"], llama["ref32"])["rel_l2"] > 0.8 * tp1


@needs_bridge
@pytest.mark.slow
def test_tp_invariant_bridge_llama_is_bit_identical_at_tp1_and_tp2(llama):
    out = _forward(llama, {"MEGAPATCH_TP_INVARIANT": "1"}, overrides={"cross_entropy_loss_fusion": False})
    assert out["enabled"] and out["sources"]["tp_invariant"] == "env MEGAPATCH_TP_INVARIANT"
    assert bool((out["tp1"] == out["tp2"]).all())


@needs_bridge
def test_bridge_0_6_has_no_logit_dtype_field_so_megapatch_is_what_gives_fp32_logits():
    """Bridge 0.6.x's GPTModelProvider has no ``logit_dtype`` (it is on Bridge main, guarded by
    megatron-core's GPTModel(logit_dtype=...), which megatron-core 0.19.2 lacks): a
    ``provider.logit_dtype = ...`` there sets a plain attribute that nothing reads. When a Bridge
    release has it, this test fails and docs/stack.md section 6 needs its composition run."""
    result = run_python("""
        import dataclasses, inspect
        from megapatch.testing.stand_ins import bridge_compat
        bridge_compat.import_bridge()
        from megatron.bridge.models.gpt_provider import GPTModelProvider
        from megatron.core.models.gpt.gpt_model import GPTModel
        print("field", "logit_dtype" in {f.name for f in dataclasses.fields(GPTModelProvider)})
        print("mcore", "logit_dtype" in inspect.signature(GPTModel.__init__).parameters)
    """, timeout=300, fresh=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "field False" in result.stdout, result.stdout


@needs_bridge
def test_installing_megapatch_into_the_bridge_venv_would_change_nothing_of_the_users(tmp_path):
    """pip's own resolution of the megapatch wheel in this (Bridge) environment: it installs
    megapatch and nothing else (wrapt and packaging are there); torch, megatron-core, Bridge and
    transformers are untouched. .ci/run's bridge stage also compares `pip freeze` before and after
    the real install."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), REPO],
                           capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        pytest.skip(f"cannot build the megapatch wheel here: {built.stderr[-500:]}")
    wheel = next(tmp_path.glob("megapatch-*.whl"))
    resolved = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--report",
                               str(tmp_path / "deps.json"), f"{wheel}"],
                              capture_output=True, text=True, timeout=600)
    assert resolved.returncode == 0, resolved.stderr[-2000:]
    would = {item["metadata"]["name"].lower() for item in json.loads((tmp_path / "deps.json").read_text())["install"]}
    assert would <= {"megapatch"}, would


@needs_bridge
@pytest.mark.slow
def test_bridge_pretrain_steps_with_tp_invariant_print_tp1s_losses_at_tp2(llama):
    """Bridge's own `pretrain` (recipe base, mock data, the AutoBridge provider) on two CPU ranks
    under `cpu_launch --bridge`, MEGAPATCH_TP_INVARIANT=1 from the environment only: with Bridge's
    default fused cross entropy the mode refuses at construction; without it TP 2 prints TP 1's
    loss and grad norm at every step, and the job log has the activation line."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import bridge_train

    refused = bridge_train.launch(llama["hf"], 2, {"MEGAPATCH_TP_INVARIANT": "1"}, iters=3)
    # Bridge's default fused cross entropy sums the TP partials itself: refused before any step
    assert refused.returncode != 0 and not bridge_train.parse(refused.log), refused.tail()
    assert "does not support cross_entropy_loss_fusion=True" in refused.log, refused.tail()
    runs = {}
    for tp in (1, 2):
        run = bridge_train.launch(llama["hf"], tp, {"MEGAPATCH_TP_INVARIANT": "1"}, iters=3,
                                  extra=bridge_train.NO_CE_FUSION)
        steps = bridge_train.parse(run.log)
        assert run.returncode == 0 and len(steps) == 3, run.tail()
        assert re.search(r"megapatch enabled: .*tp_invariant=True \(env MEGAPATCH_TP_INVARIANT\)", run.log), run.tail()
        runs[tp] = steps
    assert runs[1] == runs[2], runs


@needs_bridge
@pytest.mark.slow
def test_fp32_keeps_every_expert_choice_of_a_bridge_qwen3_moe_at_tp2_and_ep2(tmp_path):
    """A Hugging Face Qwen3-MoE (benchmarks/moe_hf.py's, planted outliers) through AutoBridge, BF16,
    alltoall dispatcher, sequence parallelism, expert TP = TP: natively TP2 drifts from TP1; with
    MEGAPATCH_TP_REDUCE_DTYPE=fp32 from the environment only, TP2 and EP2 route every token of every
    layer to the experts TP1 chose and KL(TP1 || TP2) falls at least 20x."""
    import torch

    from megapatch.testing import run_ranks
    from megapatch.testing.scenarios import bridge_moe as B
    from megapatch.testing.scenarios import llama_hf as L

    config = B.build_tiny_hf_moe(tmp_path / "hf", "qwen3_moe")
    torch.save(L.tokens(2, 64, config["vocab_size"]), tmp_path / "tokens.pt")
    layouts = [(1, 1), (2, 1), (1, 2)]  # (TP, EP) on two ranks
    native, fp32 = (run_ranks(B.forward_layouts, 2, tp=1, env=env, timeout=600,
                              args=(str(tmp_path / "hf"), str(tmp_path / "tokens.pt"), config["vocab_size"], layouts))[0]
                    for env in ({}, {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}))
    assert not native["enabled"] and fp32["sources"]["tp_reduce_dtype"] == "env MEGAPATCH_TP_REDUCE_DTYPE"
    assert "tp_reduce.moe" in fp32["active"], fp32["active"]
    assert set(fp32["logits_dtype"].values()) == {"torch.bfloat16"}
    for layout in layouts[1:]:
        assert B.routing_disagreement(fp32["routing"][layout], fp32["routing"][(1, 1)]) == 0, layout
    d_native, d_fp32 = (L.drift(run["logits"][(2, 1)], run["logits"][(1, 1)]) for run in (native, fp32))
    assert d_native["kl"] > 0, d_native  # the BF16 sums really drift here (else the test could not fail)
    assert d_fp32["kl"] * 20 <= d_native["kl"], (d_native, d_fp32)
