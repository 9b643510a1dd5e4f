"""FP32 sums in megatron-core's mixture-of-experts layers (patches/tp_reduce/moe.py), on real
megatron-core MoE layers run on CPU ranks (the labelled stand-ins of
megapatch/testing/stand_ins/moe_cpu.py), against independent oracles: the same model at TP=1
(the layout without TP partials), the same weights run in FP32, plain torch hooks."""

from __future__ import annotations

import pytest
import torch

from conftest import bare_module
from megapatch.testing import run_ranks
from megapatch.testing.scenarios import moe_tiny
from tests.test_tp_reduce_megatron_core import _needs_fp32_reductions



def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def _changed_choices(routing, reference) -> int:
    """(token, layer) pairs whose top-k expert set differs from the reference's."""
    assert len(routing) == len(reference) > 0
    return sum(int((a != b).any(-1).sum()) for a, b in zip(routing, reference))


def _relative(a: torch.Tensor, reference: torch.Tensor) -> float:
    return ((a.double() - reference.double()).norm() / reference.double().norm()).item()


def _layouts(dispatcher, layouts, modes, **kwargs):
    return {(tp, ep): run_ranks(moe_tiny.moe_forward, world_size=tp * ep, tp=tp, timeout=300,
                                args=(modes, dispatcher, ep), kwargs=kwargs)[0]
            for tp, ep in layouts}


@pytest.mark.parametrize("dispatcher,layouts,overrides", [
    ("alltoall", [(1, 1), (2, 1), (4, 1), (2, 2)], {}),
    # shared experts (DeepSeek / Qwen2-MoE style), their fc2 reduced by the layer itself
    ("allgather", [(1, 1), (2, 1), (4, 1)], {"moe_shared_expert_intermediate_size": 48}),
], ids=["alltoall-ep", "allgather-shared-experts"])
def test_fp32_moe_sums_make_tp_and_ep_sizes_agree_and_keep_every_expert_choice(dispatcher, layouts, overrides):
    """Native TP drift changes expert choices on this model; under fp32 every layout routes every
    token as TP=1 does and KL(TP1 || TP) falls at least 20x. The error against the FP32 run of the
    same weights stays at TP=1's BF16 error: FP32 sums make TP sizes agree, they do not make BF16
    megatron more accurate than TP=1 is."""
    _needs_fp32_reductions()
    modes = ("native", "fp32")
    runs = _layouts(dispatcher, layouts, modes, config_overrides=overrides)
    reference = run_ranks(moe_tiny.fp32_reference, world_size=1, tp=1,
                          kwargs=dict(dispatcher=dispatcher, config_overrides=overrides))[0]
    base = {mode: runs[(1, 1)][mode] for mode in modes}
    native_flips = 0
    for (tp, ep), run in runs.items():
        native, fp32 = run["native"], run["fp32"]
        assert native["dtype"] == fp32["dtype"] == "torch.bfloat16"
        assert any(name == "tp_reduce.moe" for name in fp32["active"]), fp32["active"]
        assert _changed_choices(fp32["routing"], base["fp32"]["routing"]) == 0, (tp, ep)
        native_flips += _changed_choices(native["routing"], base["native"]["routing"])
        kl_native, kl_fp32 = _kl(base["native"]["logits"], native["logits"]), _kl(base["fp32"]["logits"], fp32["logits"])
        if tp > 1:
            assert kl_fp32 * 20 <= kl_native, (tp, ep, kl_fp32, kl_native)
        tp1_error = _relative(base["native"]["logits"], reference["logits"])
        assert _relative(fp32["logits"], reference["logits"]) == pytest.approx(tp1_error, rel=0.05)
    assert native_flips > 0  # the input makes native drift visible (else the test could not fail)



#: issue 36's probe, scaled to this harness: the Qwen3-MoE of results/moe_hf.md (hidden 128, 8 heads in
#: 4 KV groups of 16, 8 experts top-2 with FFN 64, QK RMSNorm, vocab 256, 4 x 128 tokens, the delimiter
#: every 16 positions) with 3 MoE layers and its planted outlier channels; four (weight seed, batch
#: seed) variants, fixed before the first measurement
OUTLIER_SHAPE = dict(num_layers=3, hidden_size=128, ffn_hidden_size=256, num_query_groups=4, kv_channels=16,
                     moe_ffn_hidden_size=64)
