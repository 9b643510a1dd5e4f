"""Issue 36 items 2 and 3 (MoE): what the doctor and ``megapatch status`` say of MoE jobs, the
refusal tables entry by entry against the doctor and the run, and the MoE paths no other test
reached (the router's token blocks without sequence parallelism and on uneven sequences, a QK
LayerNorm's bias gradient, the alltoall combine's cast, a shared expert the width cannot cut).

The "run" side of each refusal is ``tp_invariant``'s construction check on a real megatron-core
``TransformerConfig`` (the field set on a copy, as a job's config holds it); the doctor side reads
Megatron-LM flags. The expected flags and values are written out here, not read from the tables.
"""

from __future__ import annotations

import copy
import importlib.util
import types

import pytest
import torch

from conftest import StandInGroup
from tests.test_doctor import _flags_survey

#: a covered Qwen3-MoE-shaped job at TP 2 (the doctor's side)
FLAGS = ["--tensor-model-parallel-size", "2", "--num-attention-heads", "8", "--hidden-size", "64",
         "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion",
         "--swiglu", "--num-experts", "8", "--moe-router-topk", "2", "--sequence-parallel",
         "--disable-bias-linear", "--seq-length", "32", "--moe-ffn-hidden-size", "32",
         "--moe-token-dispatcher-type", "alltoall"]


def _config(**fields):
    """The run's side: a real megatron-core TransformerConfig of the covered model at TP 2, with
    ``fields`` set on a copy after upstream's own checks (some are refused there on CPU first)."""
    from megapatch.testing.scenarios import moe_tiny

    config = copy.copy(moe_tiny.qwen3_moe_config(2, "alltoall", moe_aux_loss_coeff=0.0))
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def _run_refusal(config):
    """What the construction check (``TransformerBlock.__init__``'s wrapper) raises for ``config``."""
    import megapatch
    from megapatch.core.errors import MegapatchError
    from megapatch.patches.tp_invariant import construction

    megapatch.enable(tp_invariant=True)
    try:
        construction._check_config(config)
    except MegapatchError as exc:
        return str(exc)
    finally:
        megapatch.disable()
    return None


def _doctor_refusal(monkeypatch, flags):
    result = _flags_survey(monkeypatch, flags, MEGAPATCH_TP_INVARIANT="1")
    return result["flags"]["refusals"].get("tp_invariant.construction")


# -- the refusal table, entry by entry ------------------------------------------------------------

#: every entry of tp_invariant's MoE refusal table: (flags added to FLAGS, or removed with "-",
#: the config field's refused value, the flag both must name)
MOE_TABLE = {
    "moe_token_dispatcher_type": (["--moe-token-dispatcher-type", "flex"], "flex", "--moe-token-dispatcher-type"),
    "moe_permute_fusion": (["--moe-permute-fusion"], True, "--moe-permute-fusion"),
    "moe_router_fusion": (["--moe-router-fusion"], True, "--moe-router-fusion"),
    "moe_shared_expert_overlap": (["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"],
                                  True, "--moe-shared-expert-overlap"),
    "moe_shared_expert_gate": (["--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-gate"],
                               True, "--moe-shared-expert-gate"),
    "moe_expert_capacity_factor": (["--moe-expert-capacity-factor", "1.5"], 1.5, "--moe-expert-capacity-factor"),
    "moe_input_jitter_eps": (["--moe-input-jitter-eps", "0.01"], 0.01, "--moe-input-jitter-eps"),
    "moe_router_force_load_balancing": (["--moe-router-force-load-balancing"], True,
                                        "--moe-router-force-load-balancing"),
    "moe_latent_size": (["--moe-latent-size", "16"], 16, "--moe-latent-size"),
    "moe_router_dtype": (["--moe-router-dtype", "fp64"], "fp64", "--moe-router-dtype"),
    "moe_router_load_balancing_type": (["--moe-router-load-balancing-type", "sinkhorn"], "sinkhorn",
                                       "--moe-router-load-balancing-type"),
    "add_bias_linear": (["-", "--disable-bias-linear"], True, "--disable-bias-linear"),
}


