"""``tp_invariant`` on a model built from Transformer Engine layers (issue 39 item 3), on CPU.

A Qwen3-shaped GPT (SwiGLU, RMSNorm, RoPE, grouped-query attention, QK RMSNorm, untied output layer)
built with megatron-core's TE spec (``get_gpt_layer_with_transformer_engine_spec``: the fused
``TELayerNormColumnParallelLinear`` for QKV and fc1, ``TERowParallelLinear``, ``TEDotProductAttention``,
TE's ``RMSNorm`` for the QK and final norms) and constructed inside the TE CPU runtime
(``megapatch.testing.stand_ins.te_runtime``, a stand-in: TE's CUDA kernels cannot run here). Under
the mode the TE layers' forward runs the mode's arithmetic on the TE parameters, so:

* at TP 1, 2 and 4, with and without sequence parallelism, the logits, the loss and every gradient
  are bit-identical, and so are the grad norms and parameters after three clipped AdamW steps of
  megatron-core's BF16 optimizer (one 4-rank job; data-parallel replicas at TP < 4);
* they are bit-identical to the same weights in megatron-core's *local* layers under the mode -- an
  independent path (its norms, linears and attention are the local modules, checked against FP32
  oracles in tests/test_tp_invariant.py): the TE wiring loses, adds or reorders nothing;
* the Qwen3-MoE-shaped model with TE experts -- sequential (``SequentialMLP``) or TE's grouped GEMM
  (``TEGroupedMLP``) -- and a TE shared expert, at TP 1/2 x EP 1/2: the same, and the local experts' bits;
* what the mode refuses on TE layers (FP8, comm overlap) the doctor refuses from the flags too.

What only a GPU can show (TE's own kernels are not used under the mode, so nothing here depends on
them): the mode's block GEMMs on cuBLAS (tools/gpu_check.py).
"""

import pytest
import torch

from reduction_oracles import pairwise_tree_bf16, planted, signs
from megapatch.testing import run_ranks
from megapatch.testing.scenarios import moe_tiny


pytestmark = pytest.mark.te

LAYOUTS = ((1, False), (2, False), (4, False), (2, True), (4, True))  # (TP, sequence parallel)
SHAPE = dict(hidden_size=128, num_attention_heads=16, num_query_groups=4, ffn_hidden_size=192,
             qk_layernorm=True, num_layers=2)
VOCAB, SEQ = 128, 16

_local_name = moe_tiny.local_name  # a TE-spec parameter name -> the local spec's name of the same weight


def _build(tp: int, sp: bool, spec: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megapatch.testing import build_tiny_gpt
    from megapatch.testing.models.tiny_gpt import llama_config

    config = llama_config(tp=tp, sequence_parallel=sp and tp > 1, **SHAPE)
    layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True) if spec == "te" else None
    return build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ, seed=1234, position_embedding_type="rope",
                          layer_spec=layer_spec)


def _forward_backward(ctx, model):
    from megapatch.testing import make_batch
    from megapatch.testing.models.tiny_gpt import forward_backward

    return forward_backward(ctx, model, make_batch(seed=5, batch=2, seq_len=SEQ, vocab=VOCAB))


STEPS, CLIP = 3, 0.05  # clipping active at every step (grad norms here are ~0.5-2)


def _clipped_steps(ctx, model):
    """After ``_forward_backward``: STEPS clipped AdamW steps of megatron-core's BF16 optimizer (FP32
    main parameters), a fresh batch for each step after the first; grad norms and parameters."""
    from megapatch.testing import gather_full_weights, make_batch
    from megapatch.testing.models.tiny_gpt import build_bf16_optimizer, cuda_type_names, sum_tp_replicated_grads

    optimizer = build_bf16_optimizer(model, clip_grad=CLIP)
    norms = []
    for step in range(STEPS):
        if step:
            optimizer.zero_grad()
            batch = make_batch(seed=5 + step, batch=2, seq_len=SEQ, vocab=VOCAB)
            model(batch.tokens, batch.position_ids, batch.attention_mask,
                  labels=batch.labels).float().mean().backward()
            sum_tp_replicated_grads(ctx, model)
        with cuda_type_names():
            ok, norm, _ = optimizer.step()
        assert ok
        norms.append(norm)
    return {"norms": norms, "params": {n: p.float() for n, p in gather_full_weights(model, ctx).items()}}