OUTLIER_VARIANTS = ((1234, 5), (1234, 6), (99, 5), (99, 6))


def _outlier_moe_forward(ctx, variants, modes=("native", "fp32"), vocab=256, batch=4, seq_len=128):
    """Per (weight seed, batch seed, mode): the gathered logits and every layer's expert choices at
    this job's TP size (SP, alltoall, expert TP = TP), the same full weights at every TP size."""
    import megapatch

    results = {}
    config = moe_tiny.qwen3_moe_config(ctx.tp_size, "alltoall", **OUTLIER_SHAPE)
    for weight_seed, batch_seed in variants:
        model = moe_tiny.build_full_then_shard(
            ctx, 1, config, seed=weight_seed, vocab=vocab, seq_len=seq_len,
            full_weights=moe_tiny.outlier_weights(weight_seed, OUTLIER_SHAPE["moe_ffn_hidden_size"]))
        routing = moe_tiny._record_routing(model, ctx)
        data = moe_tiny.delimited_batch(batch_seed, batch, seq_len, vocab)
        for mode in modes:
            megapatch.disable()
            if moe_tiny.MODES[mode]:
                megapatch.enable(**moe_tiny.MODES[mode])
            routing.clear()
            with torch.no_grad():
                logits = model(data.tokens, data.position_ids, data.attention_mask)
            from megapatch.testing.models.tiny_gpt import gather_tp_logits

            results[(weight_seed, batch_seed, mode)] = {"logits": gather_tp_logits(logits, ctx).float(),
                                                        "routing": [r.clone() for r in routing]}
        megapatch.disable()
    return results if ctx.rank == 0 else None


