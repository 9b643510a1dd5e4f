"""Megatron-LM's own ``train_rl.py`` (GRPO: rollouts on the dynamic engine, refit, train), unmodified,
on CPU ranks under ``torchrun -m megapatch.testing.ranks.rl_launch``, megapatch switched on by
``MEGAPATCH_*`` only. The mismatch figures are upstream's own (``update_inference_logprobs_group_stats``,
recorded from what ``train_rl.py`` hands its loggers: ``megapatch.testing.stand_ins.rl_compat``).

The trainer runs at TP 2 and the rollouts at TP 1 (``--rl-inference-tensor-model-parallel-size``),
with a refit of the trained weights before every step's rollouts; hidden 512, FFN 2048 (the
experts' too)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import pinned_megatron_lm
from megapatch.testing.ranks import megatron_lm_runs as mlm

ZERO_MODE = {"MEGAPATCH_TP_INVARIANT": "1", "MEGAPATCH_LOGITS_DTYPE": "fp32"}
# megapatch on with native settings: upstream's numerics, and rl_report.mismatch's line
NATIVE = {"MEGAPATCH_LOGITS_DTYPE": "native"}
# widths at which a GEMM's inner size is 64-256 a block of the mode's fixed tree (W 8), not toy sizes
WIDTHS = dict(hidden=512, ffn=2048, moe_ffn=2048)
_runs = {}


# main (d98e8a6) runs in CI's Python 3.12 stage; its megatron/rl imports more (the `rl-main` extra)
NEEDS = {"core_v0.16.1": ("wandb", "tensorboard", "zmq", "msgpack", "tokenizers", "transformers"),
         "main-d98e8a64": ("wandb", "tensorboard", "zmq", "msgpack", "tokenizers", "transformers", "openai", "fastapi",
                  "quart", "hypercorn", "datasets")}


@pytest.fixture(scope="module", params=sorted(NEEDS))
def rl_checkout(request, tmp_path_factory):
    import importlib.util

    revision = request.param
    too_old = mlm.python_too_old(revision)
    if too_old:
        pytest.skip(too_old)
    missing = [m for m in NEEDS[revision] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Megatron-LM {revision}'s train_rl.py needs {', '.join(missing)} "
                    f"(the `{'rl-main' if revision.startswith('main') else 'rl'}` and `llama` extras)")
    return revision, pinned_megatron_lm(tmp_path_factory, revision), tmp_path_factory.mktemp(f"train-rl-{revision}")


def _run(rl_checkout, name, megapatch_env, iters=3, **flags):
    from megapatch.testing.scenarios import train_rl

    revision, checkout, root = rl_checkout
    if (revision, name) not in _runs:
        _runs[revision, name] = train_rl.run(checkout, root, nproc=2, tp=2, rollout_tp=1, iters=iters, timeout=600,
                                             megapatch_env=megapatch_env, name=name, revision=revision,
                                             **WIDTHS, **flags)
    return _runs[revision, name]


def _grad_norms(job):
    return [float(v) for v in re.findall(r"grad norm: ([0-9.]+)", job.log)]


def _mismatch(step):
    return (step["max_inf_train_prob_abs_diff"], step["min_piold_to_inf_prob"], step["max_piold_to_inf_prob"])


def _mismatch_lines(job, steps):
    """rl_report.mismatch's job-log lines (rank 0), one per step, each checked against upstream's own
    figures for that step (the recorder's); ``(max |p_train - p_inf|, min, max p_old/p_inf,
    bit-identical, compared)`` per line."""
    from test_rl_report import LINE

    found = [LINE.search(line) for line in job.log.splitlines() if "megapatch rl_report.mismatch:" in line]
    assert found and all(found), job.tail()
    assert len(found) == len(steps), (len(found), steps)
    out = []
    for m, step in zip(found, steps):
        assert int(m["iteration"]) == step["iteration"] + 1  # Megatron-LM's "iteration N/M" of that step
        for group, field in (("max_diff", "max_inf_train_prob_abs_diff"), ("mean_diff", "mean_inf_train_prob_abs_diff"),
                             ("min_ratio", "min_piold_to_inf_prob"), ("max_ratio", "max_piold_to_inf_prob")):
            assert float(m[group]) == step[field], (m.group(0), step)
        out.append((float(m["max_diff"]), float(m["min_ratio"]), float(m["max_ratio"]), int(m["identical"]),
                    int(m["compared"])))
    return out


@pytest.mark.slow
@pytest.mark.quick("tp_invariant.rl_logprobs", "logits.fp32_rl_logprobs", "rl_report.mismatch")
def test_train_rl_logs_zero_train_vs_rollout_mismatch_at_trainer_tp2_rollout_tp1_under_tp_invariant(rl_checkout):
    """tp_invariant + FP32 logits: every step's logged mismatch is exactly 0 (max |p_train - p_inf|
    0, the ratio's min and max 1) with the trainer at TP 2 and the rollouts at TP 1, over 3 GRPO
    steps that train (non-zero grad norms: the refits carry changed weights). Natively the same job
    logs a mismatch at its first step (one step: the precondition). Both jobs' logs say it on rank 0,
    one rl_report.mismatch line a step with upstream's figures for that step: every log-prob
    bit-identical under the mode, not all of them natively (megapatch enabled with native settings,
    MEGAPATCH_LOGITS_DTYPE=native: the report and nothing else)."""
    job, steps = _run(rl_checkout, "dense-zero", ZERO_MODE)
    assert job.returncode == 0, job.tail()
    assert job.log.count("megapatch enabled:") == 1, "the activation line, once per job"
    assert len(steps) == 3, steps
    assert [_mismatch(s) for s in steps] == [(0.0, 1.0, 1.0)] * 3, steps
    assert all(s["mean_inf_prob"] > 0 for s in steps)  # the statistics were taken
    lines = _mismatch_lines(job, steps)
    assert all(line[:3] == (0.0, 1.0, 1.0) and line[3] == line[4] > 0 for line in lines), lines
    norms = _grad_norms(job)
    assert len(norms) == 3 and all(n > 0 for n in norms), norms

    native, native_steps = _run(rl_checkout, "dense-native", NATIVE, iters=1)  # one step shows it
    assert native.returncode == 0, native.tail()
    assert "logits_dtype=native" in native.log and "tp_invariant=False" in native.log  # enabled, native
    assert len(native_steps) == 1 and native_steps[0]["max_inf_train_prob_abs_diff"] > 0, native_steps
    [(max_diff, low, high, identical, compared)] = _mismatch_lines(native, native_steps)
    assert max_diff > 0 and (low, high) != (1.0, 1.0) and identical < compared, (max_diff, low, high, identical)


@pytest.mark.slow
@pytest.mark.resumes
def test_train_rl_with_experts_logs_zero_mismatch_at_trainer_tp2_rollout_tp1_under_tp_invariant(rl_checkout):
    """The same for a Qwen3-MoE-shaped model (4 experts top-2, alltoall dispatcher, expert TP = TP):
    exactly 0 under tp_invariant + FP32 logits, a mismatch natively at the first step. CI's `resumes`
    stage (the README's test command runs train_rl.py with the dense model above)."""
    moe = dict(moe=True, ep=1, rollout_ep=1)
    job, steps = _run(rl_checkout, "moe-zero", ZERO_MODE, **moe)
    assert job.returncode == 0, job.tail()
    assert "tp_invariant.moe" in job.log and job.log.count("megapatch enabled:") == 1
    assert [_mismatch(s) for s in steps] == [(0.0, 1.0, 1.0)] * 3, steps
    norms = _grad_norms(job)
    assert len(norms) == 3 and all(n > 0 for n in norms), norms
    native, native_steps = _run(rl_checkout, "moe-native", {}, iters=1, **moe)  # one step shows it
    assert native.returncode == 0, native.tail()
    assert len(native_steps) == 1 and native_steps[0]["max_inf_train_prob_abs_diff"] > 0, native_steps


PACKED_BINS = re.compile(r"Packing distribution: (\d+) bins, avg [0-9.]+ seqs/bin, min \d+, max (\d+) seqs/bin")


@pytest.mark.slow
@pytest.mark.resumes
def test_train_rl_with_sequence_packing_logs_zero_mismatch_when_bins_hold_several_sequences(rl_checkout):
    """``--rl-use-sequence-packing`` with bins of 128 tokens (issue 49): the second step packs two
    sequences into a bin, and its logged mismatch is still exactly 0 under the mode (it was 3.55e-5
    before ``tp_invariant.packed_rope``: upstream rotated a bin's second sequence from its offset in the
    bin, the rollout from 0). Natively the job stops in upstream's local attention, which takes no
    packed sequences (``tools/train_rl_packing.py --mode native``). Micro-batch 1: upstream's rule with packing."""
    length = "128"
    job, steps = _run(rl_checkout, "packed-zero", ZERO_MODE, iters=2, micro_batch=1,
                      extra=("--rl-use-sequence-packing", "--seq-length", length, "--max-position-embeddings",
                             length, "--inference-max-seq-length", length))
    assert job.returncode == 0, job.tail()
    bins = [(int(n), int(most)) for n, most in PACKED_BINS.findall(job.log)]
    assert len(bins) == 2 and max(most for _, most in bins) >= 2, bins  # some bin held two sequences
    assert [_mismatch(s) for s in steps] == [(0.0, 1.0, 1.0)] * 2, steps
    norms = _grad_norms(job)
    assert len(norms) == 2 and all(n > 0 for n in norms), norms
    # the doctor, run as a user runs it beside the job (from the checkout's root, with the job's flags and
    # variables: Megatron-LM main's stage has megatron only there), says the line the job logged once (rank 0)
    from megapatch.testing.ranks.megatron_lm_runs import launch_env

    flags = job.command[job.command.index("train_rl.py") + 1:]
    doctor = subprocess.run([sys.executable, "-m", "megapatch", "doctor", "--json", "--", *flags], capture_output=True,
                            text=True, timeout=300, env=launch_env(ZERO_MODE), cwd=str(rl_checkout[1]))
    # (upstream's modules the doctor imports print a line of their own first: "LANG_RL Log directory: ...")
    report = json.loads(doctor.stdout[doctor.stdout.index("{\n"):])["flags"]
    assert report["refusals"] == {} and list(report["notes"]) == ["tp_invariant.attention"], (report, doctor.stderr[-2000:])
    assert job.log.count(report["notes"]["tp_invariant.attention"]) == 1, job.tail()


@pytest.mark.slow
@pytest.mark.resumes
def test_train_rl_with_expert_parallelism_logs_zero_on_every_rank_at_trainer_tp2_ep2_rollout_tp1_ep1(rl_checkout):
    """The issue's MoE layout, trainer TP 2 EP 2 / rollout TP 1 EP 1 (4 ranks, hidden 64, groups of 8 so
    that the rollout's engines sample different group members and the steps train): upstream's refit
    stops natively ("not found": it names SequentialMLP experts by their local index); under
    tp_invariant + FP32 logits (tp_invariant.rl_refit, .attention, .engine_attention) every rank logs
    exactly 0 at every step. Core_v0.16.1 only: main's engine needs CUDA symmetric memory at EP > 1."""
    from megapatch.testing.scenarios import train_rl

    revision, checkout, root = rl_checkout
    if revision != "core_v0.16.1":
        pytest.skip("Megatron-LM main's dynamic engine allocates CUDA symmetric memory at EP > 1")
    layout = dict(nproc=4, tp=2, rollout_tp=1, moe=True, ep=2, rollout_ep=1, group=8, revision=revision,
                  timeout=600)
    native, _ = train_rl.run(checkout, root, megapatch_env={}, name="ep-native", iters=1, **layout)
    assert native.returncode != 0 and "not found in source model" in native.log, native.tail()
    job, _ = train_rl.run(checkout, root, megapatch_env=ZERO_MODE, name="ep-zero", iters=3, **layout)
    assert job.returncode == 0, job.tail()
    for rank in range(4):
        steps = train_rl.rank_stats(job, rank)
        assert [_mismatch(s) for s in steps] == [(0.0, 1.0, 1.0)] * 3, (rank, steps)
    norms = _grad_norms(job)
    assert len(norms) == 3 and all(n > 0 for n in norms), norms


def _refit_sources(monkeypatch, tp_invariant: bool):
    """For each rollout rank's expert parameters, the global expert index of the trainer parameter
    upstream's refit planner takes as the source -- its own name matching (``assign_resolved_name_inplace``)
    and source choice (``select_src_metadata_balanced``), on the metadata of a trainer at TP 2 EP 2
    (4 ranks: TP groups {0,1} {2,3}, EP and DP groups {0,2} {1,3}) and a rollout at TP 1 EP 2 (EP groups
    {0,1} {2,3}, DP groups {0,2} {1,3}), 4 experts, two a rank; ``(wanted, taken)`` pairs."""
    from megatron.core.resharding import utils

    from megapatch.core import options, state
    from megapatch.patches.tp_invariant import rl_refit as patch

    monkeypatch.setattr(state, "_current", options.Settings(tp_invariant=tp_invariant))
    upstream = utils.assign_ep_resolved_name_inplace
    monkeypatch.setattr(utils, "assign_ep_resolved_name_inplace", lambda meta, base_name=None: (
        patch._assign_ep_resolved_name(upstream, None, (meta,), {"base_name": base_name})))

    def meta(rank, local, tp_ranks, ep_ranks, dp_ranks):
        m = utils.ParameterMetadata(
            name=f"decoder.layers.0.mlp.experts.local_experts.{local}.linear_fc1.weight", shape=(64, 32),
            dtype=torch.bfloat16, element_size=2, is_tp=True, is_ep=True, num_experts=4, owner_rank=rank,
            tensor_parallel_group_ranks=tp_ranks, expert_parallel_group_ranks=ep_ranks,
            data_parallel_group_ranks=dp_ranks)
        utils.assign_resolved_name_inplace(m)
        return m, ep_ranks.index(rank) * 2 + local  # the global expert it holds

    sources = {}
    for rank in range(4):
        for local in range(2):
            m, expert = meta(rank, local, [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2],
                             [rank % 2, rank % 2 + 2])
            sources.setdefault(m.resolved_name, []).append((m, expert))
    pairs = []
    for rank in range(4):
        for local in range(2):
            dst, wanted = meta(rank, local, [rank], [rank // 2 * 2, rank // 2 * 2 + 1], [0, 1, 2, 3])
            candidates = sources[dst.resolved_name]
            chosen = utils.select_src_metadata_balanced([m for m, _ in candidates], dst, rank)
            pairs.append((wanted, next(e for m, e in candidates if m is chosen)))
    return pairs


@pytest.mark.quick("tp_invariant.rl_refit")
def test_the_refit_takes_each_expert_from_the_trainer_rank_that_holds_it_under_tp_invariant(monkeypatch):
    """tp_invariant.rl_refit, against megatron-core's own refit planner code: upstream matches
    SequentialMLP experts by their local index, so some rollout ranks get another expert's weights
    (the precondition; train_rl.py then logs a mismatch once training moves the experts apart:
    results/train_rl.md); under the mode every rollout expert comes from the trainer's copy of it."""
    native = _refit_sources(monkeypatch, tp_invariant=False)
    assert any(wanted != taken for wanted, taken in native), native
    pairs = _refit_sources(monkeypatch, tp_invariant=True)
    assert all(wanted == taken for wanted, taken in pairs), pairs
    assert sorted(w for w, _ in pairs) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_the_trainers_log_probs_under_tp_invariant_are_the_engines_arithmetic():
    """tp_invariant.rl_logprobs: the trainer's log-probs of a [batch, sequence, vocab] block equal,
    bit for bit, what the dynamic engine computes for the same rows laid out [tokens, vocab]
    (``DynamicInferenceContext.calculate_log_probs``: an FP32 log_softmax); upstream's FP32 formula
    (``x - logsumexp(x)``) does not, on these inputs, so the patch is what makes the logged
    mismatch exactly 0."""
    from megapatch.patches.tp_invariant.rl_logprobs import engine_log_probs

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 17, 500, generator=gen) * 4).float()
    index = torch.randint(0, 500, (3, 17), generator=gen)
    engine = torch.nn.functional.log_softmax(logits.reshape(-1, 500).float(), dim=-1)
    engine = engine[torch.arange(51), index.reshape(-1)].view(3, 17)
    ours = engine_log_probs(logits, index)
    assert ours.dtype == torch.float32 and torch.equal(ours, engine)
    upstream = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.stack([torch.logsumexp(r, -1) for r in logits])
    assert not torch.equal(upstream, engine)
    bf16 = logits.bfloat16()
    assert engine_log_probs(bf16, index).dtype == torch.bfloat16  # the training dtype upstream asserts


def test_a_dense_layers_forward_rows_have_the_same_bits_at_any_row_count():
    """block_tree.token_product: a row of a decode step (one row a request, 1-11 rows) gets the bits
    it gets inside a long micro-batch; without the padding CPU FP32 GEMMs give other bits at 1-3,
    5-7 and 9-11 rows (the precondition below)."""
    from megapatch.numerics.block_tree import operand, product, token_product

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=gen).bfloat16()
    w = operand(torch.randn(40, 96, generator=gen).bfloat16()).t()
    full = product(operand(x), w)
    assert any(not torch.equal(product(operand(x[:r]), w), full[:r]) for r in (1, 2, 3, 5, 6, 7))
    for rows in range(1, 20):
        assert torch.equal(token_product(operand(x[:rows]), w), full[:rows]), rows


def test_a_launch_returns_when_its_job_ends_though_a_process_it_left_holds_the_output(tmp_path):
    """A rank's child that outlives the job (Megatron RL's inference coordinator, when torchrun
    stopped its rank) keeps the job's output pipe open: the launch ends it and returns the log,
    instead of waiting on it until its own timeout (and then for ever)."""
    import sys

    pid_file = tmp_path / "pid"
    orphan = ("import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(300)'], start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid)); print('done')")
    run = mlm.launch_command(tmp_path, [sys.executable, "-c", orphan, str(pid_file)], timeout=240)
    assert run.returncode == 0 and "done" in run.log and not run.timed_out
    assert run.seconds < 120, run.seconds  # the orphan sleeps 300 s: the launch did not wait for it
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