def _flags_with(change):
    if change[:1] == ["-"]:
        return [f for f in FLAGS if f not in change[1:]]
    return FLAGS + change


def test_every_entry_of_the_moe_refusal_table_is_checked_here():
    """A misspelt key (``moe_router_force_load_balancng``) reads a field no config has and refuses
    nothing; a new entry needs its row above."""
    from megapatch.patches.tp_invariant._refusal_tables import MOE_REFUSED

    assert sorted(MOE_REFUSED) == sorted(MOE_TABLE)


def test_the_covered_job_is_refused_by_neither(monkeypatch):
    assert _doctor_refusal(monkeypatch, FLAGS) is None
    assert _run_refusal(_config()) is None


@pytest.mark.parametrize("field", sorted(MOE_TABLE))
def test_each_moe_refusal_is_made_by_the_doctor_and_the_run_naming_its_flag(monkeypatch, field):
    change, value, flag = MOE_TABLE[field]
    doctor = _doctor_refusal(monkeypatch, _flags_with(change))
    assert doctor is not None and flag in doctor and field in doctor, doctor
    run = _run_refusal(_config(**{field: value}))
    assert run is not None and flag in run and field in run and "tp_invariant was set by" in run, run


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_grouped_gemm_is_refused_without_te_and_covered_with_te_by_the_doctor_and_the_run(monkeypatch, impl):
    """``--moe-grouped-gemm`` builds the grouped_gemm package's GroupedMLP with local layers (refused)
    and TE's TEGroupedMLP with TE layers (run under the mode: tests/test_tp_invariant_transformer_engine.py)."""
    doctor = _doctor_refusal(monkeypatch, FLAGS + ["--moe-grouped-gemm", "--transformer-impl", impl])
    run = _run_refusal(_config(moe_grouped_gemm=True, transformer_impl=impl))
    for said in (doctor, run):
        if impl == "local":
            assert said is not None and "--moe-grouped-gemm" in said and "--transformer-impl local" in said, said
        else:
            assert said is None, said


@pytest.mark.parametrize("aux,z,refused", [
    (1e-2, None, True), (0.0, 1e-3, True), (1e-2, 1e-3, True), (0.0, None, False)],
    ids=["aux", "z-loss-alone", "both", "neither"])
def test_a_per_token_loss_is_refused_with_an_aux_or_a_z_loss_and_only_then(monkeypatch, aux, z, refused):
    flags = FLAGS + ["--calculate-per-token-loss", "--moe-aux-loss-coeff", str(aux)]
    flags += ["--moe-z-loss-coeff", str(z)] if z is not None else []
    doctor = _doctor_refusal(monkeypatch, flags)
    run = _run_refusal(_config(calculate_per_token_loss=True, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z))
    for said in (doctor, run):
        if refused:
            assert said is not None and "--calculate-per-token-loss" in said, said
        else:
            assert said is None, said


def test_a_shared_expert_ffn_the_width_cannot_cut_is_refused_by_the_doctor_and_the_run(monkeypatch):
    """W = 8 does not divide 36; 64 is covered (the alltoall variant of the MoE tests runs it)."""
    doctor = _doctor_refusal(monkeypatch, FLAGS + ["--moe-shared-expert-intermediate-size", "36"])
    run = _run_refusal(_config(moe_shared_expert_intermediate_size=36))
    for said in (doctor, run):
        assert said is not None and "--moe-shared-expert-intermediate-size" in said and "36" in said, said
    assert _doctor_refusal(monkeypatch, FLAGS + ["--moe-shared-expert-intermediate-size", "64"]) is None
    assert _run_refusal(_config(moe_shared_expert_intermediate_size=64)) is None


@pytest.mark.parametrize("qk", [True, False])
def test_the_doctor_reads_qk_layernorm_from_the_flags(monkeypatch, qk):
    """12 heads: W = 8 neither divides nor is a multiple of them, which only a QK norm's gradient
    minds (the head dimension 96 / 12 = 8 and the projections' sizes are fine)."""
    flags = FLAGS + ["--num-attention-heads", "12", "--hidden-size", "96"]  # argparse takes the last
    flags += ["--qk-layernorm"] if qk else []
    doctor = _doctor_refusal(monkeypatch, flags)
    if qk:
        assert doctor is not None and "--qk-layernorm" in doctor, doctor
    else:
        assert doctor is None, doctor