def _unflipped_kl(run, base):
    """(KL(base || run) averaged over the tokens whose expert set is the base's in every layer, the
    share of (token, layer) pairs routed otherwise). Routing maps are sequence-major, logits
    [batch, seq, vocab]."""
    batch, seq = base["logits"].shape[:2]
    flips = torch.stack([(a != b).any(-1) for a, b in zip(run["routing"], base["routing"])])
    kept = ~flips.any(0).view(seq, batch).T
    p, q = torch.log_softmax(base["logits"].double(), -1), torch.log_softmax(run["logits"].double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return kl[kept].mean().item(), flips.float().mean().item()


def test_fp32_moe_at_tp4_with_sp_and_outlier_channels_is_as_close_to_tp1_as_tp2_on_unflipped_tokens():
    """Issue 36: on a Qwen3-MoE shape with outlier channels (SP, alltoall, expert TP = TP), fp32 at
    TP 4 stays as close to TP 1 as TP 2 does on the tokens whose routing did not change (mean over
    four variants within 10x; measured 1.1x), cuts native's KL(TP1 || TP4) on those tokens at
    least 50x (measured 116x; TP 2: 66x, asserted 30x; what is left is FP32 sums rounded once on the other side of a BF16
    rounding boundary than TP 1's, amplified by the later layers; only tp_invariant removes it,
    results/moe.md), and makes expert-choice changes rare (<= 0.2% of (token, layer) pairs, measured
    0.03% at TP 2 and 0.08% at TP 4; native 1.3-1.5%) -- rare, not impossible: near-ties still flip."""
    _needs_fp32_reductions()
    runs = {tp: run_ranks(_outlier_moe_forward, world_size=tp, tp=tp, timeout=600, args=(OUTLIER_VARIANTS,))[0]
            for tp in (1, 2, 4)}
    kl = {}
    flips = {}
    for mode in ("native", "fp32"):
        for tp in (2, 4):
            found = [_unflipped_kl(runs[tp][(*v, mode)], runs[1][(*v, mode)]) for v in OUTLIER_VARIANTS]
            for v, (k, f) in zip(OUTLIER_VARIANTS, found):
                print(f"variant {v} {mode} TP{tp}: unflipped-token KL(TP1 || TP{tp}) {k:.2e}, expert choices "
                      f"changed {f:.2%}")
            kl[(mode, tp)] = sum(k for k, _ in found) / len(found)
            flips[(mode, tp)] = sum(f for _, f in found) / len(found)
    print({k: f"KL {v:.2e}, flips {flips[k]:.2%}" for k, v in kl.items()})
    assert flips[("native", 4)] >= 0.005 and flips[("native", 2)] >= 0.005, flips  # else the test could not fail
    assert kl[("fp32", 4)] <= 10 * kl[("fp32", 2)], kl  # a TP4-only rounding of the partials: 24x
    assert kl[("fp32", 4)] * 50 <= kl[("native", 4)], kl  # measured 116x
    assert kl[("fp32", 2)] * 30 <= kl[("native", 2)], kl  # measured 66x
    assert flips[("fp32", 4)] <= 0.002 and flips[("fp32", 2)] <= 0.002, flips

def _expert_sum_dtypes(ctx, dispatcher, mode):
    """Under each mode: the dtype every RowParallelLinear inside the MoE layers (routed and shared
    experts' fc2) hands on, the dtype the dispatcher's reduce-scatter sums in, and the dtype of the
    MoE layers' outputs, recorded with plain forward hooks and a spy on the collective."""
    import megapatch
    from megatron.core.tensor_parallel import RowParallelLinear, mappings
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if mode != "native":
        megapatch.enable(tp_reduce_dtype=mode)
    model = moe_tiny.build(moe_tiny.qwen3_moe_config(ctx.tp_size, dispatcher,
                                                     moe_shared_expert_intermediate_size=48))
    seen = {"fc2": set(), "moe_out": set(), "summed": set()}
    for name, module in model.named_modules():
        if isinstance(module, RowParallelLinear) and ".mlp." in f".{name}.":
            module.register_forward_hook(lambda m, a, out: seen["fc2"].add(str(out[0].dtype)))
        if isinstance(module, MoELayer):
            module.register_forward_hook(lambda m, a, out: seen["moe_out"].add(str(out[0].dtype)))
    original = mappings._reduce_scatter_along_first_dim

    def spy(input_, *args, **kwargs):
        seen["summed"].add(str(input_.dtype))
        return original(input_, *args, **kwargs)

    mappings._reduce_scatter_along_first_dim = spy
    try:
        batch = moe_tiny.make_batch_for_model()
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
        logits.float().sum().backward()
    finally:
        mappings._reduce_scatter_along_first_dim = original
        megapatch.disable()
    return {k: sorted(v) for k, v in seen.items()}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_fp32_keeps_expert_partials_fp32_into_the_dispatcher_and_rounds_once_at_the_layer(dispatcher):
    _needs_fp32_reductions()
    native = run_ranks(_expert_sum_dtypes, world_size=2, tp=2, args=(dispatcher, "native"))[0]
    fp32 = run_ranks(_expert_sum_dtypes, world_size=2, tp=2, args=(dispatcher, "fp32"))[0]
    assert native == {"fc2": ["torch.bfloat16"], "moe_out": ["torch.bfloat16"], "summed": ["torch.bfloat16"]}
    assert fp32["fc2"] == ["torch.float32"] and fp32["moe_out"] == ["torch.bfloat16"]
    assert "torch.float32" in fp32["summed"]


def _construct(ctx, overrides):
    import megapatch
    from megapatch.core.errors import UnsupportedConfigurationError

    megapatch.enable(tp_reduce_dtype="fp32")
    try:
        moe_tiny.build(moe_tiny.qwen3_moe_config(ctx.tp_size, **overrides))
    except UnsupportedConfigurationError as exc:
        return str(exc)
    finally:
        megapatch.disable()
    return None


@pytest.mark.parametrize("overrides,named", [
    ({"dispatcher": "flex"}, "--moe-token-dispatcher-type flex"),
    # the grouped_gemm package's GroupedMLP (--transformer-impl local); TE's grouped experts are covered
    ({"moe_grouped_gemm": True, "transformer_impl": "local"}, "--moe-grouped-gemm"),
], ids=["flex", "grouped-gemm-without-te"])
def test_moe_paths_fp32_does_not_reach_are_refused_at_construction_naming_the_flag(overrides, named):
    _needs_fp32_reductions()
    message = run_ranks(_construct, world_size=1, tp=1, args=(overrides,))[0]
    assert message is not None and named in message, message
    assert "tp_reduce_dtype was set by" in message and "fp32-accumulate" in message


@pytest.mark.quick("tp_reduce.moe")
def test_status_names_the_moe_paths_covered_and_refused():
    import megapatch
    from megapatch.core import engine

    _needs_fp32_reductions()
    megapatch.enable(tp_reduce_dtype="fp32")
    try:
        patch = next(p for p in engine.patches() if p.name == "tp_reduce.moe")
        backend = patch.backend()
    finally:
        megapatch.disable()
    for path in ("allgather", "alltoall", "shared experts", "top-k combine", "refused: flex dispatcher",
                 "grouped-GEMM"):
        assert path in backend, backend


MOE_FLAGS = ["--tensor-model-parallel-size", "2", "--num-attention-heads", "8", "--transformer-impl", "local",
             "--no-gradient-accumulation-fusion", "--no-bias-swiglu-fusion", "--swiglu", "--num-experts", "8",
             "--moe-router-topk", "2", "--sequence-parallel"]


@pytest.mark.parametrize("extra,refused", [
    (["--moe-token-dispatcher-type", "alltoall"], None),
    (["--moe-token-dispatcher-type", "alltoall", "--moe-token-dispatcher-type", "flex"],
     "--moe-token-dispatcher-type flex"),  # argparse takes the last
    (["--moe-grouped-gemm"], "--moe-grouped-gemm"),
], ids=["alltoall", "flex", "grouped-gemm"])
def test_doctor_says_which_moe_flags_fp32_refuses_as_the_run_does(extra, refused):
    from tests.test_doctor import _cli

    result = _cli(["doctor", "--", *MOE_FLAGS, *extra], env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    if refused is None:
        assert result.returncode == 0 and "no requested patch refuses them" in result.stdout, result.stdout
        return
    assert result.returncode == 1, result.stdout + result.stderr
    assert refused in result.stdout and "tp_reduce.moe" in result.stdout, result.stdout
    # without the mode no megapatch patch refuses; only upstream's own stop (grouped GEMM needs CUDA) is named
    native = _cli(["doctor", "--", *MOE_FLAGS, *extra])
    assert "no requested patch refuses them" in native.stdout, native.stdout
    upstream_stops = "the job would stop before its first step" in native.stdout
    assert upstream_stops == (refused == "--moe-grouped-gemm"), native.stdout
    assert native.returncode == (1 if upstream_stops else 0), native.stdout


@pytest.mark.quick("tp_reduce.moe")
@pytest.mark.parametrize("cast, renamed, where", [
    ("self.local_probs.dtype", "self.probs_dtype", "MoEAllGatherTokenDispatcher.token_combine"),
    # the allgather dispatcher's cast is not the only one the FP32 swap relies on: an alltoall
    # combine casting by another attribute would round the FP32 partials silently
    ("self.probs.dtype", "self.hidden_shape_dtype", "MoEAlltoAllTokenDispatcher.combine_preprocess"),
])
def test_the_probe_refuses_a_dispatcher_that_no_longer_casts_by_the_swapped_attribute(monkeypatch, cast,
                                                                                     renamed, where):
    import inspect

    from megapatch.patches.tp_reduce import moe as tp_reduce_moe

    _needs_fp32_reductions()
    assert tp_reduce_moe._probe() is None
    original = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: original(obj).replace(cast, renamed))
    reason = tp_reduce_moe._probe()
    assert reason is not None and where in reason, reason


def test_te_routed_experts_are_marked_and_what_fp32_does_not_reach_is_refused_naming_it():
    """A routed expert's TE fc2 (TERowParallelLinear in a SequentialMLP: TE sums nothing, the
    dispatcher does) is marked to hand on its FP32 accumulator (tp_reduce.transformer_engine; run in
    tests/test_te_runtime.py, CI's te stage, with TE's grouped experts too); refused: one with a bias
    (TE fuses it into the GEMM), shared experts' TE fc2 (it reduces over TP inside TE, rounded),
    grouped-GEMM experts without TE (no fc2 module). Stand-in layers of each shape, as MoELayer holds
    them."""
    import types

    import megapatch
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.tp_reduce import _reduction
    from megapatch.patches.tp_reduce import moe as tp_reduce_moe

    _needs_fp32_reductions()
    config = types.SimpleNamespace(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)
    FakeTELinear = type("TERowParallelLinear", (torch.nn.Linear,), {"__module__": "megatron.core.extensions.transformer_engine"})

    def experts(bias=False):
        expert = torch.nn.Module()
        expert.linear_fc2 = FakeTELinear(2, 2, bias=bias)
        expert.linear_fc2.use_bias = bias
        sequential = torch.nn.Module()
        sequential.local_experts = torch.nn.ModuleList([expert])
        return sequential

    shared = torch.nn.Module()
    shared.linear_fc2 = FakeTELinear(2, 2)
    grouped = type("GroupedMLP", (torch.nn.Module,), {})()
    megapatch.enable(tp_reduce_dtype="fp32")
    try:
        routed = experts()
        tp_reduce_moe._mark(types.SimpleNamespace(config=config, experts=routed, shared_experts=None))
        assert getattr(routed.local_experts[0].linear_fc2, _reduction.MOE_FP32_SUM, False)
        for layer, named in (
                ((experts(bias=True), None), "experts.local_experts.0.linear_fc2: a Transformer Engine expert fc2 "
                                             "with a bias (Megatron-LM: --disable-bias-linear)"),
                ((experts(), shared), "shared_experts.linear_fc2 of type TERowParallelLinear (Transformer Engine "
                                      "shared experts; Megatron-LM: --transformer-impl local)"),
                ((grouped, None), "experts of type GroupedMLP: grouped-GEMM experts without Transformer Engine "
                                  "(Megatron-LM: --moe-grouped-gemm with --transformer-impl local")):
            layer = types.SimpleNamespace(config=config, experts=layer[0], shared_experts=layer[1])
            with pytest.raises(UnsupportedConfigurationError, match="does not cover this MoE layer") as refused:
                tp_reduce_moe._mark(layer)
            assert named in str(refused.value), str(refused.value)
    finally:
        megapatch.disable()


# -- the MoE patch's pieces, in-process (the rank jobs above show them end to end) ----------------

def _settings(monkeypatch, mode):
    from megapatch.core import options, state

    monkeypatch.setattr(state, "_current", options.Settings(tp_reduce_dtype=mode))


def test_the_probabilities_are_swapped_for_fp32_only_around_an_fp32_sum_of_low_precision_probabilities(monkeypatch):
    """The dispatcher casts the expert outputs to ``probs.dtype`` before summing: for the call, and
    only under fp32 with FP32 expert outputs and BF16/FP16 probabilities, ``probs`` is an FP32 copy
    (FP32 probabilities -- ``moe_router_dtype='fp32'`` -- or none need nothing); the dispatcher gets
    its own tensor back afterwards, also when the call raises."""
    import types

    from megapatch.patches.tp_reduce.moe import _probs_as_fp32

    probs = torch.tensor([0.3, 0.7], dtype=torch.bfloat16)
    fp32_out, bf16_out = torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)
    for mode, hidden, held, swapped in (("fp32", fp32_out, probs, True), ("fp32", bf16_out, probs, False),
                                        ("fp32", fp32_out, probs.half(), True), ("fp32", fp32_out, probs.float(), False),
                                        ("fp32-accumulate", fp32_out, probs, False), ("native", fp32_out, probs, False)):
        _settings(monkeypatch, mode)
        dispatcher = types.SimpleNamespace(probs=held)
        with _probs_as_fp32(dispatcher, "probs", hidden):
            during = dispatcher.probs
        assert dispatcher.probs is held, (mode, hidden.dtype, held.dtype)
        if swapped:
            assert during.dtype == torch.float32 and torch.equal(during, held.float()), (mode, held.dtype)
        else:
            assert during is held, (mode, hidden.dtype, held.dtype)
    _settings(monkeypatch, "fp32")
    with _probs_as_fp32(types.SimpleNamespace(), "probs", fp32_out):  # not set yet: nothing to swap
        pass
    dispatcher = types.SimpleNamespace(local_probs=probs)
    with pytest.raises(RuntimeError, match="in the combine"):
        with _probs_as_fp32(dispatcher, "local_probs", fp32_out):
            assert dispatcher.local_probs.dtype == torch.float32
            raise RuntimeError("in the combine")
    assert dispatcher.local_probs is probs


