"""A tiny Hugging Face Llama through Megatron-LM's own converter and loader, on CPU ranks, in every
megapatch mode, judged against transformers' own forward of the same weights (the independent
oracle). Needs the ``llama`` extra (``pip install '.[llama]'``) and the pinned Megatron-LM sources.

Tolerances come from measurement (``results/llama_hf.md`` has the benchmark's figures):

* FP32 conversion check: Megatron FP32 vs transformers FP32 is summation-order noise, 6.6e-7 ..
  7.5e-7 relative L2 in the benchmark (Llama and Qwen2.5, TP 1/2), 3.9e-7 .. 4.4e-7 in the research
  pass on this test's model shape; the bound is 1e-5 (>10x margin). A checkpoint whose gate/up
  halves are swapped must miss it by three orders of magnitude (asserted > 1e-2).
* BF16 error vs transformers FP32 on this model: 1.3e-2 .. 1.5e-2 for every mode at TP 1/2,
  transformers' own BF16 1.5e-2 (asserted: inside (1e-3, 5e-2) and below twice transformers').
* Drift TP1 -> TP2, KL(TP1||TP2) on this model: native 1.7e-5, fp32 0 (bit-identical logits); the
  benchmark's larger model: native 2.5e-5, fp32 2.6e-6. Asserted: fp32 (and fp32 + FP32 logits) at
  most native / 4.
"""

from __future__ import annotations

import shutil

import pytest

from conftest import pinned_megatron_lm
from megapatch.testing.scenarios import llama_hf as L

SEQ, BATCH = 64, 2
SMALL = dict(hidden=128, heads=4, kv_heads=2, ffn=384, layers=2, vocab=1024)
FP32_TOL = 1e-5
DRIFT_FACTOR = 4.0
BF16_BAND = (1e-3, 5e-2)  # BF16 runs: clearly not FP32, clearly not broken


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    missing = L.missing_dependencies()
    if missing:
        pytest.skip(f"the Llama path needs {', '.join(missing)}: pip install '.[{L.EXTRA_NAME}]'")
    return pinned_megatron_lm(tmp_path_factory)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("llama-hf")


@pytest.fixture(scope="module")
def model(checkout, work):
    import torch

    hf = work / "hf"
    config = L.build_tiny_hf(hf, **SMALL)
    tokens = L.tokens(BATCH, SEQ, config["vocab_size"])
    torch.save(tokens, work / "tokens.pt")
    return {"hf": hf, "config": config, "tokens": tokens, "tokens_path": work / "tokens.pt",
            "fp32": L.hf_logits(hf, tokens, "fp32"), "bf16": L.hf_logits(hf, tokens, "bf16")}


def _convert(checkout, hf, out, tp, model_size="llama3"):
    run = L.convert(checkout, hf, out, tp, model_size)
    assert run.returncode == 0, run.tail()
    assert len(L.checkpoint_shards(out)) == tp, run.tail()
    return out


@pytest.fixture(scope="module")
def converted(checkout, model, work):
    return {tp: _convert(checkout, model["hf"], work / f"ckpt_tp{tp}", tp) for tp in (1, 2)}


def _forward(checkout, model, ckpt, tp, out, *, bf16=True, modes=tuple(L.MODES), config=None,
             **flag_options):
    config = config or model["config"]
    flags = L.megatron_flags(config, ckpt, tp, SEQ, bf16=bf16, tokenizer_dir=model["hf"], **flag_options)
    run = L.forward(checkout, flags, tp=tp, tokens_path=model["tokens_path"], out_path=out,
                    modes=modes, vocab=config["vocab_size"], timeout=300)
    return run


def _results(run, out):
    import torch

    assert run.returncode == 0, run.tail()
    return torch.load(out)


@pytest.fixture(scope="module")
def bf16_runs(checkout, model, converted, work):
    return {tp: _results(_forward(checkout, model, converted[tp], tp, work / f"bf16_tp{tp}.pt"),
                         work / f"bf16_tp{tp}.pt") for tp in (1, 2)}


# --- the conversion is right (and the check can fail) --------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_fp32_forward_of_the_conversion_matches_transformers(checkout, model, converted, work, tp):
    out = work / f"fp32_tp{tp}.pt"
    logits = _results(_forward(checkout, model, converted[tp], tp, out, bf16=False, modes=("native",)),
                      out)["native"]
    assert logits["logits_dtype"] == "torch.float32"
    error = L.compare(logits["logits"], model["fp32"])
    assert error["rel_l2"] < FP32_TOL, error
    assert error["argmax_agree"] == 1.0, error


def test_a_checkpoint_with_swapped_gate_and_up_fails_that_comparison(checkout, model, converted, work):
    broken = work / "ckpt_tp1_swapped"
    shutil.copytree(converted[1], broken)
    assert L.swap_gate_up(broken) == SMALL["layers"]
    out = work / "fp32_swapped.pt"
    logits = _results(_forward(checkout, model, broken, 1, out, bf16=False, modes=("native",)), out)
    error = L.compare(logits["native"]["logits"], model["fp32"])
    assert error["rel_l2"] > 1e-2 > FP32_TOL, error