# -- the doctor says where upstream stops first ---------------------------------------------------

def _upstream_refuses_permute_fusion() -> bool:
    """Megatron-core's own verdict on ``--moe-permute-fusion`` here (its TransformerConfig)."""
    from megapatch.testing.scenarios import moe_tiny

    try:
        moe_tiny.qwen3_moe_config(1, "alltoall", moe_permute_fusion=True)
    except (ValueError, ImportError) as exc:  # 0.16.1's wheel: the fused functions' import fails
        return "fused" in str(exc)
    return False


def _upstream_refuses_grouped_gemm() -> bool:
    """What Megatron-LM's validate_args calls for ``--moe-grouped-gemm``."""
    try:
        return torch.cuda.get_device_capability()[0] < 8
    except Exception:  # noqa: BLE001 -- no CUDA: upstream's call raises
        return True


@pytest.mark.parametrize("extra,cause,upstream", [
    (["--expert-model-parallel-size", "2", "--num-experts", "7"],
     "--num-experts 7 is not a multiple of --expert-model-parallel-size 2", lambda: 7 % 2 != 0),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm without CUDA", _upstream_refuses_grouped_gemm),
    (["--moe-permute-fusion"], "--moe-permute-fusion without Transformer Engine", _upstream_refuses_permute_fusion),
], ids=["experts-per-ep", "grouped-gemm", "permute-fusion"])
@pytest.mark.parametrize("mode", ["MEGAPATCH_TP_INVARIANT", "MEGAPATCH_TP_REDUCE_DTYPE", None])
def test_where_upstream_stops_an_moe_job_first_the_doctor_says_so_before_any_megapatch_reason(
        monkeypatch, extra, cause, upstream, mode):
    from megapatch.commands.doctor_text import render_doctor

    if not upstream():
        pytest.skip("upstream runs this job here (CUDA or Transformer Engine present)")
    env = {mode: "1" if mode == "MEGAPATCH_TP_INVARIANT" else "fp32"} if mode else {}
    result = _flags_survey(monkeypatch, FLAGS + extra, **env)
    assert result["result"]["code"] == 1
    message = result["result"]["message"]
    assert message.startswith(f"with these Megatron-LM flags the job would stop before its first step: {cause}"), message
    assert any(stop.startswith(cause) for stop in result["flags"]["stops"]), result["flags"]["stops"]
    lines = render_doctor(result).splitlines()
    first = next(line for line in lines if "STOPS FIRST" in line or "REFUSED" in line)
    assert first.startswith(f"  STOPS FIRST, upstream: {cause}"), first


def test_a_covered_expert_parallel_job_does_not_stop(monkeypatch):
    result = _flags_survey(monkeypatch, FLAGS + ["--expert-model-parallel-size", "2"], MEGAPATCH_TP_INVARIANT="1")
    assert result["flags"]["stops"] == [] and result["result"]["code"] == 0, result["result"]


# -- megapatch status: each MoE patch's coverage and refusals ---------------------------------------

def _status(monkeypatch, **env):
    from megapatch.commands.doctor import survey
    from megapatch.commands.doctor_text import render_status

    import megatron.core  # noqa: F401 -- activation "not observed": no finding

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return render_status(survey())


def test_status_prints_what_tp_invariant_moe_covers_and_refuses(monkeypatch):
    text = _status(monkeypatch, MEGAPATCH_TP_INVARIANT="1")
    [line] = [line for line in text.splitlines() if line.startswith("  tp_invariant.moe: ")]
    for word in ("router", "shared experts", "alltoall", "--moe-token-dispatcher-type", "--moe-grouped-gemm",
                 "--moe-permute-fusion", "--moe-router-fusion", "--moe-shared-expert-overlap",
                 "--moe-shared-expert-gate", "--moe-expert-capacity-factor", "--moe-input-jitter-eps",
                 "--moe-router-force-load-balancing", "--moe-latent-size", "--moe-router-dtype",
                 "--moe-router-load-balancing-type", "--disable-bias-linear", "--expert-model-parallel-size",
                 "calculate_per_token_loss", "expert_tensor_parallel_size", "one expert per EP rank",
                 "TP, EP and data-parallel sizes", "and micro-batch sizes", "aux and z losses per sequence"):
        assert word in line, (word, line)


