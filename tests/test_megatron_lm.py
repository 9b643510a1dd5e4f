"""Megatron-LM's own ``pretrain_gpt.py``, unmodified, on CPU ranks under
``torchrun -m megapatch.testing.ranks.cpu_launch``, megapatch switched on by ``MEGAPATCH_*`` only.

Sources: the pinned tarballs in ``<repo>/../shared/megatron-lm/`` (or ``$MEGATRON_LM_TARBALLS``),
unpacked once per session, or a user's checkout in ``$MEGATRON_LM_DIR``. The runs go through
``tests/scripts/megatron_lm_probe.py``, which records the dtype of the logits reaching megatron's
cross entropy and a hash of the per-token losses.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, environ_without_megapatch
from megapatch.testing.ranks import megatron_lm_runs as mlm

TARBALL_DIR = Path(os.environ.get("MEGATRON_LM_TARBALLS",
                                  Path(REPO).parent / "shared" / "megatron-lm"))
PROBE = str(Path(REPO) / "tests" / "scripts" / "megatron_lm_probe.py")
REVISIONS = ["user-checkout"] if os.environ.get(mlm.USER_CHECKOUT_ENV) else list(mlm.TARBALLS)
TIMEOUT = 420

_runs = {}  # (revision, label) -> (Run, probe records by rank): runs shared between tests


@pytest.fixture(scope="session")
def _checkouts():
    return {}


@pytest.fixture(scope="session")
def _probe_root(tmp_path_factory):
    return tmp_path_factory.mktemp("megatron-lm-probes")


@pytest.fixture(params=REVISIONS)
def checkout(request, _checkouts, _probe_root, tmp_path_factory):
    name = request.param
    missing = mlm.missing_training_modules()
    if missing:
        pytest.skip(f"Megatron-LM's pretrain_gpt.py needs {', '.join(missing)} (pip install them)")
    if name == "user-checkout":
        path = Path(os.environ[mlm.USER_CHECKOUT_ENV])
        if not (path / "pretrain_gpt.py").is_file():
            pytest.skip(f"{mlm.USER_CHECKOUT_ENV}={path} has no pretrain_gpt.py")
        return name, path, _probe_root
    too_old = mlm.python_too_old(name)
    if too_old:
        pytest.skip(too_old)
    tarball = TARBALL_DIR / mlm.TARBALLS[name]
    if not tarball.is_file():
        pytest.skip(f"no Megatron-LM source: {tarball} is absent and {mlm.USER_CHECKOUT_ENV} is unset")
    if name not in _checkouts:
        _checkouts[name] = mlm.unpack(tarball, tmp_path_factory.mktemp(f"megatron-lm-{name}"))
    return name, _checkouts[name], _probe_root


def _run(checkout, label, flags, *, nproc, megapatch_env=None, entry=None, timeout=TIMEOUT):
    """One torchrun job through the probe (cached per revision and label); asserts it trained."""
    name, path, probe_root = checkout
    key = (name, label)
    if key not in _runs:
        probe_dir = probe_root / name / label
        probe_dir.mkdir(parents=True)
        run = mlm.launch(path, flags, nproc=nproc, megapatch_env=megapatch_env or {},
                         entry=entry or [PROBE], timeout=timeout,
                         extra_env={"MEGATRON_LM_PROBE_DIR": str(probe_dir)})
        probes = {int(p.stem[4:]): [json.loads(line) for line in p.read_text().splitlines()]
                  for p in probe_dir.glob("rank*.jsonl")}
        _runs[key] = (run, probes)
    return _runs[key]


def _trained(run, iters):
    assert run.returncode == 0, f"{' '.join(run.command)}\n{run.tail()}"
    assert sorted(run.losses) == list(range(1, iters + 1)), run.tail()
    return run.losses


ITERS = 4
# vocab 255 (+1 NullTokenizer EOD) pads to 256 rows at TP=1 and TP=2 alike: the same initial model
TP_FLAGS = dict(iters=ITERS, hidden=64, layers=2, vocab=255, lr=3e-3)


def _tp_run(checkout, tp, mode):
    env = {} if mode == "native" else {"MEGAPATCH_TP_REDUCE_DTYPE": mode}
    run, probes = _run(checkout, f"tp{tp}-{mode}", mlm.tiny_gpt_flags(tp=tp, **TP_FLAGS),
                       nproc=tp, megapatch_env=env)
    return run, probes


def _first_step_token_losses(probes):
    """Rank 0's per-token losses of iteration 1 (its 2 micro-batches: the same weights and data at
    every TP size), ``{token index: FP32 value}``."""
    return dict(enumerate(float.fromhex(v) for record in probes[0][:2] for v in record["values"]))


def test_a_runs_active_patches_are_read_from_its_activation_line():
    """The names on the activation line, coverage notes (brackets with commas and semicolons of
    their own) and pending imports left out; none when megapatch never enabled."""
    line = ("megapatch enabled: tp_invariant=True (env MEGAPATCH_TP_INVARIANT) | patches active: "
            "cross_rank.publish_settings, tp_invariant.moe [router per block; refused: a, b | c], "
            "tp_invariant.micro_batch; pending-import: tp_invariant.construction (installs when ...)")
    run = mlm.Run([], 0, f"rank 0 starts\n{line}\n{line.replace('micro_batch', 'other')}\n", 1.0)
    assert run.active_patches == ["cross_rank.publish_settings", "tp_invariant.moe", "tp_invariant.micro_batch"]
    # a patch whose module was imported after the patches line comes on a line of its own
    later = ("megapatch installed later: tp_invariant.construction, tp_invariant.mlp "
             "(megatron.core.transformer.transformer_block imported) | 5 of 16 requested patches active")
    run = mlm.Run([], 0, f"{later}\n{line}\n{later}\n", 1.0)
    assert run.active_patches == ["cross_rank.publish_settings", "tp_invariant.moe", "tp_invariant.micro_batch",
                                  "tp_invariant.construction", "tp_invariant.mlp"]
    assert mlm.Run([], 1, "Traceback ...", 1.0).active_patches == []


@pytest.mark.slow
def test_fp32_tp_reductions_bring_tp2_losses_to_tp1(checkout):
    """The TP drift FP32 reductions remove, measured where it is not mixed with training dynamics:
    the per-token losses of the first iteration (the same initial model and batch at TP 1 and 2),
    mean |TP2 - TP1| over its 128 tokens. Printed losses of later iterations are no measure: after
    an Adam step, rounding differences of either mode are amplified in either direction (on this
    model fp32's printed iteration-3 loss was further from TP1's than native's)."""
    tp1, tp1_probes = _tp_run(checkout, 1, "native")
    native, native_probes = _tp_run(checkout, 2, "native")
    fp32, fp32_probes = _tp_run(checkout, 2, "fp32")
    for run in (tp1, native, fp32):
        _trained(run, ITERS)
    reference = _first_step_token_losses(tp1_probes)
    drift_native = mlm.mean_abs_difference(_first_step_token_losses(native_probes), reference)
    drift_fp32 = mlm.mean_abs_difference(_first_step_token_losses(fp32_probes), reference)
    assert "megapatch enabled" not in native.log  # no MEGAPATCH_* variable: megapatch not loaded
    assert "tp_reduce_dtype=fp32 (env MEGAPATCH_TP_REDUCE_DTYPE)" in fp32.log, fp32.tail()
    assert len(reference) == 2 * 2 * 32 and drift_native < 1e-2, drift_native  # the same model
    assert drift_native > 0, "native TP=2 gave TP=1's per-token losses: the comparison cannot tell"
    assert drift_fp32 < 0.05 * drift_native, (drift_fp32, drift_native)  # measured: 5.2e-8 vs 5.1e-4


def test_fp32_logits_reach_megatron_lm_loss(checkout):
    """Megatron-LM's loss is computed on FP32 logits with MEGAPATCH_LOGITS_DTYPE=fp32 (TP=2), on
    BF16 logits without it; the job log names the path that produced them."""
    fp32, fp32_probes = _run(checkout, "tp2-logits-fp32", mlm.tiny_gpt_flags(tp=2, **TP_FLAGS),
                             nproc=2, megapatch_env={"MEGAPATCH_LOGITS_DTYPE": "fp32"})
    native, native_probes = _tp_run(checkout, 2, "native")
    _trained(fp32, ITERS)
    _trained(native, ITERS)
    calls = ITERS * 2  # iterations x microbatches (global batch 4 / micro batch 2), per rank
    for probes, dtype in ((fp32_probes, "torch.float32"), (native_probes, "torch.bfloat16")):
        assert sorted(probes) == [0, 1]
        for rank, records in probes.items():
            assert [r["dtype"] for r in records] == [dtype] * calls, (rank, records)
    assert "logits_dtype=fp32 (env MEGAPATCH_LOGITS_DTYPE)" in fp32.log, fp32.tail()
    # which path produced them: on CPU megapatch's own FP32-output GEMM, also where megatron-core
    # has PR #6252's output_dtype (main), whose TE general_gemm cannot run here
    assert "megapatch logits.fp32_lm_head: FP32 logits via megapatch FP32-output GEMM" in fp32.log, \
        fp32.tail()
    if checkout[0].startswith("main"):  # has PR #6252's output_dtype: bypassed, and the log says so
        assert "not megatron-core's own output_dtype (PR #6252)" in fp32.log, fp32.tail()


# Megatron-LM's Llama flags (SwiGLU, RMSNorm, RoPE, GQA, untied head, no biases)
LLAMA_FLAGS = ("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
               "--group-query-attention", "--num-query-groups", "2",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear")


@pytest.mark.slow
def test_llama_flags_train_with_the_fused_swiglu_under_the_cpu_launcher(checkout):
    """--swiglu keeps Megatron-LM's default bias-SwiGLU fusion (torch.compile'd): the launcher's
    stand-in for the CUDA architecture query must not be one that inductor reads (it once was:
    BackendCompilerFailed ... no attribute 'gcnArchName')."""
    run, _ = _run(checkout, "llama-tp2-fp32-fused", mlm.tiny_gpt_flags(tp=2, **TP_FLAGS, extra=LLAMA_FLAGS),
                  nproc=2, megapatch_env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    _trained(run, ITERS)
    assert "BackendCompilerFailed" not in run.log


def _grad_norms(run):
    import re

    return re.findall(r"grad norm: ([0-9.eE+-]+)", run.log)


def _tp_invariant_revision(checkout):
    if checkout[0] != "core_v0.16.1":  # CI time: the mode's own tests run on 0.16.1-0.19.2 and main (matrix)
        pytest.skip(f"tp_invariant's pretrain_gpt.py runs are kept to core_v0.16.1, not {checkout[0]}")


@pytest.mark.slow
@pytest.mark.resumes
def test_tp_invariant_gelu_layernorm_is_bit_identical_at_tp1_and_tp2(checkout):
    """Issue 17 item 7: the default GELU/LayerNorm GPT at TP=1 and TP=2 (same padded vocabulary):
    every per-token loss (hashed at each micro-batch), printed loss and grad norm identical under
    the mode; native TP=2 differs from TP=1 in the per-token losses."""
    _tp_invariant_revision(checkout)
    found = {}
    for tp in (1, 2):
        run, probes = _run(checkout, f"tp{tp}-invariant", mlm.tiny_gpt_flags(tp=tp, **TP_FLAGS), nproc=tp,
                           megapatch_env={"MEGAPATCH_TP_INVARIANT": "1"})
        found[tp] = (_trained(run, ITERS), _grad_norms(run), [r["loss"] for r in probes[0]])
        assert len(found[tp][2]) == ITERS * 2, probes  # iterations x micro-batches
    assert found[1] == found[2]
    native = [[r["loss"] for r in _tp_run(checkout, tp, "native")[1][0]] for tp in (1, 2)]
    assert native[0] != native[1]


@pytest.mark.slow
def test_tp_invariant_qwen3_prints_the_same_losses_and_grad_norms_at_tp1_and_tp2(checkout):
    """tp_invariant through Megatron-LM's own script with Qwen3's dense flags (the Llama flags plus
    --qk-layernorm, whose q/k norm gradients upstream's finalize_model_grads sums over TP): TP=1
    and TP=2 (same padded vocabulary, same initial model) print identical losses and clipped grad
    norms at every iteration; native reductions do not (the comparison can fail). Plain Llama
    flags run in the sequence-parallel test below."""
    _tp_invariant_revision(checkout)
    printed = {}
    for mode, env in (("invariant", {"MEGAPATCH_TP_INVARIANT": "1"}), ("native", {})):
        for tp in (1, 2):
            # tp_invariant refuses fused bias-activation kernels (not verified bit-stable yet)
            flags = mlm.tiny_gpt_flags(tp=tp, **TP_FLAGS, extra=LLAMA_FLAGS + ("--qk-layernorm",
                                                                             "--no-bias-swiglu-fusion"))
            label = f"qwen3-tp{tp}-{mode}"
            run, probes = _run(checkout, label, flags, nproc=tp, megapatch_env=env)
            # printed (3 decimals) hides small differences: per-token losses, full-precision grad
            # norms and the replicated parameters' gradients (the q/k norms' among them) too
            printed[(mode, tp)] = (_trained(run, ITERS), _grad_norms(run), [r["loss"] for r in probes[0]],
                                   _recorded_norms(checkout, label),
                                   _recorded_norms(checkout, label, "replicated_grads"))
            assert len(printed[(mode, tp)][1]) == ITERS, run.tail()
            # 2 layers x (input norm, q norm, k norm, pre-MLP norm) + the final norm: RMSNorm weights
            assert len(printed[(mode, tp)][4][0]) == 2 * 4 + 1, printed[(mode, tp)][4]
    doctor = _doctor(checkout, flags, {"MEGAPATCH_TP_INVARIANT": "1"})  # flags the mode ran with: accepted
    assert doctor.returncode == 0 and "no requested patch refuses them" in doctor.stdout, doctor.stdout
    assert printed[("invariant", 1)] == printed[("invariant", 2)]
    assert printed[("native", 1)] != printed[("native", 2)]


@pytest.mark.slow
@pytest.mark.parametrize("model, tps", [pytest.param("gpt", (1, 2, 4), marks=pytest.mark.resumes),
                                        pytest.param("llama", (1, 2, 4), marks=pytest.mark.resumes)])
def test_tp_invariant_sequence_parallel_is_bit_identical_to_tp1(checkout, model, tps):
    """Issue 17 item 2: --sequence-parallel at TP=2 (and 4) under the mode prints the same losses and grad
    norms, and gives the same per-token losses and full-precision grad norms, as TP=1 (where
    Megatron-LM turns sequence parallelism off): the GELU GPT (LayerNorm, biases: the row-parallel
    biases' and the norms' gradients are token-split sums) and the Llama flags (RMSNorm; at TP 4
    this caught a grad norm cutting SwiGLU's fc1 across gate and up, 1 ulp off). The norms
    run as the labelled CPU stand-in of apex's sequence-parallel norm. Native SP differs from TP=1
    (checked on the GELU GPT)."""
    _tp_invariant_revision(checkout)
    # Llama: 8 heads in 4 KV groups (whole groups at TP 4; the last --num-query-groups wins)
    extra = LLAMA_FLAGS + ("--num-query-groups", "4", "--no-bias-swiglu-fusion") if model == "llama" else ()
    flags = dict(TP_FLAGS, vocab=511, heads=8 if model == "llama" else 4)  # 512 rows at TP 1, 2, 4
    found = {}
    for mode, env in (("invariant", {"MEGAPATCH_TP_INVARIANT": "1"}), ("native", {})):
        for tp in tps if mode == "invariant" else (1, 2) if model == "gpt" else ():  # one precondition
            label = f"{model}-sp-tp{tp}-{mode}"
            sp = ("--sequence-parallel",) if tp > 1 else ()
            run, probes = _run(checkout, label, mlm.tiny_gpt_flags(tp=tp, **flags, extra=extra + sp),
                               nproc=tp, megapatch_env=env)
            found[(mode, tp)] = (_trained(run, ITERS), _grad_norms(run), [r["loss"] for r in probes[0]],
                                 _recorded_norms(checkout, label))
            assert len(found[(mode, tp)][3]) == ITERS, run.tail()
    for tp in tps[1:]:
        assert found[("invariant", 1)] == found[("invariant", tp)], tp
    if model == "gpt":
        assert found[("native", 1)][2] != found[("native", 2)][2]


@pytest.mark.slow
@pytest.mark.resumes
def test_tp_invariant_resume_at_another_tp_size_is_bit_identical(checkout, tmp_path_factory):
    """The seed issue's scenario: train at TP=2, save a torch_dist checkpoint, resume at TP=4 and
    TP=1 (GELU, LayerNorm, optimizer state resharded by Megatron's loader). Under the mode every
    per-token loss and every tensor of the final checkpoint (parameters, FP32 main parameters, Adam
    moments) equals the TP=2 resume's and the uninterrupted run's; without it, TP 4 drifts."""
    from megapatch.testing.scenarios import tp_resume

    _tp_invariant_revision(checkout)
    work = tmp_path_factory.mktemp("tp-resume")
    runs = tp_resume.experiment(checkout[1], work / "invariant", {"MEGAPATCH_TP_INVARIANT": "1"},
                                probe=PROBE, resume_tps=(2, 4, 1), label="invariant", timeout=TIMEOUT)
    same = runs["resume2"]
    # issue 28 item 3: the checkpoint writer's spawned worker (it imports __main__, so megatron)
    # is patched quietly: one activation line per job, every job here saving torch_dist
    for run in runs.values():
        assert run.run.log.count("megapatch enabled:") == 1, (run.label, run.run.tail())
    assert len(same.loss_hashes) == 3 * 2  # iterations 4-6, two micro-batches each
    _assert_resumes_equal_the_tp2_resume_and_never_stopping(runs)
    native = tp_resume.experiment(checkout[1], work / "native", {}, probe=PROBE, resume_tps=(2, 4),
                                  label="native", start=runs["full"].checkpoint.parent, timeout=TIMEOUT)
    assert native["resume4"].loss_hashes != native["resume2"].loss_hashes
    assert tp_resume.differences(native["resume4"].tensors(), native["resume2"].tensors())


@pytest.mark.slow
@pytest.mark.resumes
def test_tp_invariant_distributed_optimizer_resume_at_another_tp_size_is_bit_identical(checkout, tmp_path_factory):
    """Issue 28 item 4: the same scenario with --use-distributed-optimizer, saved in upstream's fully
    reshardable format (what a TP change needs: upstream refuses dp_reshardable checkpoints at
    another TP size). Resumes at TP 4 and 1 equal the TP=2 resume in every per-token loss, printed
    loss, grad norm and checkpoint tensor (FP32 main parameters, Adam moments), and the TP=2 resume
    equals the uninterrupted run's per-token losses and final checkpoint. Runs through three
    labelled stand-ins for upstream's torch-Adam (no apex/TE) load path
    (megapatch.testing.stand_ins.megatron_lm_compat): without the one that gives each parameter its
    own Adam step, the resumed run leaves the uninterrupted one after its first step."""
    from megapatch.testing.scenarios import tp_resume

    _tp_invariant_revision(checkout)
    work = tmp_path_factory.mktemp("tp-resume-distopt")
    runs = tp_resume.experiment(checkout[1], work, {"MEGAPATCH_TP_INVARIANT": "1"}, probe=PROBE,
                                resume_tps=(2, 4, 1), label="distopt", timeout=TIMEOUT,
                                extra=("--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"))
    reference = _assert_resumes_equal_the_tp2_resume_and_never_stopping(runs)
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in reference), sorted(reference)[:10]


def _assert_resumes_equal_the_tp2_resume_and_never_stopping(runs):
    """Per-token losses and the final checkpoint of the TP=2 resume equal the uninterrupted run's;
    the TP 4 and 1 resumes equal the TP=2 resume's in those and in printed losses and grad norms.
    Returns the TP=2 resume's checkpoint tensors."""
    from megapatch.testing.scenarios import tp_resume

    same, full = runs["resume2"], runs["full"]
    reference = same.tensors()
    assert same.loss_hashes == full.loss_hashes[-len(same.loss_hashes):]
    assert tp_resume.differences(full.tensors(), reference) == {}
    for tp in (4, 1):
        run = runs[f"resume{tp}"]
        assert run.loss_hashes == same.loss_hashes, tp
        assert (run.losses, run.grad_norms) == (same.losses, same.grad_norms), tp
        assert tp_resume.differences(run.tensors(), reference) == {}, tp
    return reference


@pytest.mark.slow
@pytest.mark.resumes
def test_tp_invariant_grad_norms_over_pipeline_stages_are_tp_independent(checkout):
    """TP x PP: PP=2 at TP=1 (world 2) and TP=2 (world 4) print the same losses and grad norms
    (the norm adds the stages' invariant totals in stage order); native reductions do not."""
    _tp_invariant_revision(checkout)
    printed = {}
    for mode, env in (("invariant", {"MEGAPATCH_TP_INVARIANT": "1"}), ("native", {})):
        for tp in (1, 2):
            run, _ = _run(checkout, f"pp2-tp{tp}-{mode}", mlm.tiny_gpt_flags(tp=tp, pp=2, **TP_FLAGS),
                          nproc=2 * tp, megapatch_env=env)
            printed[(mode, tp)] = (_trained(run, ITERS), _grad_norms(run))
            assert len(printed[(mode, tp)][1]) == ITERS, run.tail()
    assert printed[("invariant", 1)] == printed[("invariant", 2)]
    assert printed[("native", 1)] != printed[("native", 2)]
    # the invariant norm is still the norm over both stages (oracle: native's, to rounding)
    for invariant, native in zip(printed[("invariant", 1)][1], printed[("native", 1)][1]):
        assert abs(float(invariant) - float(native)) <= 0.02 * float(native), printed


def _recorded_norms(checkout, label, field="grad_norm"):
    """Rank 0's record at every clipped step: the grad norm, or (``replicated_grads``) digests of
    the replicated parameters' gradients."""
    name, _, probe_root = checkout
    path = probe_root / name / label / "norms-rank0.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [float.fromhex(r["grad_norm"]) if field == "grad_norm" else r[field] for r in records]


@pytest.mark.slow
@pytest.mark.resumes
def test_tp_invariant_distributed_optimizer_is_tp_independent(checkout):
    """Issue 17 item 2: --use-distributed-optimizer under the mode, at DP=1 (TP 1 and 2) and at DP=2
    (TP 1 and 2, world 2 and 4: the norm gathers the data-parallel shards). Per-token losses,
    printed losses and the grad norms (full precision, as clipping reads them) are identical at
    both TP sizes; the norm equals the non-distributed optimizer's to 1e-6 (the same gradients
    summed in another parameter order), which a shard left out or read unreduced would break;
    native reductions differ between the TP sizes."""
    _tp_invariant_revision(checkout)
    distopt = ("--use-distributed-optimizer",)
    found = {}
    for mode, env in (("invariant", {"MEGAPATCH_TP_INVARIANT": "1"}), ("native", {})):
        for tp, dp in ((1, 1), (2, 1)) + (((1, 2), (2, 2)) if mode == "invariant" else ()):
            label = f"distopt-tp{tp}-dp{dp}-{mode}"
            run, probes = _run(checkout, label, mlm.tiny_gpt_flags(tp=tp, **TP_FLAGS, extra=distopt),
                               nproc=tp * dp, megapatch_env=env)
            found[(mode, tp, dp)] = (_trained(run, ITERS), _grad_norms(run), [r["loss"] for r in probes[0]],
                                     _recorded_norms(checkout, label))
            assert len(found[(mode, tp, dp)][3]) == ITERS, run.tail()
    for dp in (1, 2):
        assert found[("invariant", 1, dp)] == found[("invariant", 2, dp)], dp
    assert found[("native", 1, 1)][2] != found[("native", 2, 1)][2]
    # oracle: the non-distributed optimizer's invariant norm over the same gradients (iteration 1:
    # the same model and batch; DP=1 and DP=2 average the same micro-batches)
    run, _ = _run(checkout, "tp1-invariant", mlm.tiny_gpt_flags(tp=1, **TP_FLAGS), nproc=1,
                  megapatch_env={"MEGAPATCH_TP_INVARIANT": "1"})
    reference = _recorded_norms(checkout, "tp1-invariant")[0]
    for dp in (1, 2):
        assert abs(found[("invariant", 1, dp)][3][0] - reference) <= 1e-6 * reference, (dp, found, reference)
    # megapatch doctor -- <the same flags> accepts them
    doctor = _doctor(checkout, mlm.tiny_gpt_flags(tp=2, **TP_FLAGS, extra=distopt), {"MEGAPATCH_TP_INVARIANT": "1"})
    assert doctor.returncode == 0 and "no requested patch refuses them" in doctor.stdout, doctor.stdout


@pytest.mark.slow
def test_a_refusal_reads_as_one_line_per_rank_before_the_first_step(checkout):
    """Issue 19 item 6: what the mode refuses (here --cross-entropy-loss-fusion at TP=2) stops the
    job when the model is built: the whole message once (rank 0), a short line on rank 1, no
    traceback through the script's or megapatch's frames (it once printed three per rank), no
    iteration."""
    from megapatch.patches.tp_invariant._refusal_tables import REFUSED_CONFIG

    _tp_invariant_revision(checkout)
    run, _ = _run(checkout, "tp2-invariant-cross-entropy-fusion",
                  mlm.tiny_gpt_flags(tp=2, **TP_FLAGS, extra=("--cross-entropy-loss-fusion",)),
                  nproc=2, megapatch_env={"MEGAPATCH_TP_INVARIANT": "1"})
    assert run.returncode != 0 and not run.losses, run.tail()
    _, flag, why = REFUSED_CONFIG["cross_entropy_loss_fusion"]
    full = (f"megapatch: UnsupportedConfigurationError: megapatch tp_invariant=True does not support "
            f"cross_entropy_loss_fusion=True (Megatron-LM: {flag}): {why}. tp_invariant was set by "
            f"MEGAPATCH_TP_INVARIANT=1 in the environment; unset MEGAPATCH_TP_INVARIANT to change it.")
    assert run.log.count(full) == 1, run.tail()
    short = [line for line in run.log.splitlines() if "(rank 1; the full message is on rank 0)" in line]
    assert len(short) == 1 and "does not support cross_entropy_loss_fusion=True" in short[0], run.tail()
    assert run.log.count("does not support cross_entropy_loss_fusion") == 2, run.tail()
    # torchrun's own summary of the failed children remains (upstream); no rank prints a traceback
    assert "pretrain_gpt.py\", line" not in run.log and "tp_invariant.py\", line" not in run.log, run.tail()


def test_doctor_refuses_several_distributed_optimizer_instances_for_the_mode(checkout):
    """What the mode still cannot cover of the distributed optimizer (several instances: their
    all-reduce is outside the tree) is refused by ``megapatch doctor -- <flags>`` before a job is
    submitted, and by the optimizer's construction (tests/test_tp_invariant.py; a real job cannot
    get there on CPU: upstream creates CUDA streams for the instances first)."""
    _tp_invariant_revision(checkout)
    flags = mlm.tiny_gpt_flags(tp=1, **TP_FLAGS, extra=("--use-distributed-optimizer",
                                                          "--num-distributed-optimizer-instances", "2"))
    doctor = _doctor(checkout, flags, {"MEGAPATCH_TP_INVARIANT": "1"})
    assert doctor.returncode == 1 and "REFUSED by tp_invariant.distributed_optimizer" in doctor.stdout, doctor.stdout
    assert "num_distributed_optimizer_instances=2 (Megatron-LM: --num-distributed-optimizer-instances)" in doctor.stdout


# Megatron-LM's argparse names -> what megapatch.commands.megatron_lm_flags calls them
_PARSED = """
import copy, json, os, sys
sys.path.insert(0, ".")
from megatron.training import arguments
from megatron.training.arguments import parse_args, validate_args
try:  # core_v0.16.1; Megatron-LM main moved it (pretrain_gpt.py imports it from megatron.core there)
    from megatron.training.tokenizer import build_tokenizer
except ImportError:
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
# as a launch sets them (megatron_lm_runs.launch_env; megatron_lm_compat's CPU architecture stand-in)
arguments.get_device_arch_version = lambda: 0
os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
out = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["pretrain_gpt.py", *argv]
    a = parse_args(ignore_unknown_args=True)
    swiglu = a.swiglu
    sizes = {}
    if a.num_layers is not None:  # a whole command line: the sizes validate_args derives, the padding
        v = copy.deepcopy(a)
        v.world_size = v.tensor_model_parallel_size * v.pipeline_model_parallel_size
        validate_args(v, {})
        build_tokenizer(v)  # sets padded_vocab_size
        sizes = dict(hidden_size=v.hidden_size, ffn_hidden_size=v.ffn_hidden_size, kv_channels=v.kv_channels,
                     padded_vocab_size=v.padded_vocab_size,
                     vocab_size=v.vocab_size, make_vocab_size_divisible_by=v.make_vocab_size_divisible_by,
                     seq_length=v.seq_length, expert_tensor_parallel_size=v.expert_tensor_parallel_size,
                     moe_ffn_hidden_size=v.moe_ffn_hidden_size)
    first = lambda value: value[0] if isinstance(value, list) else value  # nargs='+' flags
    out.append(dict(**sizes,
        tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size,
        context_parallel_size=a.context_parallel_size,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        gated_linear_unit=swiglu, sequence_parallel=a.sequence_parallel,
        gradient_accumulation_fusion=a.gradient_accumulation_fusion,
        bias_activation_fusion=a.bias_swiglu_fusion if swiglu else a.bias_gelu_fusion,
        use_te_activation_func=a.use_te_activation_func,
        defer_embedding_wgrad_compute=a.defer_embedding_wgrad_compute,
        cross_entropy_loss_fusion=a.cross_entropy_loss_fusion,
        num_moe_experts=a.num_experts, transformer_impl=a.transformer_impl,
        use_distributed_optimizer=a.use_distributed_optimizer,
        num_distributed_optimizer_instances=a.num_distributed_optimizer_instances,
        expert_model_parallel_size=a.expert_model_parallel_size, moe_permute_fusion=a.moe_permute_fusion,
        moe_router_fusion=a.moe_router_fusion, moe_shared_expert_overlap=a.moe_shared_expert_overlap,
        moe_shared_expert_gate=a.moe_shared_expert_gate,
        moe_router_force_load_balancing=a.moe_router_force_load_balancing,
        moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
        moe_expert_capacity_factor=a.moe_expert_capacity_factor, moe_input_jitter_eps=a.moe_input_jitter_eps,
        moe_latent_size=a.moe_latent_size, moe_router_dtype=a.moe_router_dtype,
        moe_router_load_balancing_type=first(a.moe_router_load_balancing_type),
        moe_aux_loss_coeff=first(a.moe_aux_loss_coeff), moe_z_loss_coeff=a.moe_z_loss_coeff,
        calculate_per_token_loss=a.calculate_per_token_loss, add_bias_linear=a.add_bias_linear))
print("PARSED" + json.dumps(out))
"""


def test_doctor_reads_flags_as_megatron_lm_parses_them(checkout):
    """megapatch doctor -- <flags> derives the model a job builds from its flags: every field it
    reads, for several command lines, equals what Megatron-LM's own parser makes of them
    (defaults included: gradient-accumulation and bias-activation fusion on, TE layers; for whole
    command lines the sizes ``validate_args`` derives and the vocabulary as its tokenizer pads it)."""
    lines = [["--num-attention-heads", "8"],
             mlm.tiny_gpt_flags(tp=2, **TP_FLAGS, extra=LLAMA_FLAGS + ("--no-bias-swiglu-fusion",)),
             # issue 28: the padded vocabulary (513 + 1 EOD to a multiple of 2 x 2), the GELU FFN default,
             # a flag given twice (argparse keeps the last), --kv-channels and --ffn-hidden-size
             mlm.tiny_gpt_flags(tp=4, hidden=128, heads=8, vocab=513, extra=(
                 "--make-vocab-size-divisible-by", "2", "--tensor-model-parallel-size", "2")),
             mlm.tiny_gpt_flags(tp=1, hidden=128, heads=8, extra=LLAMA_FLAGS + (
                 "--kv-channels", "32", "--ffn-hidden-size", "320", "--no-bias-swiglu-fusion")),
             ["--num-attention-heads", "8", "--sequence-parallel", "--use-distributed-optimizer",
              "--no-bias-gelu-fusion", "--num-experts", "4", "--use-te-activation-func",
              "--defer-embedding-wgrad-compute", "--tensor-model-parallel-size=4", "--cross-entropy-loss-fusion",
              "--num-distributed-optimizer-instances", "2", "--context-parallel-size", "2"],
             # issue 26: the MoE flags the tp_invariant refusals read, defaults (expert TP = TP, the
             # experts' FFN size) derived by validate_args
             mlm.tiny_gpt_flags(tp=2, hidden=64, heads=4, extra=(
                 "--num-experts", "8", "--expert-model-parallel-size", "2", "--moe-permute-fusion",
                 "--moe-router-fusion", "--moe-shared-expert-overlap", "--moe-shared-expert-gate",
                 "--moe-shared-expert-intermediate-size", "96", "--moe-expert-capacity-factor", "1.5",
                 "--moe-input-jitter-eps", "0.01", "--moe-router-dtype", "fp32", "--moe-router-load-balancing-type",
                 "sinkhorn", "--moe-aux-loss-coeff", "0.001", "--moe-z-loss-coeff", "0.002",
                 "--calculate-per-token-loss", "--disable-bias-linear", "--sequence-parallel"))]
    parsed = subprocess.run([sys.executable, "-c", _PARSED, json.dumps(lines)], cwd=str(checkout[1]),
                            capture_output=True, text=True, timeout=300)
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    expected = json.loads(parsed.stdout.split("PARSED", 1)[1])
    # the doctor's view from inside the checkout, as `python -m megapatch doctor` run there sees its
    # megatron (core_v0.16.1's NullTokenizer adds the EOD token to --vocab-size, main's does not)
    mine = subprocess.run([sys.executable, "-c", _DOCTOR_VIEW, json.dumps(lines)], cwd=str(checkout[1]),
                          capture_output=True, text=True, timeout=300)
    assert mine.returncode == 0, mine.stderr[-3000:]
    for argv, fields, derived in zip(lines, expected, json.loads(mine.stdout.split("DERIVED", 1)[1])):
        assert {k: derived[k] for k in fields} == fields, argv


_DOCTOR_VIEW = """
import json, sys
sys.path.insert(0, ".")
from megapatch.commands.megatron_lm_flags import config_from_flags
print("DERIVED" + json.dumps([vars(config_from_flags(argv)) for argv in json.loads(sys.argv[1])], default=str))
"""


def _doctor(checkout, flags, env):
    """The doctor run as a user runs it beside the job: from the checkout's root, so that it sees the
    megatron the job imports (Megatron-LM main's stage has no megatron-core installed, only the checkout)."""
    from megapatch.testing.ranks.megatron_lm_runs import launch_env

    return subprocess.run([sys.executable, "-m", "megapatch", "doctor", "--", *flags], capture_output=True,
                          text=True, timeout=300, env=launch_env(env), cwd=str(checkout[1]))


@pytest.mark.slow
def test_fp8_alignment_with_interleaved_pipeline_is_bit_identical(checkout):
    """PP=2 with virtual stages, distributed optimizer, overlapped param gather / grad reduce:
    MEGAPATCH_ALIGN_FP8_TRANSPOSES=1 says what it did and changes no bit of the losses."""
    flags = mlm.tiny_gpt_flags(tp=1, pp=2, layers=4, layers_per_virtual_stage=1, iters=3,
                               global_batch=8, extra=["--use-distributed-optimizer",
                                                      "--overlap-param-gather",
                                                      "--overlap-grad-reduce"])
    off, off_probes = _run(checkout, "pp2-vpp-align-off", flags, nproc=2)
    on, on_probes = _run(checkout, "pp2-vpp-align-on", flags, nproc=2,
                         megapatch_env={"MEGAPATCH_ALIGN_FP8_TRANSPOSES": "1"})
    assert _trained(on, 3) == _trained(off, 3)
    last_stage = 1
    assert len(off_probes[last_stage]) == 3 * 4  # iterations x microbatches on the last stage
    assert on_probes[last_stage] == off_probes[last_stage]  # per-token losses, bit for bit
    assert "align_fp8_transposes=True (env MEGAPATCH_ALIGN_FP8_TRANSPOSES)" in on.log, on.tail()
    # no FP8 parameters on CPU: the job log says the alignment passes through, and why
    assert "fp8.align_transposes was requested but passes through: no FP8 parameters" in on.log, \
        on.tail()
    assert "fp8.align_transposes" not in off.log


def test_mismatched_rank_stops_with_cross_rank_error(checkout, tmp_path):
    """Rank 1 launched with a different MEGAPATCH_TP_REDUCE_DTYPE: the job stops with megapatch's
    cross-rank error, well before the check timeout, instead of hanging or training."""
    wrapper = tmp_path / "one_rank_differs.sh"
    wrapper.write_text(
        '#!/bin/sh\n'
        'if [ "$LOCAL_RANK" = "1" ]; then export MEGAPATCH_TP_REDUCE_DTYPE=native; fi\n'
        f'exec "{sys.executable}" -m megapatch.testing.ranks.cpu_launch "$@"\n')
    # the check timeout is far beyond the job's deadline: a refusal that waited for it times out
    run, _ = _run(checkout, "tp2-mismatch", mlm.tiny_gpt_flags(tp=2, iters=2), nproc=2,
                  megapatch_env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_CHECK_TIMEOUT": "3600"},
                  entry=["--no-python", "sh", str(wrapper)], timeout=300)
    assert not run.timed_out, run.tail()
    assert run.returncode != 0, run.tail()
    assert "CrossRankMismatchError" in run.log, run.tail()
    assert "tp_reduce_dtype=native (this rank: fp32)" in run.log, run.tail()
    assert not run.losses, "a mismatched job trained"


@pytest.fixture(scope="session")
def pr6252_core(_checkouts, tmp_path_factory):
    """A checkout whose megatron-core has PR #6252's output_dtype (Megatron-LM main); its
    megatron/core imports on the Python megatron-core supports (only megatron/training needs 3.12)."""
    name = "main-d98e8a64"
    tarball = TARBALL_DIR / mlm.TARBALLS[name]
    if not tarball.is_file():
        pytest.skip(f"no Megatron-LM source with PR #6252: {tarball} is absent")
    if name not in _checkouts:
        _checkouts[name] = mlm.unpack(tarball, tmp_path_factory.mktemp(f"megatron-lm-{name}"))
    return _checkouts[name]


def test_fp32_logits_bypass_upstream_output_dtype_view(pr6252_core):
    """With a stand-in for TE's general_gemm, upstream's own FP32 output (PR #6252) is a view that
    megatron's cross entropy cannot train on; megapatch's FP32 logits (layer built with or without
    output_dtype) are exact, train, and leave the layer's output_dtype as it was."""
    env = environ_without_megapatch()
    env["PYTHONPATH"] = os.pathsep.join([str(pr6252_core), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, str(Path(REPO) / "tests" / "scripts" / "megatron_lm_logits_view.py")],
                            env=env, capture_output=True, text=True, timeout=300, cwd=str(pr6252_core))
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    upstream = report["upstream_fp32"]
    assert upstream["dtype"] == "torch.float32" and "is a view" in upstream["error"], upstream
    for case, before in (("megapatch_default_layer", "None"), ("megapatch_fp32_layer", "torch.float32")):
        got = report[case]
        assert got == {"output_dtype_before": before, "dtype": "torch.float32", "exact": True,
                       "trained": True, "output_dtype_after": before}, (case, got)
    assert "not megatron-core's own output_dtype (PR #6252)" in report["backend"]
    # a layer upstream was told to make BF16 (GPTModel(logit_dtype=torch.bfloat16)) is refused
    assert "output_dtype=torch.bfloat16" in report["megapatch_bf16_layer"], report["megapatch_bf16_layer"]
    assert "enable(logits_dtype='fp32')" in report["megapatch_bf16_layer"]


def test_launcher_stand_ins_restore_everything_and_only_report_types():
    """The CUDA stand-ins of the launcher are undone on exit; ``Tensor.type()`` reports a CUDA type
    name for CPU tensors inside, while conversions keep working (no numerics involved)."""
    from conftest import run_python

    result = run_python("""
        import torch
        from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds
        from megapatch.testing.stand_ins.cpu_streams import CpuSideStream
        from megapatch.testing.stand_ins.megatron_lm_compat import megatron_lm_workarounds, WORKAROUNDS
        names = [w.attr for w in WORKAROUNDS if w.module == "torch.cuda"]
        before = {n: getattr(torch.cuda, n) for n in names}
        x = torch.ones(2, dtype=torch.bfloat16)
        with megatron_lm_workarounds(), cpu_workarounds():
            assert torch.cuda.Stream is CpuSideStream  # whose record_event returns an event (MoE dispatcher)
            assert x.type() == "torch.cuda.BFloat16Tensor", x.type()
            assert x.type(torch.float32).dtype == torch.float32
            torch.cuda.set_rng_state(torch.cuda.get_rng_state())
            # the architecture query is answered in megatron.training.utils (when it is imported),
            # not by replacing torch.cuda.get_device_properties, which inductor reads too
            assert "get_device_properties" not in names
            assert any(w.module == "megatron.training.utils" and w.attr == "get_device_arch_version"
                       and w.make(None)() == 0 for w in WORKAROUNDS)
        assert {n: getattr(torch.cuda, n) for n in names} == before
        assert x.type() == "torch.BFloat16Tensor"
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_a_rank_that_raises_ends_the_job_instead_of_hanging(tmp_path):
    """Under the CPU launcher, rank 1 raising while rank 0 waits in a collective ends the whole job
    (non-zero, rank 1's traceback in the log) within seconds, instead of hanging until a timeout."""
    script = tmp_path / "raises_on_rank1.py"
    script.write_text(
        "import os, threading, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "threading.Thread(target=lambda: threading.Event().wait(), daemon=False).start()  # a non-daemon thread\n"
        "if dist.get_rank() == 1:\n"
        "    raise RuntimeError('psutil is not installed (stand-in for any rank failure)')\n"
        "dist.barrier()  # rank 0 waits for a peer that is gone\n")
    run = mlm.launch(tmp_path, [], nproc=2, script=str(script), timeout=300)
    assert not run.timed_out, run.tail()  # rank 0 would wait in its barrier until this deadline
    assert run.returncode != 0 and "psutil is not installed (stand-in" in run.log, run.tail()


def test_the_launcher_warns_when_the_padded_vocabulary_depends_on_the_tp_size():
    """Issue 28 item 5: only where the padded size really differs from the compared TP size's. The example flags once used --vocab-size 512 with NullTokenizer: 513 rows pad to 640 / 768 /
    1024 at TP 1 / 2 / 4, a different model at each TP size (iteration-1 loss 6.486 vs 6.676)."""
    from megapatch.testing.ranks.cpu_launch import padding_warning

    flags = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--tensor-model-parallel-size", "2"]
    warning = padding_warning(flags)
    assert warning and "TP=1: 640, TP=2: 768, TP=4: 1024, TP=8: 1024" in warning
    assert "this job, TP=2: 768" in warning and "--vocab-size 1023" in warning
    assert padding_warning(["--tokenizer-type", "NullTokenizer", "--vocab-size", "1023"]) is None
    # 511 + EOD pads to 512 at TP 1, 2 and 4: a warning only where the size really differs (TP 8)
    at = lambda tp, vocab="511": padding_warning(["--tokenizer-type", "NullTokenizer", "--vocab-size", vocab,
                                                  "--tensor-model-parallel-size", str(tp)])
    assert [at(tp) is None for tp in (1, 2, 4, 8)] == [True, True, True, False]
    assert "this job, TP=8: 1024" in at(8)
    assert "TP=2: 768" in at(1, "512")  # a TP=1 job whose TP=2 counterpart would differ
    assert padding_warning(["--tokenizer-type", "HuggingFaceTokenizer", "--vocab-size", "512"]) is None
    example = Path(REPO, "examples", "megatron_lm", "cpu_flags.sh").read_text()
    assert "--vocab-size 1023" in example and padding_warning(example.split()) is None


# Megatron-LM's own MoE RL example (examples/rl/model_configs/qwen3_30b_a3b_moe.sh) scaled down:
# 8 experts top-2 (128 top-8 there), QK layernorm, SwiGLU experts, GQA, RoPE, untied head, no
# biases, aux-loss balancing; expert TP = TP; local spec (sequential experts) on CPU.
MOE_FLAGS = LLAMA_FLAGS + ("--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                           "--qk-layernorm", "--moe-router-load-balancing-type", "aux_loss",
                           "--moe-aux-loss-coeff", "1e-3", "--no-bias-swiglu-fusion",
                           "--make-vocab-size-divisible-by", "32")
MOE_MODES = {"native": {}, "fp32": {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"},
             "fp32-accumulate": {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32-accumulate"},
             "fp32+logits": {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_LOGITS_DTYPE": "fp32"},
             "tp_invariant": {"MEGAPATCH_TP_INVARIANT": "1"}}


def _moe_run(checkout, tp, mode, dispatcher="alltoall", ep=1):
    # vocab 255 (+1 EOD) pads to 256 rows at TP 1, 2 and 4 (divisible by 32 x TP): one initial model
    flags = mlm.tiny_gpt_flags(tp=tp, heads=8, sequence_parallel=tp > 1, iters=ITERS, vocab=255, extra=(
        *MOE_FLAGS, "--moe-token-dispatcher-type", dispatcher, "--expert-model-parallel-size", str(ep),
        "--expert-tensor-parallel-size", str(tp)))
    return _run(checkout, f"moe-tp{tp}-ep{ep}-{dispatcher}-{mode}", flags, nproc=tp * ep,
                megapatch_env=MOE_MODES[mode])


@pytest.mark.slow
@pytest.mark.resumes
def test_moe_flags_train_in_every_mode_and_fp32_brings_tp_sizes_together(checkout):
    """pretrain_gpt.py with MoE flags at TP 1/2/4 and EP 2, both dispatchers, in every mode: each
    trains, the job log names tp_reduce.moe active and the doctor its coverage, FP32 logits reach the loss
    under logits_dtype=fp32;
    fp32's first-step per-token losses at TP 2 and 4 sit far closer to TP 1's than native's do.
    tp_invariant (issue 26) refuses expert parallelism with the allgather dispatcher before the
    first step, naming the flag (alltoall with EP, and expert TP = TP, run: below)."""
    refused, _ = _moe_run(checkout, 2, "tp_invariant", "allgather", ep=2)
    assert refused.returncode != 0 and not refused.losses, refused.tail()
    assert "megapatch tp_invariant=True does not support" in refused.log, refused.tail()
    assert "--expert-model-parallel-size" in refused.log, refused.tail()
    runs = {
        "tp1-native": _moe_run(checkout, 1, "native"), "tp1-fp32": _moe_run(checkout, 1, "fp32"),
        "tp2-native": _moe_run(checkout, 2, "native"), "tp2-fp32": _moe_run(checkout, 2, "fp32"),
        "tp4-native": _moe_run(checkout, 4, "native", "allgather"),
        "tp4-fp32": _moe_run(checkout, 4, "fp32", "allgather"),
        "tp2-ep2-accumulate": _moe_run(checkout, 2, "fp32-accumulate", ep=2),
        "tp2-logits": _moe_run(checkout, 2, "fp32+logits", "allgather"),
    }
    for label, (run, _) in runs.items():
        _trained(run, ITERS)
        if "fp32" in label or "logits" in label:
            assert "tp_reduce.moe" in run.active_patches, (label, run.tail())
    # the job log's patches line names the active patches only (issue 48 item 4); what tp_reduce.moe
    # covers is in `megapatch status` and the doctor, for the same flags
    flags = mlm.tiny_gpt_flags(tp=1, heads=8, iters=ITERS, vocab=255, extra=(
        *MOE_FLAGS, "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "1",
        "--expert-tensor-parallel-size", "1"))
    doctor = _doctor(checkout, flags, MOE_MODES["fp32"])
    assert "tp_reduce.moe" in doctor.stdout and "routed experts' fc2 partials" in doctor.stdout, doctor.stdout[-3000:]
    assert "tp_reduce.moe" not in runs["tp2-ep2-accumulate"][0].active_patches
    for probes, dtype in ((runs["tp2-logits"][1], "torch.float32"), (runs["tp2-fp32"][1], "torch.bfloat16")):
        assert {r["dtype"] for records in probes.values() for r in records} == {dtype}
    for tp in (2, 4):
        drift = {mode: mlm.mean_abs_difference(_first_step_token_losses(runs[f"tp{tp}-{mode}"][1]),
                                               _first_step_token_losses(runs[f"tp1-{mode}"][1]))
                 for mode in ("native", "fp32")}
        print(f"MoE first-step per-token loss drift from TP=1, TP={tp}: {drift}")  # results/moe.md
        assert drift["native"] > 0, f"native TP={tp} gave TP=1's losses: the comparison cannot tell"
        assert drift["fp32"] < 0.05 * drift["native"], (tp, drift)


@pytest.mark.slow
@pytest.mark.resumes
def test_tp_invariant_moe_prints_the_same_losses_and_grad_norms_at_tp_1_2_and_4_and_dp_3(checkout):
    """Issue 26: pretrain_gpt.py with the scaled-down Qwen3-30B-A3B MoE flags (QK norm, top-2
    softmax routing, aux and z losses, SwiGLU experts), alltoall dispatcher, expert TP = TP and
    sequence parallelism at TP > 1, a global batch of 6 single-sequence micro-batches: under
    tp_invariant TP 1, 2 and 4 print the same losses and grad norms, and give the same per-token
    losses, full-precision grad norms and replicated gradients (norms, QK norms, the routers' gates)
    at every step; native TP 2 drifts from TP 1 (the MoE test above: the comparison can fail).
    Issue 37: TP 1 at DP 3 (two micro-batches a rank; each rank's expert weight gradients terms of
    the exact data-parallel sum, where a DP-3 job was refused before) prints the same losses and
    grad norms and records the same full-precision norms as DP 1."""
    _tp_invariant_revision(checkout)
    found = {}
    for tp, dp in ((1, 1), (2, 1), (4, 1), (1, 3)):  # 4 KV groups: whole groups at TP 4
        flags = mlm.tiny_gpt_flags(tp=tp, heads=8, sequence_parallel=tp > 1, iters=ITERS, vocab=255,
                                   micro_batch=1, global_batch=6, extra=(
            *MOE_FLAGS, "--num-query-groups", "4", "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type",
            "alltoall", "--expert-tensor-parallel-size", str(tp)))
        label = f"moe-tp{tp}-dp{dp}-tp_invariant"
        run, probes = _run(checkout, label, flags, nproc=tp * dp, megapatch_env=MOE_MODES["tp_invariant"])
        found[tp, dp] = (_trained(run, ITERS), _grad_norms(run), _recorded_norms(checkout, label))
        if dp == 1:
            found[tp, dp] += ([r["loss"] for r in probes[0]], _recorded_norms(checkout, label, "replicated_grads"))
            assert len(found[tp, dp][1]) == ITERS and found[tp, dp][4] and all(found[tp, dp][4]), run.tail()
        assert "tp_invariant.moe" in run.active_patches, run.tail()
    doctor = _doctor(checkout, flags, MOE_MODES["tp_invariant"])
    assert doctor.returncode == 0 and "no requested patch refuses them" in doctor.stdout, doctor.stdout
    assert found[1, 1] == found[2, 1] == found[4, 1]
    assert found[1, 3] == found[1, 1][:3]


@pytest.mark.slow
@pytest.mark.resumes
@pytest.mark.timeout(1200)  # nine jobs (~200 s alone), beside other stages in CI
def test_tp_invariant_moe_resumes_at_another_tp_and_ep_size_bit_identically(checkout, tmp_path_factory):
    """Issue 26: the MoE flags at DP 2 (world 2 x TP): trained at TP 1 EP 1, saved (torch_dist),
    resumed at TP 1 EP 1, TP 1 EP 2 and TP 2 EP 2 -- an EP rank then computes experts on both
    data-parallel ranks' tokens, and the expert parameters' gradients and norm span EP ranks -- and
    (issue 37) at TP 2 EP 2 with micro-batches of 1 sequence instead of 2. Under tp_invariant every
    resume gives the TP 1 EP 1 resume's per-token losses, printed losses, grad norms and final
    checkpoint tensors (parameters, FP32 main parameters, Adam moments).
    What upstream (core_v0.16.1) does not allow here, and this test therefore leaves out: training
    from scratch at another EP size (expert weights are drawn from per-EP-rank RNG streams), and
    loading the optimizer state across an EP change (the chained optimizer's state has another
    number of entries at EP 1 and EP 2: "Expected 2 entries in state dict, but got 3"), so every
    resume starts a fresh optimizer state (--no-load-optim) from the same loaded weights, and the
    per-rank RNG state is not loaded (--no-load-rng; nothing draws random numbers after
    initialisation here). The same resumes again with --use-distributed-optimizer, from the same
    checkpoint (the optimizer state is not loaded): the expert parameters' grad buffers are then
    sharded over expert data parallelism, whose size the EP change halves."""
    from megapatch.testing.scenarios import tp_resume

    _tp_invariant_revision(checkout)

    def flags_for(layout, iters, extra):
        tp, ep, *mbs = layout  # micro-batch size 2 (one micro-batch per DP rank) unless given
        return mlm.tiny_gpt_flags(tp=tp, heads=8, sequence_parallel=tp > 1, iters=iters, vocab=255,
                                  micro_batch=mbs[0] if mbs else 2, extra=(
            *MOE_FLAGS, "--num-query-groups", "4", "--moe-z-loss-coeff", "1e-3", "--moe-token-dispatcher-type",
            "alltoall", "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", str(tp),
            "--ckpt-format", "torch_dist", *extra))

    layout = tp_resume.Layout(flags_for=flags_for, nproc_for=lambda layout: 2 * layout[0])
    work = tmp_path_factory.mktemp("moe-resume")
    full = None  # the plain variant's training run: the distributed one resumes from its checkpoint
    for variant, optimizer in (("plain", ()), ("distributed", ("--use-distributed-optimizer",
                                                              "--dist-ckpt-optim-fully-reshardable"))):
        runs = tp_resume.experiment(checkout[1], work / variant, MOE_MODES["tp_invariant"], probe=PROBE,
                                    train_tp=(1, 1), resume_tps=((1, 1), (1, 2), (2, 2), (2, 2, 1)), save_at=2,
                                    iters=4, label="moe", timeout=TIMEOUT, layout=layout,
                                    start=full.checkpoint.parent if full else None,
                                    # the RNG state is saved per (TP, EP) rank and not resharded; nothing
                                    # here draws random numbers after initialisation (no dropout)
                                    extra=("--no-load-rng", "--no-load-optim", *optimizer))
        full = full or runs["full"]
        _assert_moe_resumes_equal(runs, full, variant)


def _assert_moe_resumes_equal(runs, full, variant):
    from megapatch.testing.scenarios import tp_resume

    reference = runs["resume1x1"]
    # the weights loaded are the uninterrupted run's: its first resumed loss is too (then the fresh
    # optimizer state parts them)
    assert len(reference.loss_hashes) == 2 and reference.loss_hashes[0] == full.loss_hashes[-2], variant
    tensors = reference.tensors()
    assert any("experts" in key for key in tensors), sorted(tensors)[:10]
    for name in ("resume1x2", "resume2x2", "resume2x2x1"):
        run = runs[name]
        assert run.grad_norms == reference.grad_norms, (variant, name)
        if name == "resume2x2x1":
            # the printed loss is upstream's average of per-micro-batch FP32 averages: at another
            # micro-batch size it may move in its last printed digit (docs/tp_invariant.md); the
            # per-token losses come one hash per micro-batch (two per step here)
            assert run.losses.keys() == reference.losses.keys()
            assert all(abs(float(run.losses[i]) / float(reference.losses[i]) - 1) < 1e-6 for i in run.losses), name
        else:
            assert (run.loss_hashes, run.losses) == (reference.loss_hashes, reference.losses), (variant, name)
        assert not tp_resume.differences(run.tensors(), tensors), (variant, name)


@pytest.mark.slow
@pytest.mark.resumes
def test_tp_invariant_steps_are_the_same_at_any_data_parallel_size_pipeline_depth_and_micro_batch_size(checkout, tmp_path_factory):
    """Issue 37: the Llama flags, global batch 12 of single-sequence micro-batches, clipped Adam
    (--clip-grad 0.05: every step clipped). One run trains 3 iterations at TP 1 x DP 1, saving at
    iteration 1; from that checkpoint the same job resumes at TP 1 x DP 1, at TP 2 x DP 3 (6 ranks:
    4 micro-batches a rank; the loss seed and the DP sum at a size of 3) and at TP 1 x DP 2 x PP 2
    in micro-batches of 2 sequences (the grad norm added over two stages; per-sequence gradient
    terms). Every resume's full-precision grad norms and final
    checkpoint tensors (parameters, FP32 main parameters, Adam moments) equal the uninterrupted
    run's, and its printed losses and grad norms equal the TP 1 x DP 1 resume's (a fresh run prints
    the mean of its first two iterations' losses at iteration 2: upstream's logging). Native DP 3
    and DP 1 part at the first step: the test below."""
    from megapatch.testing.scenarios import layouts

    _tp_invariant_revision(checkout)
    work = tmp_path_factory.mktemp("layouts")
    env = {"MEGAPATCH_TP_INVARIANT": "1"}
    others = [layouts.Layout(tp=2, dp=3), layouts.Layout(dp=2, pp=2, mbs=2)]
    runs = layouts.experiment(checkout[1], work / "invariant", env, [layouts.Layout(), *others],
                              probe=PROBE, label="invariant", timeout=TIMEOUT)
    full, same = runs["full"], runs[layouts.Layout().label]
    assert sorted(full.losses) == [1, 2, 3] and len(full.exact_norms) == 3, full.run.tail()
    reference = full.tensors()
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in reference)
    assert sorted(same.losses) == [2, 3] and same.exact_norms == full.exact_norms[1:], same.run.tail()
    for layout in [layouts.Layout(), *others]:
        run = runs[layout.label]
        assert run.run.log.count("megapatch enabled:") == 1, run.run.tail()
        assert (run.losses, run.grad_norms, run.exact_norms) == (same.losses, same.grad_norms, same.exact_norms), \
            layout
        assert layouts.tp_resume.differences(reference, run.tensors()) == {}, layout


@pytest.mark.slow
@pytest.mark.resumes
def test_tp_invariant_moe_steps_are_the_same_at_micro_batch_sizes_and_data_parallel_sizes(checkout, tmp_path_factory):
    """Issue 37 on a Qwen3-MoE-shaped model (8 experts top-2, alltoall, QK RMSNorm, aux and z losses):
    a micro-batch's sequences share the router's and the experts' GEMMs and weight-gradient sums,
    and upstream pools their tokens into one load-balancing loss. Under the mode an MoE layer runs a
    micro-batch one sequence at a time (``tp_invariant.micro_batch``) and each aux loss is scaled by
    one over the global batch's sequences. Resumed from one checkpoint (TP 1 x DP 1, mbs 1, saved
    after one step), the next two steps at mbs 4 and at TP 2 x DP 2 mbs 2 (sequence parallelism,
    expert TP 2) leave all 48 checkpoint tensors and the full-precision grad norms as the
    uninterrupted run does. Without the per-sequence MoE run mbs 4 changed 43 of them; with it but
    the aux-loss scale of upstream's micro-batch, 46 (checked by hand, results/tp_invariant_layouts.md)."""
    from megapatch.testing.scenarios import layouts

    _tp_invariant_revision(checkout)
    L = layouts.Layout
    grid = [L(mbs=4), L(tp=2, dp=2, mbs=2)]
    runs = layouts.experiment(checkout[1], tmp_path_factory.mktemp("moe-layouts"), {"MEGAPATCH_TP_INVARIANT": "1"},
                              grid, probe=PROBE, label="moe", timeout=TIMEOUT,
                              extra=(*layouts.MOE, "--sequence-parallel"))  # SP: TP > 1 only
    full = runs["full"]
    reference = full.tensors()
    assert len(full.exact_norms) == 3 and any(".experts." in key for key in reference), full.run.tail()
    for layout in grid:
        run = runs[layout.label]
        assert "tp_invariant.moe_micro_batch" in run.run.active_patches, run.run.tail()
        assert run.exact_norms == full.exact_norms[1:], layout
        assert layouts.tp_resume.differences(reference, run.tensors()) == {}, layout


@pytest.mark.slow
@pytest.mark.resumes
def test_tp_invariant_tied_embeddings_step_is_the_same_at_micro_batch_sizes_and_pipeline_depths(
        checkout, tmp_path_factory):
    """Issue 37 with tied embeddings (the Llama flags without --untie-embeddings-and-output-weights).
    At PP 1 the word embedding's lookup and output-layer gradients stay separate terms of the exact
    sum at every micro-batch size (``block_tree.tied``); at PP 2 the first stage's lookup terms and
    the last stage's output-layer terms are merged over the embedding group before their one
    rounding (``tp_invariant.data_parallel``), where upstream adds the two stages' FP32 sums.
    Megatron-LM seeds each pipeline stage's weights differently, so the layouts resume one
    checkpoint saved at TP 1 x DP 1 after one step: the second step at DP 3 mbs 4, at PP 2, and
    (distributed optimizer: the tied weight's own bucket, reduce-scattered) at DP 2 x PP 2 mbs 2
    leaves all 32 checkpoint tensors as the uninterrupted run does, with its full-precision grad
    norm. Before the tied rule mbs 2 changed 24 of them; before the merge PP 2 changed 3 (the
    embedding's FP32 copy and Adam moments; results/tp_invariant_layouts.md)."""
    from megapatch.testing.scenarios import layouts

    _tp_invariant_revision(checkout)
    tied = tuple(a for a in layouts.LLAMA if a != "--untie-embeddings-and-output-weights")
    env = {"MEGAPATCH_TP_INVARIANT": "1"}
    L = layouts.Layout
    for name, extra, grid in (("plain", (), [L(dp=3, mbs=4), L(pp=2)]),
                              ("distributed", ("--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"),
                               [L(dp=2, pp=2, mbs=2)])):
        runs = layouts.experiment(checkout[1], tmp_path_factory.mktemp(f"tied-{name}"), env, grid, probe=PROBE,
                                  save_at=1, iters=2, extra=extra, label="tied", timeout=TIMEOUT, llama=tied)
        full = runs.pop("full")
        reference = full.tensors()
        assert "embedding.word_embeddings.weight" in reference and "output_layer.weight" not in reference
        assert len(reference) == 32 and len(full.exact_norms) == 2, full.run.tail()
        for label, run in runs.items():
            assert run.exact_norms == full.exact_norms[1:], (name, label, run.run.tail())
            assert layouts.tp_resume.differences(reference, run.tensors()) == {}, (name, label)


@pytest.mark.quick("tp_invariant.data_parallel", "tp_invariant.loss_scale", "tp_invariant.micro_batch")
def test_tp_invariant_first_step_is_the_same_at_data_parallel_sizes_1_and_3_and_micro_batch_sizes_1_2_4(
        checkout, tmp_path_factory):
    """Issue 37, the fast check: one clipped Adam step of the Llama flags on a global batch of 12
    sequences at DP 1 in 12 micro-batches of one sequence, at DP 1 in 3 micro-batches of 4
    (every weight gradient, the embedding's included, summed over 4 sequences inside a micro-batch),
    at DP 3 in 2 micro-batches of 2 a rank (the loss seed's 1/3, a three-rank sum, two sequences a
    micro-batch) and at DP 3 with the distributed optimizer (the sum reduce-scattered into each
    rank's shard): under the mode the full-precision grad norm and every parameter are bit-identical
    (and every checkpoint tensor between the plain runs), the printed loss too at mbs 1; natively DP 1 and DP 3 x mbs 2 are not
    (the comparison can fail). Oracle for the sum itself: the mode's norm is native's to 1e-4 (a sum
    left out, a sequence's term dropped or deposited twice, or a sum scaled twice is not)."""
    from megapatch.testing.scenarios import layouts

    _tp_invariant_revision(checkout)
    work = tmp_path_factory.mktemp("layouts-first-step")
    distopt = ("--use-distributed-optimizer",)
    L = layouts.Layout
    runs = {("invariant", L(), ()), ("invariant", L(mbs=4), ()), ("invariant", L(dp=3, mbs=2), ()),
            ("invariant", L(dp=3), distopt), ("native", L(), ()), ("native", L(dp=3, mbs=2), ())}
    found = {}
    for mode, layout, extra in sorted(runs, key=str):
        env = {"MEGAPATCH_TP_INVARIANT": "1"} if mode == "invariant" else {}
        found[mode, layout, extra] = layouts.train(checkout[1], work / mode, layout, env, probe=PROBE, iters=1,
                                                   extra=extra, timeout=TIMEOUT,
                                                   label=f"{mode}{'-distopt' if extra else ''}")
        assert len(found[mode, layout, extra].exact_norms) == 1, found[mode, layout, extra].run.tail()
    one, four = found["invariant", L(), ()], found["invariant", L(mbs=4), ()]
    three, sharded = found["invariant", L(dp=3, mbs=2), ()], found["invariant", L(dp=3), distopt]
    assert one.exact_norms == four.exact_norms == three.exact_norms == sharded.exact_norms
    assert one.losses == sharded.losses
    # the printed loss is the loss function's own FP32 sum over a micro-batch's tokens: at another
    # micro-batch size its last printed digit may move (results/tp_invariant_layouts.md); the bits
    # that train -- gradients, norms, parameters, moments -- may not
    for run in (four, three):
        assert all(abs(float(run.losses[i]) - float(one.losses[i])) <= 2e-6 * float(one.losses[i])
                   for i in one.losses) and run.losses.keys() == one.losses.keys(), run.losses
    assert layouts.tp_resume.differences(one.tensors(), four.tensors()) == {}
    assert layouts.tp_resume.differences(one.tensors(), three.tensors()) == {}
    parameters = {k: v for k, v in one.tensors().items() if not k.startswith("optimizer.")}
    assert len(parameters) >= 9  # embedding, output layer, final norm, six per-layer stacks
    assert layouts.tp_resume.differences(
        parameters, {k: v for k, v in sharded.tensors().items() if k in parameters}) == {}
    native_one, native_three = found["native", L(), ()], found["native", L(dp=3, mbs=2), ()]
    native_norm = float.fromhex(native_one.exact_norms[0])
    assert abs(float.fromhex(one.exact_norms[0]) - native_norm) <= 1e-4 * native_norm, (one.exact_norms, native_norm)
    assert native_one.exact_norms != native_three.exact_norms
    assert layouts.tp_resume.differences(native_one.tensors(), native_three.tensors())