def test_the_moe_layer_rounds_its_fp32_sum_once_to_its_input_dtype_and_refuses_a_rounded_one(monkeypatch):
    import types

    from megapatch.core.errors import UpstreamSurfaceError
    from megapatch.patches.tp_reduce import moe as tp_reduce_moe

    marked = []
    monkeypatch.setattr(tp_reduce_moe, "_mark", marked.append)
    layer = types.SimpleNamespace()
    sums = torch.tensor([1.0 + 2 ** -12, 3.0])  # not a BF16 value: rounded once at the layer
    fp32_experts = lambda hidden_states: (sums, "bias")  # noqa: E731
    for dtype in (torch.bfloat16, torch.float16):
        _settings(monkeypatch, "fp32")
        hidden = torch.zeros(2, dtype=dtype)
        out, bias = tp_reduce_moe._moe_forward(fp32_experts, layer, (hidden,), {})
        assert out.dtype == dtype and torch.equal(out, sums.to(dtype)) and bias == "bias" and marked.pop() is layer
        out, _ = tp_reduce_moe._moe_forward(fp32_experts, layer, (), {"hidden_states": hidden})
        assert out.dtype == dtype and marked.pop() is layer
        with pytest.raises(UpstreamSurfaceError, match=f"the MoE layer's experts produced {dtype}, not their FP32 sum"):
            tp_reduce_moe._moe_forward(lambda hidden_states: (hidden_states, None), layer, (hidden,), {})
        assert marked.pop() is layer
        for mode in ("native", "fp32-accumulate"):  # not this patch's mode: upstream's forward as it is
            _settings(monkeypatch, mode)
            assert tp_reduce_moe._moe_forward(fp32_experts, layer, (hidden,), {})[0] is sums
    _settings(monkeypatch, "fp32")
    assert tp_reduce_moe._moe_forward(fp32_experts, layer, (torch.zeros(2),), {})[0] is sums  # an FP32 model
    assert marked == []