def test_status_prints_what_tp_reduce_moe_covers_under_fp32(monkeypatch):
    text = _status(monkeypatch, MEGAPATCH_TP_REDUCE_DTYPE="fp32")
    [line] = [line for line in text.splitlines() if line.startswith("  tp_reduce.moe: ")]
    assert "alltoall" in line and "allgather" in line and "refused: flex dispatcher" in line, line


def test_under_fp32_accumulate_status_says_tp_reduce_moe_is_not_used_and_who_serves_the_value(monkeypatch):
    """"not requested" read as "MoE not covered": at fp32-accumulate the experts' sums go through the
    collectives ``tp_reduce.megatron_core`` patches."""
    text = _status(monkeypatch, MEGAPATCH_TP_REDUCE_DTYPE="fp32-accumulate")
    [row] = [line for line in text.splitlines() if line.startswith("tp_reduce.moe ")]
    assert "not requested" not in row and "not used at tp_reduce_dtype=fp32-accumulate" in row, row
    assert "served by tp_reduce.megatron_core" in row, row
    [other] = [line for line in text.splitlines() if line.startswith("tp_invariant.moe ")]
    assert other.rstrip().endswith("not requested"), other  # its option asks for nothing


# -- any data-parallel size with experts; without DDP the tree's power of two is named ------------

@pytest.mark.parametrize("dp", [3, 6, 12])
def test_any_data_parallel_size_is_taken_with_experts_and_only_the_no_ddp_tree_needs_a_power_of_two(
        monkeypatch, dp):
    """Under DDP each source rank's expert weight gradient is a term of the exact data-parallel sum
    (any size; shown through pretrain_gpt.py at DP 1/2/3/4 by benchmarks/tp_invariant_moe_data_parallel.py
    and tests/test_megatron_lm.py); the fixed tree over the sources that serves a model without DDP
    refuses a size it cannot take, naming the remedy."""
    import megapatch
    from megatron.core import parallel_state

    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.numerics import gradient_terms
    from megapatch.patches.tp_invariant import _parallel_state

    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda *a, **k: dp)
    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda *a, **k: 1)
    monkeypatch.setattr(parallel_state, "get_expert_data_parallel_group", lambda *a, **k: None)
    megapatch.enable(tp_invariant=True)
    try:
        assert _parallel_state.data_parallel() == (1, dp, None)
        sources = gradient_terms.TokenSources((4,), (1,), None, dp)
        with pytest.raises(UnsupportedConfigurationError) as caught:
            gradient_terms.source_terms(torch.nn.Parameter(torch.zeros(2)), [torch.ones(2)], sources, torch.bfloat16)
    finally:
        megapatch.disable()
    message = str(caught.value)
    assert f"over {dp} data-parallel ranks" in message and "DistributedDataParallel" in message, message


# -- the router's token blocks without sequence parallelism and on uneven sequences ----------------

SEQ, BATCH, EXPERTS = 16, 2, 3


