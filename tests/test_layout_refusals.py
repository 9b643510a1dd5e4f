"""Issue 37 item 8: the layout axis ``tp_invariant`` does not cover -- context parallelism -- is
refused when the model is built and by ``megapatch doctor``, both naming the flag; every other axis
(TP, DP at any size, PP) is covered, so a job at CP 1 is refused by neither, and no start-up line
about the data-parallel size remains (tests/test_tp_invariant.py checks the silence on ranks).

The run's side is the mode's construction check on a real megatron-core ``TransformerConfig``;
the doctor's side reads Megatron-LM flags. Expected words are written out here."""

from __future__ import annotations

import copy

import pytest

from tests.test_doctor import _flags_survey
from tests.test_moe_preflight import _run_refusal as construction_refusal

FLAGS = ["--tensor-model-parallel-size", "2", "--num-attention-heads", "4", "--hidden-size", "64",
         "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion",
         "--seq-length", "32"]


def _run_refusal(**fields):
    """The construction check on the tiny GPT's real config at TP 2 with ``fields`` set on a copy."""
    from megapatch.testing.models.tiny_gpt import tiny_gpt_config

    config = copy.copy(tiny_gpt_config(tp=2))
    for name, value in fields.items():
        setattr(config, name, value)
    return construction_refusal(config)


@pytest.mark.parametrize("size", [2, 3])
def test_context_parallelism_is_refused_by_the_doctor_and_the_run_naming_the_flag(monkeypatch, size):
    doctor = _flags_survey(monkeypatch, FLAGS + ["--context-parallel-size", str(size)], MEGAPATCH_TP_INVARIANT="1")
    refusal = doctor["flags"]["refusals"].get("tp_invariant.construction")
    assert refusal and "--context-parallel-size" in refusal and f"context_parallel_size={size}" in refusal, doctor
    run = _run_refusal(context_parallel_size=size)
    assert run and "--context-parallel-size" in run and f"context_parallel_size={size}" in run, run
    assert "tp_invariant was set by" in run, run


def test_a_job_at_context_parallel_size_1_is_refused_by_neither(monkeypatch):
    for flags in (FLAGS, FLAGS + ["--context-parallel-size", "1"]):
        doctor = _flags_survey(monkeypatch, flags, MEGAPATCH_TP_INVARIANT="1")
        assert "tp_invariant.construction" not in doctor["flags"]["refusals"], doctor
    assert _run_refusal(context_parallel_size=1) is None
    assert _run_refusal() is None


def test_without_the_mode_the_doctor_refuses_no_context_parallel_job(monkeypatch):
    doctor = _flags_survey(monkeypatch, FLAGS + ["--context-parallel-size", "2"])
    assert not doctor["flags"]["refusals"], doctor


def test_upstreams_batch_invariant_mode_with_tp_invariant_is_refused_at_construction_naming_the_field():
    """Issue 39 item 7: megatron-core's ``batch_invariant_mode`` and the mode replace the same GEMMs,
    attention and norms with different arithmetic; both on is refused when the model is built,
    naming the config field and Megatron-LM main's flag. Off, nothing is said."""
    run = _run_refusal(batch_invariant_mode=True)
    assert run and "batch_invariant_mode=True" in run and "--batch-invariant-mode" in run, run
    assert "tp_invariant was set by" in run, run
    assert _run_refusal(batch_invariant_mode=False) is None