def test_construction_refuses_before_upstream_builds_and_marks_after_and_only_under_fp32(monkeypatch):
    import types

    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.tp_reduce import moe as tp_reduce_moe

    built, marked = [], []
    monkeypatch.setattr(tp_reduce_moe, "_mark", marked.append)
    flex = types.SimpleNamespace(moe_token_dispatcher_type="flex", moe_grouped_gemm=False)
    alltoall = types.SimpleNamespace(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)
    layer = types.SimpleNamespace()
    construct = lambda config, **kwargs: built.append(config) or "built"  # noqa: E731
    _settings(monkeypatch, "fp32")
    with pytest.raises(UnsupportedConfigurationError, match="moe_token_dispatcher_type='flex'"):
        tp_reduce_moe._moe_init(construct, layer, (flex,), {})
    with pytest.raises(UnsupportedConfigurationError, match="moe_token_dispatcher_type='flex'"):
        tp_reduce_moe._moe_init(construct, layer, (), {"config": flex})
    assert built == [] and marked == []  # refused before upstream built anything (DeepEP)
    assert tp_reduce_moe._moe_init(construct, layer, (alltoall,), {}) == "built"
    assert built == [alltoall] and marked == [layer]
    for mode in ("native", "fp32-accumulate"):
        _settings(monkeypatch, mode)
        assert tp_reduce_moe._moe_init(construct, layer, (flex,), {}) == "built"
    assert built == [alltoall, flex, flex] and marked == [layer]