def _top_k_calls(tp: int, rank: int, sp: bool, seq: int = SEQ):
    """The rows each top-k call of the router sees on ``rank`` of TP ``tp`` (``sp``: sequence
    parallelism splits the sequence), through the mode's routing and per-block wrappers."""
    import megapatch
    from megapatch.patches.tp_invariant import _router

    whole = torch.arange(seq * BATCH * EXPERTS, dtype=torch.float32).view(seq, BATCH, EXPERTS)
    mine = whole.chunk(tp)[rank] if sp else whole
    router = types.SimpleNamespace(tp_group=StandInGroup(tp, rank), config=types.SimpleNamespace(sequence_parallel=sp))
    calls = []

    def top_k(logits, topk):
        calls.append(logits.clone())
        return logits, logits > 0

    def routing(logits):  # upstream's TopKRouter.routing: flattens [s, b, E] then calls top-k
        return _router.per_token_blocks(top_k, None, (logits.view(-1, EXPERTS), 2), {})

    megapatch.enable(tp_invariant=True)
    try:
        _router.router_routing(lambda logits: routing(logits), router, (mine,), {})
    finally:
        megapatch.disable()
    return calls, whole.view(-1, EXPERTS)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_the_router_sees_the_tp1_token_blocks_at_every_tp_size_with_or_without_sequence_parallelism(tp, sp):
    """Oracle: TP 1's top-k calls are W = 8 blocks of 4 consecutive rows of the flattened [s, b];
    without sequence parallelism every rank holds the whole sequence and makes the same 8 calls, with
    it rank r makes the calls of its W/t blocks."""
    rows = SEQ * BATCH // 8
    for rank in range(tp):
        calls, whole = _top_k_calls(tp, rank, sp)
        blocks = [whole[i * rows:(i + 1) * rows] for i in range(8)]
        expected = blocks[rank * 8 // tp:(rank + 1) * 8 // tp] if sp else blocks
        assert len(calls) == len(expected) and all(torch.equal(a, b) for a, b in zip(calls, expected)), (tp, rank)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_sequence_the_width_does_not_divide_is_one_top_k_call_without_sequence_parallelism(tp):
    calls, whole = _top_k_calls(tp, tp - 1, False, seq=12)
    assert len(calls) == 1 and torch.equal(calls[0], whole)


def test_a_sequence_the_width_does_not_divide_is_refused_with_sequence_parallelism_naming_it():
    from megapatch.core.errors import OptionError

    with pytest.raises(OptionError, match="the sequence .*has size 12"):
        _top_k_calls(2, 1, True, seq=12)


# -- a QK LayerNorm's bias gradient ---------------------------------------------------------------

@pytest.mark.parametrize("heads", [16, 8])
def test_a_qk_layernorm_bias_gradient_sums_its_heads_in_the_fixed_tree(heads):
    """Every QK-norm test was RMSNorm (no bias). A torch LayerNorm QK norm under the mode: its bias
    gradient, a sum over tokens and heads, is the fixed tree over W = 8 head leaves (computed here
    from an FP64 sum per leaf), not a sum over token blocks. Planted leaf totals whose FP32 sum
    depends on the order, each leaf's halves on two tokens and two of its heads."""
    import megapatch
    from megapatch.numerics.block_tree import tree_sum
    from megapatch.numerics.token_tree import _token_tree
    from megapatch.patches.tp_invariant import _norms

    w, s, b, d = 8, 4, 2, 3
    per_leaf = heads // w
    totals = [2.0 ** 24, 1.0, 1.0, -(2.0 ** 24), 3.0, 1.0, -3.0, 1.0]
    grad = torch.zeros(s, b, heads, d)
    for leaf, total in enumerate(totals):
        grad[leaf % s, 0, leaf * per_leaf] = total / 2
        grad[(leaf + 1) % s, 1, (leaf + 1) * per_leaf - 1] = total / 2
    exact = [grad.double()[:, :, i * per_leaf:(i + 1) * per_leaf].sum(dim=(0, 1, 2)).float() for i in range(w)]
    oracle = tree_sum(exact)
    token_blocks = _token_tree(grad, None, None, w, False)  # the same blocks over tokens, heads not leaves
    assert not torch.equal(oracle, token_blocks), "the order must matter for this test"
    norm = torch.nn.LayerNorm(d)
    hidden = torch.randn(s, b, heads, d)
    megapatch.enable(tp_invariant=True)
    try:
        _norms.token_blocked_norm(norm, heads=True)
        norm(hidden).backward(grad)
    finally:
        megapatch.disable()
    assert torch.equal(norm.bias.grad, oracle), (norm.bias.grad, oracle)


def test_the_moe_preflight_file_runs_against_megatron_core():
    """The tests above need megatron-core (the doctor's flags are read for it)."""
    assert importlib.util.find_spec("megatron.core") is not None