def test_qwen25_shaped_model_converts_with_qkv_bias_at_tp2(checkout, model, work):
    import torch

    hf = work / "hf_qwen2"
    config = L.build_tiny_hf(hf, arch="qwen2", rms_norm_eps=1e-6, rope_theta=1e6, **SMALL)
    ckpt = _convert(checkout, hf, work / "ckpt_qwen2_tp2", 2, model_size="qwen2.5")
    state = torch.load(L.checkpoint_shards(ckpt)[0], map_location="cpu", weights_only=False)["model"]
    assert any(k.endswith("linear_qkv.bias") for k in state)
    qwen = dict(model, hf=hf, config=config)
    out = work / "qwen2_fp32_tp2.pt"
    logits = _results(_forward(checkout, qwen, ckpt, 2, out, bf16=False, modes=("native",)), out)
    error = L.compare(logits["native"]["logits"], L.hf_logits(hf, model["tokens"]))
    assert error["rel_l2"] < FP32_TOL, error


# --- every mode at TP 1 and 2 -------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_every_mode_runs_and_has_bf16_error_against_transformers_fp32(model, bf16_runs, tp):
    hf_bf16 = L.compare(model["bf16"], model["fp32"])["rel_l2"]
    for mode, result in bf16_runs[tp].items():
        if mode == "tp-invariant":
            continue
        error = L.compare(result["logits"], model["fp32"])
        assert BF16_BAND[0] < error["rel_l2"] < BF16_BAND[1], (mode, error)
        assert error["rel_l2"] < 2 * hf_bf16, (mode, error, hf_bf16)


def test_fp32_reductions_shrink_the_drift_between_tp1_and_tp2(bf16_runs):
    drift = {mode: L.drift(bf16_runs[2][mode]["logits"], bf16_runs[1][mode]["logits"])
             for mode in L.MODES if mode != "tp-invariant"}
    assert drift["native"]["kl"] > 0 and drift["native"]["identical"] < 1, drift
    for mode in ("fp32", "fp32+logits-fp32"):
        assert drift[mode]["kl"] <= drift["native"]["kl"] / DRIFT_FACTOR, drift
        assert drift[mode]["max_abs"] < drift["native"]["max_abs"], drift


def test_fp32_accumulate_equals_native_at_tp2(bf16_runs):
    import torch

    # a two-rank sum rounds once either way
    assert torch.equal(bf16_runs[2]["fp32-accumulate"]["logits"], bf16_runs[2]["native"]["logits"])


@pytest.mark.parametrize("tp", [1, 2])
def test_fp32_logits_mode_really_produces_float32_logits(bf16_runs, tp):
    runs = bf16_runs[tp]
    assert runs["native"]["logits_dtype"] == "torch.bfloat16"
    assert runs["fp32"]["logits_dtype"] == "torch.bfloat16"
    assert runs["logits-fp32"]["logits_dtype"] == "torch.float32"
    assert runs["fp32+logits-fp32"]["logits_dtype"] == "torch.float32"


def test_tp_invariant_refuses_swiglu_or_keeps_its_guarantee(bf16_runs):
    import torch

    one, two = bf16_runs[1]["tp-invariant"], bf16_runs[2]["tp-invariant"]
    if "refused" in one or "refused" in two:  # megapatch today: SwiGLU is not verified yet
        for result in (one, two):
            assert "gated_linear_unit" in result.get("refused", ""), result
    else:  # once it accepts SwiGLU: TP2 logits equal TP1's bit for bit
        assert torch.equal(one["logits"], two["logits"])


# --- bad input: upstream's own error reaches the user, and the run fails -------------------------


def test_tp_not_dividing_the_heads_fails_with_upstreams_error(checkout, model, work):
    run = L.convert(checkout, model["hf"], work / "ckpt_tp8_bad", 8, timeout=180)
    assert not run.timed_out
    # the saver process dies; convert.py alone would exit 0, the launcher exits 1
    assert run.returncode == 1, run.tail()
    assert "ValueError: num_attention_heads (4) must be a multiple of tensor_model_parallel_size (8)" in run.log
    assert "convert_launch: convert.py returned, but a process it started failed" in run.log
    assert not L.checkpoint_shards(work / "ckpt_tp8_bad")


def test_missing_tokenizer_fails_with_upstreams_error(checkout, model, work):
    bare = work / "hf_no_tokenizer"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model["hf"] / name, bare / name)
    run = L.convert(checkout, bare, work / "ckpt_no_tokenizer", 1, timeout=180)
    assert not run.timed_out
    assert run.returncode != 0, run.tail()
    assert "loader_llama_mistral.py" in run.log and "Traceback" in run.log, run.tail()
    assert not L.checkpoint_shards(work / "ckpt_no_tokenizer")


def test_wrong_num_query_groups_at_load_fails_with_upstreams_error(checkout, model, converted, work):
    run = _forward(checkout, model, converted[1], 1, work / "wrong_groups.pt", modes=("native",),
                   num_query_groups=1)
    assert run.returncode != 0
    assert "size mismatch for decoder.layers.0.self_attention.linear_qkv.weight" in run.log, run.tail()
    assert not (work / "wrong_groups.pt").exists()