def test_the_preflight_names_each_moe_path_fp32_does_not_reach_and_nothing_for_a_dense_model():
    import types

    from megapatch.patches.tp_reduce.moe import _preflight

    def config(**fields):
        return types.SimpleNamespace(**{"num_moe_experts": 8, "moe_token_dispatcher_type": "alltoall",
                                        "moe_grouped_gemm": False, **fields})

    assert _preflight(config(num_moe_experts=None)) is None
    assert _preflight(config(num_moe_experts=None, moe_token_dispatcher_type="flex")) is None  # dense
    assert _preflight(config()) is None and _preflight(config(moe_token_dispatcher_type="allgather")) is None
    both = _preflight(config(moe_token_dispatcher_type="flex", moe_grouped_gemm=True))
    assert both.startswith("moe_token_dispatcher_type='flex' (Megatron-LM: --moe-token-dispatcher-type flex; "
                           "covered: allgather, alltoall)"), both
    assert "; grouped-GEMM experts without Transformer Engine (Megatron-LM: --moe-grouped-gemm with " in both, both
    assert _preflight(config(moe_grouped_gemm=True, transformer_impl="transformer_engine")) is None  # TEGroupedMLP
    # shared experts: covered in local layers, refused with TE's (their fc2 reduces inside TE)
    shared = dict(moe_shared_expert_intermediate_size=64)
    assert _preflight(config(transformer_impl="local", **shared)) is None
    assert _preflight(config(transformer_impl="transformer_engine")) is None  # TE routed experts: covered
    te_shared = _preflight(config(transformer_impl="transformer_engine", **shared))
    assert te_shared.startswith("shared experts with Transformer Engine layers (Megatron-LM: "
                                "--moe-shared-expert-intermediate-size with --transformer-impl transformer_engine"), te_shared


