"""Megatron-LM's own ``pretrain_gpt.py`` with ``--transformer-impl transformer_engine`` (its default)
natively and under ``tp_invariant``, on CPU ranks (issue 39 item 4).

TE 2.20.2 is installed; its kernels run on CPU through the labelled stand-in
``megapatch.testing.stand_ins.te_runtime`` (the CPU launcher's ``--te``). A Qwen3-shaped model
(SwiGLU, RMSNorm, RoPE, GQA, QK RMSNorm) built from TE layers -- ``TELayerNormColumnParallelLinear``,
``TERowParallelLinear``, ``TEDotProductAttention``, TE's FusedAdam -- trains at TP 2, saving at
iteration 1; resumed from that checkpoint at TP 1 and at TP 4 with sequence parallelism, the next two
steps leave every saved tensor (parameters, FP32 main parameters, Adam moments; TE's parameter names)
and the full-precision grad norms as the uninterrupted TP 2 run's. A Qwen3-MoE checkpoint with TE's
grouped-GEMM experts trained natively at TP 2 (TE's kernels through the runtime, TE's attention on its
unfused backend) resumes under the mode with no conversion at TP 1 and at TP 4, bit-identically.

Not here: every mode at every TP and EP size through this script (benchmarks/te_moe_megatron_lm.py,
results/te_moe_megatron_lm.md; the model-level tests are tests/test_tp_invariant_transformer_engine.py
and tests/test_te_runtime.py), a GPU.
"""

import re

import pytest

from conftest import pinned_megatron_lm

pytestmark = pytest.mark.te

QWEN3_TE = ("--qk-layernorm", "--transformer-impl", "transformer_engine")  # the last --transformer-impl counts