def _planted_layers(ctx):
    """A TE row-parallel forward and a gated (SwiGLU) TE fc1's dgrad on planted values (K = 16, 8
    blocks of 2; fc1: 16 gate + 16 up features, rank r holding [gate_r; up_r] and marked as the MLP
    marks it): sums whose FP32 bits follow the tree's order, so a wrong leaf order shows."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    from megapatch.numerics import block_tree
    from megapatch.testing.models.tiny_gpt import llama_config

    tp, rank = ctx.tp_size, ctx.tp_rank
    config = llama_config(tp=tp, hidden_size=16, num_attention_heads=8, num_query_groups=8,
                          perform_initialization=False)
    shard = slice(rank * 16 // tp, (rank + 1) * 16 // tp)
    common = dict(config=config, init_method=None, bias=False, skip_bias_add=True, is_expert=False)
    row = TERowParallelLinear(16, 16, input_is_parallel=True, **common)
    with torch.no_grad():
        row.weight.copy_(planted((16, 16), 1)[:, shard])
    row_out = row(signs((8, 1, 16), 2)[..., shard].to(torch.bfloat16))[0].detach().float()
    fc1 = TEColumnParallelLinear(16, 32, gather_output=False, **common)
    setattr(fc1.weight, block_tree.GATED_HALVES, 2)
    gate, up = planted((32, 16), 5).chunk(2)
    with torch.no_grad():
        fc1.weight.copy_(torch.cat([gate[shard], up[shard]]))
    x = torch.ones(8, 1, 16, dtype=torch.bfloat16, requires_grad=True)
    grad_gate, grad_up = signs((8, 1, 32), 6).chunk(2, dim=-1)
    fc1(x)[0].backward(torch.cat([grad_gate[..., shard], grad_up[..., shard]], dim=-1).to(torch.bfloat16))
    return {"row": row_out, "glu_dgrad": x.grad.float()}


def _job(ctx):
    import megapatch
    from megapatch.testing import reinit_model_parallel
    from megapatch.testing.models.tiny_gpt import gather_full_weights
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    out = {}
    for tp, sp in LAYOUTS:
        ctx = reinit_model_parallel(ctx, tp=tp)
        megapatch.enable(tp_invariant=True)
        with te_cpu_runtime() as calls:
            model = _build(tp, sp, "te")
            out[("modules", tp, sp)] = sorted({type(m).__name__ for m in model.modules()
                                               if type(m).__module__.startswith(("transformer_engine",
                                                                                  "megatron.core.extensions"))})
            before = len(calls)
            out[("te", tp, sp)] = _forward_backward(ctx, model)
            out[("kernels", tp, sp)] = calls[before:]
            if (tp, sp) == (1, False):
                weights = gather_full_weights(model, ctx)
            out[("steps", tp, sp)] = _clipped_steps(ctx, model)
            out[("kernels after steps", tp, sp)] = calls[before:]
            if not sp:
                out[("planted", tp)] = _planted_layers(ctx)
        if (tp, sp) == (1, False):  # the same weights in the local layers, under the mode
            local = _build(tp, sp, "local")
            with torch.no_grad():
                for name, param in local.named_parameters():
                    param.copy_(weights[next(n for n in weights if _local_name(n) == name)])
            out[("local", tp, sp)] = _forward_backward(ctx, local)
            out["local names"] = sorted(n for n, _ in local.named_parameters())
            out["te names"] = sorted(_local_name(n) for n in weights)
        megapatch.disable()
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_job, world_size=4, tp=1, timeout=600)[0]


@pytest.mark.quick("tp_invariant.transformer_engine")  # runs where TE is installed (CI's te stage)
def test_the_model_is_built_from_te_layers_and_no_te_kernel_runs_under_the_mode(runs):
    for tp, sp in LAYOUTS:
        assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear", "TEDotProductAttention",
                "RMSNorm"} <= set(runs[("modules", tp, sp)]), runs[("modules", tp, sp)]
        assert runs[("kernels", tp, sp)] == [], (tp, sp)  # every GEMM, norm and attention: the mode's


@pytest.mark.parametrize("tp, sp", LAYOUTS[1:])
def test_clipped_optimizer_steps_give_the_same_grad_norms_and_parameters_as_tp1(runs, tp, sp):
    want, got = runs[("steps", 1, False)], runs[("steps", tp, sp)]
    assert max(want["norms"]) > 0 and min(want["norms"]) > CLIP  # clipping scaled every step
    assert got["norms"] == want["norms"]
    differ = [name for name in want["params"] if not torch.equal(got["params"][name], want["params"][name])]
    assert differ == [], differ
    # the optimizer's clipping scales the FP32 main gradients with TE's multi_tensor_scale (megatron-core
    # binds it when TE is installed): the only TE kernel a step calls; no GEMM, norm or attention kernel
    assert set(runs[("kernels after steps", tp, sp)]) == {"multi_tensor_scale"}


@pytest.mark.parametrize("tp, sp", LAYOUTS[1:])
def test_logits_loss_and_gradients_are_bit_identical_to_tp1(runs, tp, sp):
    want, got = runs[("te", 1, False)], runs[("te", tp, sp)]
    assert torch.equal(got["logits"], want["logits"])
    assert torch.equal(got["loss"], want["loss"])
    assert sorted(got["grads"]) == sorted(want["grads"])
    differ = [name for name in want["grads"] if not torch.equal(got["grads"][name], want["grads"][name])]
    assert differ == [], differ


def test_te_layers_give_the_local_layers_bits_with_the_same_weights(runs):
    assert runs["te names"] == runs["local names"]
    te, local = runs[("te", 1, False)], runs[("local", 1, False)]
    assert torch.equal(te["logits"], local["logits"])
    assert torch.equal(te["loss"], local["loss"])
    differ = [name for name, grad in te["grads"].items() if not torch.equal(grad, local["grads"][_local_name(name)])]
    assert differ == [], differ


@pytest.mark.parametrize("tp", (2, 4))
def test_planted_sums_follow_the_fixed_tree_at_every_tp_size(runs, tp):
    """The row-parallel sum and the gated fc1's dgrad on values whose FP32 sums depend on the order:
    the same bits at TP 2 and 4 as at TP 1 (a gate/up pairing lost, or leaves in another order,
    change them), and the row sum equal to an independent oracle: the 8 two-wide blocks' products
    added pairwise in FP32, rounded once."""
    want, got = runs[("planted", 1)], runs[("planted", tp)]
    assert torch.equal(got["row"], want["row"])
    assert torch.equal(got["glu_dgrad"], want["glu_dgrad"])
    products = signs((8, 1, 16), 2)[..., None, :] * planted((16, 16), 1)  # [8, 1, out, in]
    assert torch.equal(want["row"], pairwise_tree_bf16(products))


# -- TE experts: the Qwen3-MoE-shaped model with TE layers, sequential or grouped-GEMM TE experts --

MOE_TPS, MOE_EPS, MOE_STEPS = (1, 2), (1, 2), 2
TE_SPECS = ("te", "te-grouped")  # TE experts in a SequentialMLP; TE's grouped GEMM (TEGroupedMLP)
SHARED = {"moe_shared_expert_intermediate_size": 64}  # a DeepSeek-style shared expert: TE linears in the TE specs


def _moe_job(ctx, tp):
    """Per (spec, TP, EP): step 0's logits, expert choices, losses and gradients, then clipped AdamW
    steps (``moe_tiny.invariant_training``; DP 2 at every layout: world = 2 x TP), under the mode,
    for megatron-core's TE spec (``TELayerNormColumnParallelLinear``, TE experts in a
    ``SequentialMLP``: ``TEColumnParallelLinear``/``TERowParallelLinear`` run by TE with
    ``parallel_mode=None`` at TP or EP > 1), the TE spec with grouped-GEMM experts (``TEGroupedMLP``:
    one ``TEGroupedLinear`` per fc holding every local expert's weight) and the local spec, all three
    with the same weights and a shared expert (``TEColumnParallelLinear``/``TERowParallelLinear`` in
    the TE specs, reducing over TP as dense layers do)."""
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    out = {}
    with te_cpu_runtime() as calls:
        for spec in ("te", "te-grouped", "local"):
            before = len(calls)
            # the grouped experts draw their weights in another order: they take the local spec's
            weights = moe_tiny.weights_of("local", config_overrides=SHARED) if spec == "te-grouped" else None
            runs = moe_tiny.invariant_training(ctx, [(tp, ep) for ep in MOE_EPS], "alltoall", steps=MOE_STEPS,
                                               spec=spec, full_weights=weights, config_overrides=SHARED)
            out.update({(spec, t, e): run for (_, t, e), run in (runs or {}).items()})
            out[("kernels", spec, tp)] = sorted(set(calls[before:]))
        from megapatch.testing.ranks.rank_context import reinit_model_parallel

        reinit_model_parallel(ctx, tp=1)  # every rank: it builds process groups
        model = moe_tiny.build(moe_tiny.qwen3_moe_config(1, **SHARED), spec="te")
        expert = model.decoder.layers[0].mlp.experts.local_experts[0]
        shared = model.decoder.layers[0].mlp.shared_experts
        grouped = moe_tiny.build(moe_tiny.qwen3_moe_config(1), spec="te-grouped").decoder.layers[0].mlp.experts
        out[("expert types", tp)] = [type(expert.linear_fc1).__name__, type(expert.linear_fc2).__name__,
                                     type(grouped).__name__, type(grouped.linear_fc1).__name__,
                                     type(grouped.linear_fc2).__name__, type(shared.linear_fc1).__name__,
                                     type(shared.linear_fc2).__name__]
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def moe_runs():
    found = {}
    for tp in MOE_TPS:
        found.update(run_ranks(_moe_job, world_size=2 * tp, tp=1, timeout=900, args=(tp,))[0])
    return found


def _differing(a, b):
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]


MOE_LAYOUTS = [(tp, ep) for tp in MOE_TPS for ep in MOE_EPS]


def test_te_experts_are_te_linears_and_no_te_kernel_runs_under_the_mode(moe_runs):
    for tp in MOE_TPS:
        assert moe_runs[("expert types", tp)] == ["TEColumnParallelLinear", "TERowParallelLinear", "TEGroupedMLP",
                                                  "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear",
                                                  "TEColumnParallelLinear", "TERowParallelLinear"]
        for spec in TE_SPECS:  # the clipping's multi_tensor_scale only: no GEMM, norm or attention kernel
            assert moe_runs[("kernels", spec, tp)] == ["multi_tensor_scale"], moe_runs[("kernels", spec, tp)]


def _grouped_forward_backward(ctx):
    """One forward and backward at TP 1 under the mode: grouped TE experts (with the local spec's
    weights) and the local experts, and the TE kernels the grouped model called."""
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    with te_cpu_runtime() as calls:
        grouped = moe_tiny.invariant_training(ctx, [(1, 1)], "alltoall", steps=0, spec="te-grouped",
                                              full_weights=moe_tiny.weights_of("local"))
        kernels = sorted(set(calls))
    local = moe_tiny.invariant_training(ctx, [(1, 1)], "alltoall", steps=0, spec="local")
    return grouped[("tp_invariant", 1, 1)], local[("tp_invariant", 1, 1)], kernels


@pytest.mark.quick("tp_invariant.te_grouped_experts")  # runs where TE is installed (CI's te stage)
def test_grouped_te_experts_run_no_grouped_gemm_and_give_the_local_experts_bits():
    grouped, local, kernels = run_ranks(_grouped_forward_backward, world_size=1, tp=1, timeout=300)[0]
    assert kernels == [], kernels  # no te_general_grouped_gemm, nor any other TE kernel
    assert torch.equal(grouped["logits"], local["logits"]) and torch.equal(grouped["losses"], local["losses"])
    names = {n: moe_tiny.local_name(n) for n in grouped["grads"]}
    assert sum(".experts.linear_fc" in n for n in names) == 2 * 8 * 2
    assert [n for n, m in names.items() if not torch.equal(grouped["grads"][n], local["grads"][m])] == []


@pytest.mark.parametrize("spec", TE_SPECS)
@pytest.mark.parametrize("tp, ep", MOE_LAYOUTS[1:])
def test_te_moe_logits_routing_losses_gradients_and_steps_are_bit_identical_to_tp1_ep1(moe_runs, spec, tp, ep):
    """Grouped-GEMM experts too: a grouped GEMM's blocking depends on every expert's token count,
    the mode's per-expert block GEMMs do not."""
    base, here = moe_runs[(spec, 1, 1)], moe_runs[(spec, tp, ep)]
    assert torch.equal(here["logits"], base["logits"])
    assert all(torch.equal(a, b) for a, b in zip(here["routing"], base["routing"])) and len(base["routing"]) == 2
    assert torch.equal(here["losses"], base["losses"])
    assert sum(moe_tiny.is_expert_parameter(name) for name in base["grads"]) == 2 * 8 * 2  # every expert's, over EP
    assert sum(".shared_experts." in name for name in base["grads"]) == 2 * 2
    assert _differing(here["grads"], base["grads"]) == []
    assert len(base["norms"]) == MOE_STEPS + 1 and here["norms"] == base["norms"]
    assert _differing(here["params"], base["params"]) == []
    assert _differing(here["adam"], base["adam"]) == []


@pytest.mark.parametrize("spec", TE_SPECS)
@pytest.mark.parametrize("tp, ep", MOE_LAYOUTS)
def test_te_experts_give_the_local_experts_bits_with_the_same_weights(moe_runs, spec, tp, ep):
    """An independent path: the local spec's experts (ColumnParallelLinear/RowParallelLinear, checked
    against FP32 oracles in tests/test_tp_invariant_moe.py). The grad norms too: TE marks an expert's
    fc2 weight with partition dim 0, which the mode's norm must not take (it holds input features),
    and gives grouped experts' weights no TP attributes at all (each expert-TP rank holds a slice)."""
    local_name = moe_tiny.local_name
    te, local = moe_runs[(spec, tp, ep)], moe_runs[("local", tp, ep)]
    assert torch.equal(te["logits"], local["logits"])
    assert torch.equal(te["losses"], local["losses"])
    assert sorted(local_name(n) for n in te["grads"]) == sorted(local["grads"])
    assert [n for n, g in te["grads"].items() if not torch.equal(g, local["grads"][local_name(n)])] == []
    assert te["norms"] == local["norms"]
    assert [n for n, p in te["params"].items() if not torch.equal(p, local["params"][local_name(n)])] == []


# -- what the mode refuses on TE layers: the doctor from the flags, the run at construction ------

TE_FLAGS = ["--tensor-model-parallel-size", "2", "--num-attention-heads", "8", "--hidden-size", "64",
            "--transformer-impl", "transformer_engine", "--no-gradient-accumulation-fusion",
            "--no-bias-swiglu-fusion", "--swiglu", "--num-experts", "8", "--moe-router-topk", "2",
            "--moe-grouped-gemm", "--sequence-parallel", "--disable-bias-linear", "--seq-length", "32",
            "--moe-ffn-hidden-size", "32", "--moe-token-dispatcher-type", "alltoall"]
TE_REFUSED = {"fp8": (["--fp8-format", "hybrid"], "hybrid", "--fp8-format"),
              "tp_comm_overlap": (["--tp-comm-overlap"], True, "--tp-comm-overlap")}


def _te_refusal(ctx, field, value):
    """What building the TE-spec MoE model (grouped-GEMM experts) with ``field=value`` under the mode
    raises, else None."""
    import megapatch
    from megapatch.core.errors import MegapatchError
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

    megapatch.enable(tp_invariant=True)
    try:
        with te_cpu_runtime():
            moe_tiny.build(moe_tiny.qwen3_moe_config(1, **({field: value} if field else {})), spec="te-grouped")
    except MegapatchError as exc:
        return str(exc)
    finally:
        megapatch.disable()
    return None


@pytest.mark.parametrize("field", [None, *TE_REFUSED])
def test_the_doctor_refuses_from_the_flags_what_the_run_refuses_when_te_layers_are_built(monkeypatch, field):
    """Megatron-LM flags of a TE MoE job with TE's grouped GEMM: covered as they are (the doctor and
    the build agree: nothing refused); with FP8 or comm overlap both refuse, naming the same flag."""
    from tests.test_doctor import _flags_survey

    extra, value, flag = TE_REFUSED[field] if field else ([], None, None)
    survey = _flags_survey(monkeypatch, TE_FLAGS + extra, MEGAPATCH_TP_INVARIANT="1")
    doctor = survey["flags"]["refusals"].get("tp_invariant.transformer_engine")
    run = run_ranks(_te_refusal, world_size=1, tp=1, args=(field, value))[0]
    if field is None:
        assert doctor is None and not survey["flags"]["refusals"], survey["flags"]["refusals"]
        assert run is None, run
        return
    assert doctor is not None and flag in doctor, survey["flags"]["refusals"]
    assert run is not None and flag in run and "tp_invariant was set by" in run, run


# -- packed (THD) sequences through TEDotProductAttention (issue 49) ------------------------------

def _te_packed_attention(ctx):
    """A TE attention built under the mode: three sequences (37, 64, 5 tokens) each run alone ([s, 1,
    heads, dim]) and packed in one THD bin with garbage rows between them, under both causal mask types
    a packed bin may carry; outputs and q, k, v gradients, and the TE kernels called."""
    import megapatch
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megapatch.testing.models.tiny_gpt import llama_config
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime
    from tests.test_tp_invariant_attention_blocks import _params

    heads, groups = SHAPE["num_attention_heads"], SHAPE["num_query_groups"]
    dim = SHAPE["hidden_size"] // heads
    lengths, pads = (37, 64, 5), (3, 0, 11)
    gen = torch.Generator().manual_seed(3)
    seqs = [[torch.randn(n, h, dim, generator=gen).bfloat16() for h in (heads, groups, groups, heads)]
            for n in lengths]  # q, k, v, the output's cotangent
    garbage = [[torch.randn(p, *t.shape[1:], generator=gen).bfloat16() for t in s] for s, p in zip(seqs, pads)]

    def run(attn, qkv, cotangent, **kwargs):
        leaves = [t.clone().requires_grad_() for t in qkv]
        with torch.enable_grad():
            out = attn(*leaves, None, AttnMaskType.causal, **kwargs)
            (out.float() * cotangent.reshape(out.shape).float()).sum().backward()
        return out.detach().reshape(qkv[0].shape[0], -1), [t.grad for t in leaves]

    megapatch.enable(tp_invariant=True)
    try:
        with te_cpu_runtime() as calls:
            attn = TEDotProductAttention(llama_config(tp=1, **SHAPE), layer_number=1,
                                         attn_mask_type=AttnMaskType.causal, attention_type="self")
            alone = [run(attn, [t.unsqueeze(1) for t in s[:3]], s[3]) for s in seqs]
            packed = {}
            for mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal):
                bin_ = [torch.cat([t for s, g in zip(seqs, garbage) for t in (s[j], g[j])]) for j in range(4)]
                attn.attn_mask_type = mask_type
                packed[mask_type.name] = run(attn, bin_[:3], bin_[3], packed_seq_params=_params(lengths, pads))
            kernels = sorted(set(calls))
    finally:
        megapatch.disable()
    return alone, packed, kernels


@pytest.mark.quick("tp_invariant.transformer_engine")  # runs where TE is installed (CI's te stage)
def test_packed_sequences_through_te_attention_each_have_the_bits_they_have_alone():
    """Under the mode TE's attention takes a THD bin as the mode's local attention does: every sequence's
    output and q, k, v gradients equal those of the sequence run alone through the same TE module, bit
    for bit, wherever it sits; the rows between sequences are zeros; no TE kernel runs."""
    alone, packed, kernels = run_ranks(_te_packed_attention, world_size=1, tp=1, timeout=300)[0]
    assert kernels == [], kernels
    lengths, pads = (37, 64, 5), (3, 0, 11)
    for mask_type, (out, grads) in packed.items():
        row = 0
        for i, (n, pad) in enumerate(zip(lengths, pads)):
            assert torch.equal(out[row:row + n], alone[i][0]), (mask_type, i)
            assert torch.equal(out[row + n:row + n + pad], torch.zeros_like(out[row + n:row + n + pad])), mask_type
            for name, g, expected in zip("qkv", grads, alone[i][1]):
                assert torch.equal(g[row:row + n], expected.squeeze(1)), (mask_type, i, name)
            row += n + pad