def test_every_fc2_of_the_experts_and_shared_experts_is_marked_and_nothing_else():
    import types

    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from megapatch.patches.tp_reduce._reduction import MOE_FP32_SUM
    from megapatch.patches.tp_reduce.moe import _mark

    def mlp():
        module = torch.nn.Module()
        module.linear_fc1, module.linear_fc2 = bare_module(RowParallelLinear), bare_module(RowParallelLinear)
        return module

    experts = torch.nn.Module()
    experts.local_experts = torch.nn.ModuleList([mlp(), mlp(), mlp()])
    shared = mlp()
    config = types.SimpleNamespace(moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)
    _mark(types.SimpleNamespace(config=config, experts=experts, shared_experts=shared))
    for owner in (*experts.local_experts, shared):
        assert getattr(owner.linear_fc2, MOE_FP32_SUM, False) is True
        assert not hasattr(owner.linear_fc1, MOE_FP32_SUM)
    routed_only = mlp()
    holder = torch.nn.Module()
    holder.local_experts = torch.nn.ModuleList([routed_only])
    _mark(types.SimpleNamespace(config=config, experts=holder))  # no shared experts at all
    assert getattr(routed_only.linear_fc2, MOE_FP32_SUM) is True


@pytest.mark.parametrize("mode,active", [("fp32", True), ("fp32-accumulate", False), ("native", False)])
def test_the_moe_patch_is_installed_for_fp32_only(mode, active):
    """fp32-accumulate keeps its documented meaning in MoE layers (partials on the wire in their own
    dtype): this patch is not part of it."""
    import megapatch

    _needs_fp32_reductions()
    try:
        status = megapatch.enable(tp_reduce_dtype=mode)
        assert ("tp_reduce.moe" in status.active) is active, status.active
    finally:
        megapatch.disable()


# -- issue 28 item 8: survivors of the seventh fresh mutation sample (seed 34) ---------------------

@pytest.mark.parametrize("wrapper,attribute", [("_allgather_token_combine", "local_probs"),
                                               ("_alltoall_combine_preprocess", "probs")])
def test_the_dispatcher_wrappers_read_the_expert_outputs_by_position_or_keyword(monkeypatch, wrapper, attribute):
    """``token_combine(self, hidden_states)`` / ``combine_preprocess(self, hidden_states)``: the one
    argument may come by keyword; the FP32 swap follows it either way."""
    import types

    from megapatch.patches.tp_reduce import moe as tp_reduce_moe

    _settings(monkeypatch, "fp32")
    probs = torch.tensor([0.25, 0.75], dtype=torch.bfloat16)
    dispatcher = types.SimpleNamespace(**{attribute: probs})
    seen = []
    upstream = lambda *a, **k: seen.append(getattr(dispatcher, attribute).dtype) or "combined"  # noqa: E731
    fp32_out = torch.zeros(2)
    for args, kwargs in (((fp32_out,), {}), ((), {"hidden_states": fp32_out})):
        assert getattr(tp_reduce_moe, wrapper)(upstream, dispatcher, args, kwargs) == "combined"
        assert seen.pop() == torch.float32 and getattr(dispatcher, attribute) is probs