def _qwen3_moe_grouped():
    """The RL example's Qwen3-MoE shape scaled down (``layouts.MOE``: 8 SwiGLU experts top-2, alltoall,
    aux and z losses) with TE's grouped-GEMM experts; upstream needs sequence parallelism for MoE at TP > 1."""
    from megapatch.testing.scenarios import layouts

    return (*layouts.MOE, *QWEN3_TE, "--sequence-parallel", "--moe-grouped-gemm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from pathlib import Path

    from megapatch.testing.scenarios import layouts

    checkout = pinned_megatron_lm(tmp_path_factory)
    L = layouts.Layout
    probe = str(Path(__file__).resolve().parent / "scripts" / "megatron_lm_probe.py")
    work = tmp_path_factory.mktemp("te-layouts")
    resumed = layouts.experiment(checkout, work, {"MEGAPATCH_TP_INVARIANT": "1"}, [L(tp=1)], probe=probe,
                                 base=L(tp=2), save_at=1, iters=3, global_batch=4, extra=QWEN3_TE,
                                 label="te", launcher=("--te",), timeout=900)
    start = resumed["full"].checkpoint.parent
    resumed.update(layouts.experiment(checkout, work, {"MEGAPATCH_TP_INVARIANT": "1"}, [L(tp=4)], probe=probe,
                                      save_at=1, iters=3, global_batch=4, start=start, label="te-sp",
                                      extra=(*QWEN3_TE, "--sequence-parallel"), launcher=("--te",), timeout=900))
    # a Qwen3-MoE checkpoint with grouped-GEMM experts trained natively (TE's own kernels through the
    # runtime, its grouped GEMM included; TE's attention on its unfused backend), resumed under the mode at
    # TP 1 and at TP 4 (no conversion: TE's parameter names)
    native = layouts.experiment(checkout, work, {}, [], probe=probe, base=L(tp=2), save_at=1, iters=3,
                                global_batch=4, extra=_qwen3_moe_grouped(), label="te-native", launcher=("--te",),
                                timeout=900)
    resumed["native"] = native["full"]
    from_native = layouts.experiment(checkout, work, {"MEGAPATCH_TP_INVARIANT": "1"}, [L(tp=1), L(tp=4)],
                                     probe=probe, save_at=1, iters=3, global_batch=4,
                                     start=native["full"].checkpoint.parent, label="te-from-native",
                                     extra=_qwen3_moe_grouped(), launcher=("--te",), timeout=900)
    resumed.update({f"from-native-{k}": v for k, v in from_native.items()})
    resumed["probes"] = work / "probes"
    return resumed


def _probe_records(runs, name):
    import json

    return [json.loads(line) for line in (runs["probes"] / name / "rank0.jsonl").read_text().splitlines()]


def _per_token_losses(runs, name):
    """The digests of each micro-batch's per-token losses, as the probe recorded them on rank 0."""
    return [record["loss"] for record in _probe_records(runs, name)]


def _printed_by_upstreams_rule(iteration_losses):
    """What Megatron-LM's ``training_log`` prints for a job's iterations: the mean loss since the last
    print, except that a job's first print does not reset the sums ("so normal interval stats remain
    accurate", core_v0.16.1): a job's second printed loss averages its first two iterations."""
    printed, since = [], []
    for i, loss in enumerate(iteration_losses):
        since.append(loss)
        printed.append(sum(since) / len(since))
        if i > 0:
            since = []
    return printed


def test_the_job_builds_transformer_engine_layers_and_runs_their_kernels_on_the_cpu_runtime(runs):
    log = runs["full"].run.log
    assert "te_runtime); Transformer Engine's kernels are torch stand-ins, not TE's CUDA numerics" in log
    names = list(runs["full"].tensors())
    assert any(name.endswith("linear_qkv.layer_norm_weight") for name in names), names[:10]
    assert any(name.endswith("linear_fc1.layer_norm_weight") for name in names), names[:10]
    assert "tp_invariant.transformer_engine" in log  # the activation line lists the patch


@pytest.mark.parametrize("label, probe", [("tp1-dp1-pp1-mbs1", "te-tp1-dp1-pp1-mbs1"),
                                          ("tp4-dp1-pp1-mbs1", "te-sp-tp4-dp1-pp1-mbs1")])
def test_a_tp_change_on_resume_leaves_every_tensor_and_norm_as_never_stopping(runs, label, probe):
    from megapatch.testing.scenarios import tp_resume

    full, resumed = runs["full"], runs[label]
    assert resumed.exact_norms == full.exact_norms[1:], (resumed.exact_norms, full.exact_norms)
    # iterations 2-3, four micro-batches each
    assert sorted(resumed.losses) == [2, 3]
    assert _per_token_losses(runs, probe) == _per_token_losses(runs, "te-full-tp2-dp1-pp1-mbs1")[4:]
    # The printed "lm loss" of iteration 2 differs between the two jobs (the uninterrupted job's averages
    # iterations 1 and 2 by upstream's first-print rule); from the per-token losses, both jobs print
    # what that rule gives.
    records = _probe_records(runs, "te-full-tp2-dp1-pp1-mbs1")
    means = [sum(float.fromhex(v) for r in records[i:i + 4] for v in r["values"])
             / sum(len(r["values"]) for r in records[i:i + 4]) for i in range(0, 12, 4)]
    for job, expected in ((full, _printed_by_upstreams_rule(means)), (resumed, _printed_by_upstreams_rule(means[1:]))):
        printed = [float(job.losses[i]) for i in sorted(job.losses)]
        assert printed == pytest.approx(expected, rel=2e-6), (printed, expected)
    assert tp_resume.differences(full.tensors(), resumed.tensors()) == {}


def test_a_native_te_checkpoint_resumes_under_the_mode_at_tp1_and_tp4_bit_identically(runs):
    """The Qwen3-MoE shape with TE's grouped-GEMM experts (``--moe-grouped-gemm``: ``TEGroupedMLP``),
    trained natively at TP 2 (TE's GEMMs, grouped GEMMs, norms and unfused attention through the
    runtime; megapatch off) and saved; resumed under the mode with no conversion at TP 1 and at TP 4, the next two steps
    give the same per-token losses, grad norms and saved tensors (parameters, FP32 main parameters,
    Adam moments) at both sizes."""
    from megapatch.testing.scenarios import tp_resume

    native = runs["native"]
    assert "te_runtime); Transformer Engine's kernels are torch stand-ins, not TE's CUDA numerics" in native.run.log
    assert "megapatch enabled" not in native.run.log
    tp1, tp4 = runs["from-native-tp1-dp1-pp1-mbs1"], runs["from-native-tp4-dp1-pp1-mbs1"]
    assert "tp_invariant.transformer_engine" in tp1.run.log and "tp_invariant.transformer_engine" in tp4.run.log
    assert sorted(tp1.losses) == sorted(tp4.losses) == [2, 3]
    assert tp1.exact_norms == tp4.exact_norms and len(tp1.exact_norms) == 2
    assert (_per_token_losses(runs, "te-from-native-tp1-dp1-pp1-mbs1")
            == _per_token_losses(runs, "te-from-native-tp4-dp1-pp1-mbs1"))
    assert tp_resume.differences(tp1.tensors(), tp4.tensors()) == {}
    # the resumed jobs start from the native weights: iteration 1's parameters are TE-trained ones
    assert set(tp1.tensors()) == set(native.tensors())
    # grouped-GEMM experts: Megatron-LM's spec builds TEGroupedMLP for --moe-grouped-gemm with TE layers
    assert re.search(r"moe_grouped_gemm \.+ True", native.run.log) and "experts" in " ".join(native.tensors())
