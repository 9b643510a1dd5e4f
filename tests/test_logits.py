"""FP32 LM-head logits on real megatron-core: exactness (the PR's integer method), the gradient
contract (bit-identical to native given the same BF16 upstream gradient), accuracy against an
FP32 reference, TP 1/2/4, sequence parallel, parallel_output, tied embeddings."""

import contextlib

import pytest
import torch

import megapatch
from megapatch.core.errors import UnsupportedConfigurationError
from conftest import bare_module
from megapatch.testing import run_ranks

VOCAB, SEQ = 128, 16


def _integer(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).to(torch.bfloat16)


def _integer_exact(ctx, ks, gather_output):
    """The PR's method: BF16 operands holding integers in [-8, 8] with K*64 < 2**24 make every
    product and partial sum exact in FP32, so FP32 logits must equal an FP32 reference bit for bit."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megapatch.testing import gather_tp_logits
    from megapatch.patches.logits._lm_head import lm_head

    found = []
    for k in ks:
        config = TransformerConfig(num_layers=1, hidden_size=k, num_attention_heads=8,
                                   tensor_model_parallel_size=ctx.tp_size, params_dtype=torch.bfloat16,
                                   bf16=True, use_cpu_initialization=True, perform_initialization=False)
        layer = ColumnParallelLinear(k, 64, config=config, init_method=None, bias=False,
                                     gather_output=gather_output)
        with torch.no_grad():
            layer.weight.copy_(_integer(layer.weight.shape, seed=10 + ctx.tp_rank))
        x = _integer((5, 2, k), seed=1)  # the LM head's input is replicated over TP
        full_w = gather_tp_logits(layer.weight.detach().t().contiguous(), ctx).t()
        reference = x.float() @ full_w.float().t()
        row = {"k": k}
        for mode in ("native", "fp32"):
            megapatch.enable(logits_dtype=mode)
            with torch.no_grad(), lm_head(layer):
                out, _ = layer(x)
            if not gather_output:
                out = gather_tp_logits(out, ctx)
            row[mode] = (str(out.dtype), torch.equal(out.float(), reference),
                         torch.equal(out.float().view(torch.int32), reference.view(torch.int32))
                         if out.dtype == torch.float32 else False)
        megapatch.disable()
        found.append(row)
    return found


@pytest.mark.parametrize("tp,gather_output", [(1, False), (2, False), (2, True)])
def test_integer_operands_give_fp32_words_equal_to_the_fp32_reference(tp, gather_output):
    rows = run_ranks(_integer_exact, world_size=tp, tp=tp, args=([512, 2048, 8192], gather_output))
    for per_rank in rows:
        for row in per_rank:
            assert row["fp32"] == ("torch.float32", True, True), row
            assert row["native"][0] == "torch.bfloat16"
            assert row["native"][1] is False, row  # BF16 rounding of sums beyond 256: caught


def _gpt_contract(ctx, combos):
    """For each configuration: logits dtype, bit-identical grads given the same BF16 upstream
    gradient, and errors against an independent oracle of the LM head: the BF16 hidden states
    and output weight the layer received, all-gathered and multiplied in plain FP32."""
    import torch.nn.functional as F
    from megapatch.testing import build_tiny_gpt, gather_tp_logits, make_batch, tiny_gpt_config

    batch = make_batch(seed=5, batch=2, seq_len=SEQ, vocab=VOCAB)
    results = []
    for sequence_parallel, parallel_output, tied in combos:
        if sequence_parallel and ctx.tp_size == 1:
            continue
        runs = {}
        for mode in ("native", "fp32"):
            megapatch.enable(logits_dtype=mode)
            model = build_tiny_gpt(tiny_gpt_config(tp=ctx.tp_size, sequence_parallel=sequence_parallel),
                                   vocab_size=VOCAB, seq_len=SEQ, parallel_output=parallel_output,
                                   share_embeddings_and_output_weights=tied)
            seen = {}

            def capture(module, args, kwargs):
                seen["hidden"], seen["weight"] = args[0].detach(), kwargs.get("weight")

            model.output_layer.register_forward_pre_hook(capture, with_kwargs=True)
            logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
            generator = torch.Generator().manual_seed(99)
            upstream = torch.randn(logits.shape, generator=generator).to(torch.bfloat16)
            logits.backward(upstream.to(logits.dtype))  # the same BF16 values for both modes
            full = logits.detach() if not parallel_output else gather_tp_logits(logits, ctx)
            hidden = seen["hidden"]
            if sequence_parallel:
                hidden = gather_tp_logits(hidden.transpose(0, -1).contiguous(), ctx).transpose(0, -1)
            weight = seen["weight"] if seen["weight"] is not None else model.output_layer.weight
            full_w = gather_tp_logits(weight.detach().t().contiguous(), ctx).t()
            oracle = (hidden.float() @ full_w.float().t()).transpose(0, 1)
            runs[mode] = {"dtype": str(logits.dtype), "logits": full.float(), "oracle": oracle,
                          "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
        megapatch.disable()
        ce = lambda l: F.cross_entropy(l.reshape(-1, VOCAB), batch.labels.reshape(-1), reduction="none")
        results.append({
            "combo": (sequence_parallel, parallel_output, tied),
            **{f"{m}_dtype": runs[m]["dtype"] for m in runs},
            "grads_identical": all(torch.equal(runs["native"]["grads"][n], runs["fp32"]["grads"][n])
                                   for n in runs["native"]["grads"]),
            "err": {m: (r["logits"] - r["oracle"]).abs().max().item() for m, r in runs.items()},
            "ce_err": {m: (ce(r["logits"]) - ce(r["oracle"])).abs().mean().item() for m, r in runs.items()},
        })
    return results if ctx.rank == 0 else None


COMBOS = [(sp, po, tied) for sp in (False, True) for po in (True, False) for tied in (False, True)]


@pytest.mark.quick("logits.fp32_lm_head", "logits.fp32_output_layer")
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gpt_fp32_logits_contract_and_accuracy(tp):
    results = run_ranks(_gpt_contract, world_size=tp, tp=tp, args=(COMBOS,), timeout=600)[0]
    assert len(results) == (4 if tp == 1 else 8)
    for r in results:
        assert r["native_dtype"] == "torch.bfloat16" and r["fp32_dtype"] == "torch.float32", r
        assert r["grads_identical"], r  # PR #6252's backward contract
        assert r["err"]["fp32"] < 1e-5 < r["err"]["native"], r  # only FP32 summation order remains
        assert r["ce_err"]["fp32"] < r["ce_err"]["native"] / 10, r


class _MXFP8Head(torch.nn.Module):
    """Stands in for TE's TELMHeadColumnParallelLinear (CUDA-only), which Megatron-LM builds as the
    output layer for MXFP8: takes ColumnParallelLinear's arguments, is not one."""

    def __init__(self, input_size, output_size, *, config, **_kwargs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(output_size, input_size, dtype=config.params_dtype))

    def forward(self, input_, weight=None, runtime_gather_output=None):
        return torch.matmul(input_, (self.weight if weight is None else weight).t()), None


class _TensorParallelBuilding:
    """``megatron.core.tensor_parallel`` as gpt_model sees it, except that it builds ``head``."""

    def __init__(self, real, head):
        self._real, self.ColumnParallelLinear = real, head

    def __getattr__(self, name):
        return getattr(self._real, name)


@contextlib.contextmanager
def _gpt_model_building(head):
    """gpt_model's GPTModel.__init__ builds ``head`` as its output layer in this block; megapatch is
    disabled and the module restored on exit."""
    from megatron.core.models.gpt import gpt_model

    real = gpt_model.tensor_parallel
    gpt_model.tensor_parallel = _TensorParallelBuilding(real, head)
    try:
        yield
    finally:
        gpt_model.tensor_parallel = real
        megapatch.disable()


def _construct_with_foreign_head(ctx):
    """GPTModel whose own __init__ builds the foreign output layer: refused at construction under
    logits_dtype='fp32' (before any training step), built normally when megapatch is off."""
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    found = {}
    with _gpt_model_building(_MXFP8Head):
        for mode in ("native", "fp32"):
            megapatch.enable(logits_dtype=mode)
            try:
                model = build_tiny_gpt(tiny_gpt_config(tp=1), vocab_size=VOCAB, seq_len=SEQ)
                found[mode] = f"built: output layer {type(model.output_layer).__name__}"
            except UnsupportedConfigurationError as exc:
                found[mode] = f"refused: {exc}"
    return found


def test_an_output_layer_other_than_column_parallel_linear_is_refused_at_construction():
    found = run_ranks(_construct_with_foreign_head, world_size=1)[0]
    assert found["native"] == "built: output layer _MXFP8Head", found  # the stand-in itself builds
    message = found["fp32"]
    assert message.startswith("refused: ") and "not megatron-core's ColumnParallelLinear" in message \
        and "TELMHeadColumnParallelLinear" in message and "_MXFP8Head" in message, message


def _construct_with_own_logit_dtype(ctx, logit_dtype):
    """A real GPTModel whose own __init__ builds an output layer with its own logit dtype.

    LABELLED STAND-IN for Megatron-LM PR #6252 (megatron-core 0.16.1 has neither
    ``GPTModel(logit_dtype=)`` nor ``ColumnParallelLinear(output_dtype=)``): on main,
    ``GPTModel.__init__`` passes ``output_dtype=self.logit_dtype`` to its output layer's
    ColumnParallelLinear, which keeps it as ``self.output_dtype``. Here the ColumnParallelLinear
    that gpt_model builds is the real class, given that attribute inside its own construction."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megapatch.testing import build_tiny_gpt, make_batch, tiny_gpt_config

    class PR6252ColumnParallelLinear(ColumnParallelLinear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.output_dtype = logit_dtype  # PR #6252: ColumnParallelLinear(output_dtype=logit_dtype)

    found = {}
    batch = make_batch(seed=5, batch=2, seq_len=SEQ, vocab=VOCAB)
    with _gpt_model_building(PR6252ColumnParallelLinear):
        for mode in ("native", "fp32"):
            megapatch.enable(logits_dtype=mode)
            try:
                model = build_tiny_gpt(tiny_gpt_config(tp=1), vocab_size=VOCAB, seq_len=SEQ)
            except UnsupportedConfigurationError as exc:
                found[mode] = f"refused at construction: {exc}"
                continue
            built = f"built: output_dtype {model.output_layer.output_dtype}"
            try:
                with torch.no_grad():
                    logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
                found[mode] = f"{built}, logits {logits.dtype}"
            except UnsupportedConfigurationError as exc:
                found[mode] = f"{built}, refused at forward: {exc}"
    return found


def test_a_model_built_with_its_own_bf16_logit_dtype_is_refused_at_construction():
    """issue 28 survivor: under logits_dtype='fp32' a GPTModel built with logit_dtype=bfloat16
    (Megatron-LM's --output-logit-dtype bf16, Bridge's logit_dtype) must be refused when it is
    built, before any training step, naming both settings; a refusal only at the first forward
    let the job build its optimizer, data and checkpoint first."""
    found = run_ranks(_construct_with_own_logit_dtype, world_size=1, args=(torch.bfloat16,))[0]
    assert found["native"] == "built: output_dtype torch.bfloat16, logits torch.bfloat16", found
    message = found["fp32"]
    assert message.startswith("refused at construction: "), found
    assert "output_dtype=torch.bfloat16" in message and "logit_dtype" in message, message
    assert "--output-logit-dtype" in message and "enable(logits_dtype='fp32')" in message, message
    # the same request (FP32) composes: built, and the logits are FP32
    agreeing = run_ranks(_construct_with_own_logit_dtype, world_size=1, args=(torch.float32,))[0]
    assert agreeing["fp32"] == "built: output_dtype torch.float32, logits torch.float32", agreeing


def _swapped_head_at_forward(ctx):
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    megapatch.enable(logits_dtype="fp32")
    model = build_tiny_gpt(tiny_gpt_config(tp=1), vocab_size=VOCAB, seq_len=SEQ)
    model.output_layer = _MXFP8Head(64, VOCAB, config=model.config)  # swapped in after construction
    try:
        model(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], None)
    except UnsupportedConfigurationError as exc:
        return str(exc)
    return "no error"


def test_an_output_layer_swapped_in_after_construction_is_refused_at_forward():
    message = run_ranks(_swapped_head_at_forward, world_size=1)[0]
    assert "not megatron-core's ColumnParallelLinear" in message and "TELMHeadColumnParallelLinear" in message


def _megatron_loss_backward(ctx):
    """megatron's own vocab-parallel cross entropy modifies FP32 logits in place: the FP32 output
    must not be a view created inside the autograd Function (PR #6252 on main has that bug)."""
    from megapatch.testing import build_tiny_gpt, make_batch, tiny_gpt_config

    batch = make_batch(seed=5, batch=2, seq_len=SEQ, vocab=VOCAB)
    losses = {}
    for mode in ("native", "fp32"):
        megapatch.enable(logits_dtype=mode)
        model = build_tiny_gpt(tiny_gpt_config(tp=ctx.tp_size), vocab_size=VOCAB, seq_len=SEQ)
        loss = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
        loss.float().mean().backward()
        losses[mode] = (str(loss.dtype), loss.float().mean().item(),
                        all(p.grad is not None for p in model.parameters()))
    megapatch.disable()
    return losses


def test_megatron_cross_entropy_trains_on_fp32_logits():
    out = run_ranks(_megatron_loss_backward, world_size=2, tp=2)[0]
    assert out["fp32"][2] and out["native"][2]
    assert abs(out["fp32"][1] - out["native"][1]) < 1e-2


def test_the_marked_layer_must_run_or_the_model_call_fails():
    """If the output layer's half of the patch were missing, marking raises instead of BF16."""
    out = run_ranks(_unmarked_call, world_size=1)[0]
    assert "ran without calling its output layer" in out


def _unmarked_call(ctx):
    from megapatch.patches.logits._lm_head import lm_head
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    megapatch.enable(logits_dtype="fp32")
    model = build_tiny_gpt(tiny_gpt_config(tp=1), vocab_size=VOCAB, seq_len=SEQ)
    try:
        with lm_head(model.output_layer):
            pass  # e.g. an upstream forward that computes logits some other way
    except Exception as exc:  # UpstreamSurfaceError
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_mamba_model_is_covered_when_its_module_is_imported():
    """MambaModel needs mamba_ssm (CUDA) to be built, so only the wiring is checked here: the same
    model wrappers as GPTModel are installed on MambaModel.__init__/forward."""
    import megatron.core.models.mamba.mamba_model  # noqa: F401  (imports without mamba_ssm)

    status = megapatch.enable(logits_dtype="fp32")
    report = status.patch("logits.fp32_lm_head_mamba")
    assert report.state == "active", report
    assert "megatron.core.models.mamba.mamba_model.MambaModel.forward" in report.targets


class _PassThroughStack(torch.nn.Module):
    """Stands in for MambaStack (its mixer needs mamba_ssm and CUDA): hands the embeddings on."""

    def __init__(self, config, **_kwargs):
        super().__init__()
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor

    def forward(self, hidden_states, attention_mask=None, **_kwargs):
        return hidden_states


def _mamba_forward(ctx):
    """A real MambaModel (embedding, output layer, forward) around a pass-through stack: its
    logits against the oracle (the BF16 hidden states and weight its output layer received, in
    plain FP32)."""
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megapatch.testing import make_batch, tiny_gpt_config

    batch = make_batch(seed=5, batch=2, seq_len=SEQ, vocab=VOCAB)
    found = {}
    for mode in ("native", "fp32"):
        megapatch.enable(logits_dtype=mode)
        torch.manual_seed(3)
        model = MambaModel(config=tiny_gpt_config(tp=1), mamba_stack_spec=ModuleSpec(module=_PassThroughStack),
                           vocab_size=VOCAB, max_sequence_length=SEQ).to(torch.bfloat16)
        seen = {}
        model.output_layer.register_forward_pre_hook(
            lambda module, args, kwargs: seen.update(hidden=args[0].detach(), weight=kwargs.get("weight")),
            with_kwargs=True)
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
        if logits is None:
            found[mode] = ("None", None)
            continue
        weight = seen["weight"] if seen["weight"] is not None else model.output_layer.weight
        oracle = (seen["hidden"].float() @ weight.detach().float().t()).transpose(0, 1)
        found[mode] = (str(logits.dtype), (logits.detach().float() - oracle).abs().max().item())
    megapatch.disable()
    return found


@pytest.mark.quick("logits.fp32_lm_head_mamba")
def test_mamba_model_forward_returns_fp32_logits():
    found = run_ranks(_mamba_forward, world_size=1)[0]
    assert found["fp32"][0] == "torch.float32" and found["fp32"][1] < 1e-5, found
    assert found["native"][0] == "torch.bfloat16" and found["native"][1] > 1e-5, found  # oracle can fail


def _frozen_head(ctx):
    """LinearWithFrozenWeight path (frozen output weight): same dgrad given the same BF16 gradient."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megapatch.patches.logits._lm_head import lm_head

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8,
                               tensor_model_parallel_size=ctx.tp_size, params_dtype=torch.bfloat16,
                               bf16=True, use_cpu_initialization=True, perform_initialization=False)
    layer = ColumnParallelLinear(64, 128, config=config, init_method=None, bias=False, gather_output=False)
    with torch.no_grad():
        layer.weight.copy_(_integer(layer.weight.shape, seed=3 + ctx.tp_rank))
    layer.weight.requires_grad_(False)
    upstream = _integer((4, 1, 128 // ctx.tp_size), seed=4)
    found = {}
    for mode in ("native", "fp32"):
        megapatch.enable(logits_dtype=mode)
        x = _integer((4, 1, 64), seed=5).requires_grad_()
        with lm_head(layer):
            out, _ = layer(x)
        out.backward(upstream.to(out.dtype))
        found[mode] = (str(out.dtype), x.grad.clone())
    megapatch.disable()
    return found["fp32"][0], torch.equal(found["native"][1], found["fp32"][1])


def test_frozen_output_weight_keeps_the_gradient_contract():
    for dtype, identical in run_ranks(_frozen_head, world_size=2, tp=2):
        assert dtype == "torch.float32" and identical


# -- mutation-audit additions (results/mutation.md) ----------------------------------------------

def test_lm_head_holds_a_native_output_dtype_at_none_for_the_call_and_restores_it(monkeypatch):
    """Where megatron-core has PR #6252's ColumnParallelLinear.output_dtype, megapatch computes the
    FP32 logits itself: the layer's own output_dtype is None during the call (else upstream returns
    its FP32 view, which megatron's cross entropy modifies in place) and restored afterwards. A
    layer without the attribute (megatron-core 0.16.1) is left without it."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megapatch.core import options, state
    from megapatch.patches.logits import _lm_head as logits

    monkeypatch.setattr(state, "_current", options.Settings(logits_dtype="fp32"))
    native = bare_module(ColumnParallelLinear)  # the attributes lm_head reads, no process group
    native.output_dtype, native._megapatch_expect_call = torch.float32, False
    with logits.lm_head(native):
        assert native.output_dtype is None
    assert native.output_dtype is torch.float32
    older = bare_module(ColumnParallelLinear)
    older._megapatch_expect_call = False
    with logits.lm_head(older):
        assert not hasattr(older, "output_dtype")
    assert not hasattr(older, "output_dtype")


# -- the FP32 GEMM's backend choice, with stand-ins for CUDA and Transformer Engine (mutation audit)

@pytest.fixture
def fresh_backends():
    from megapatch.numerics import fp32_gemm

    fp32_gemm._torch_mm_out_dtype.cache_clear()
    fp32_gemm._te_general_gemm.cache_clear()
    yield fp32_gemm
    fp32_gemm._torch_mm_out_dtype.cache_clear()
    fp32_gemm._te_general_gemm.cache_clear()


def test_torch_mm_out_dtype_is_probed_on_cuda_only_with_a_square_product(fresh_backends, monkeypatch):
    """``torch.mm(out_dtype=)`` is probed on CUDA only (a CPU device never takes that backend), with
    a probe whose product is defined; a probe that raises means no such backend. The stand-in mm
    checks shapes as torch's does."""
    fp32_gemm = fresh_backends
    probes = []

    def ones(*shape, dtype=None, device=None):
        probes.append(device)
        return torch.zeros(shape, dtype=dtype)

    def mm(a, b, out_dtype=None):
        if a.shape[1] != b.shape[0]:
            raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({tuple(a.shape)}, {tuple(b.shape)})")
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    with monkeypatch.context() as m:
        m.setattr(fp32_gemm.torch, "ones", ones)
        m.setattr(fp32_gemm.torch, "mm", mm)
        assert fp32_gemm._torch_mm_out_dtype("cpu") is False and probes == []
        assert fp32_gemm._torch_mm_out_dtype("cuda") is True and probes == ["cuda"]

        def no_kernel(a, b, out_dtype=None):
            raise RuntimeError("no kernel for these dtypes")

        fp32_gemm._torch_mm_out_dtype.cache_clear()
        m.setattr(fp32_gemm.torch, "mm", no_kernel)
        assert fp32_gemm._torch_mm_out_dtype("cuda") is False


def test_te_general_gemm_is_taken_only_with_the_arguments_it_is_called_with(fresh_backends, monkeypatch):
    """Transformer Engine's ``general_gemm`` is used, for CUDA tensors, when its signature takes A,
    B, out_dtype and layout (with ``workspace``: the workspace passed through); an older one is not
    used."""
    import sys
    import types

    fp32_gemm = fresh_backends

    def te_with(general_gemm):
        modules = {name: types.ModuleType(name) for name in (
            "transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.cpp_extensions",
            "transformer_engine.pytorch.module", "transformer_engine.pytorch.module.base")}
        modules["transformer_engine.pytorch.cpp_extensions"].general_gemm = general_gemm
        modules["transformer_engine.pytorch.module.base"].get_workspace = lambda: "workspace"
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        fp32_gemm._te_general_gemm.cache_clear()
        return fp32_gemm._te_general_gemm()

    def current(A, B, out_dtype, layout):
        return ("current", A, B, out_dtype, layout)

    def older(A, B, out_dtype):
        return ("older", A, B)

    def with_workspace(A, B, workspace, out_dtype=None, layout="TN"):
        return ("with workspace", A, B, workspace, out_dtype, layout)

    assert te_with(current) is current
    # TE's GEMM serves CUDA tensors only; a CPU tensor still takes the upcast
    assert fp32_gemm.backend("cuda") == "te-general-gemm" and fp32_gemm.backend("cpu") == "upcast"
    assert te_with(older) is None
    assert te_with(with_workspace)("a", "b", out_dtype=torch.float32, layout="TN") == (
        "with workspace", "a", "b", "workspace", torch.float32, "TN")


# -- the FP32 accumulator mode's contract with the upstream forward (mutation audit) --------------

def _small_bf16(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=generator).to(torch.bfloat16)  # exact products and sums


def test_the_fp32_accumulator_mode_gives_linear_its_bias_by_position_or_by_name():
    from megapatch.numerics.fp32_output_linear import _FP32AccumulatorMode

    x, weight, bias = _small_bf16((3, 2, 4), 80), _small_bf16((5, 4), 81), _small_bf16((5,), 82)
    want = x.float() @ weight.float().t()
    with _FP32AccumulatorMode() as mode:
        plain = torch.nn.functional.linear(x, weight)
        positional = torch.nn.functional.linear(x, weight, bias)
        named = torch.nn.functional.linear(x, weight, bias=bias)
    assert mode.intercepted == 3
    for out, expected in ((plain, want), (positional, want + bias.float()), (named, want + bias.float())):
        assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert bias.abs().sum() > 0  # a bias that shows


def test_an_upstream_forward_without_exactly_one_low_precision_gemm_is_refused():
    """FP32OutputLinear asks the upstream forward for an FP32 output through its one GEMM: a forward
    with two GEMMs, or none (even with an FP32 output), is an upstream change, refused."""
    from megapatch.core.errors import UpstreamSurfaceError
    from megapatch.numerics.fp32_output_linear import FP32OutputLinear

    class One(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return torch.matmul(x, w.t())

    class Two(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return torch.matmul(x, w.t()) + torch.matmul(x, w.t())

    class NoGemm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x.float()

    x, weight = _small_bf16((3, 4), 83), _small_bf16((4, 4), 84)
    out = FP32OutputLinear.apply(One, x, weight)
    assert out.dtype == torch.float32 and torch.equal(out, x.float() @ weight.float().t())
    for upstream, calls in ((Two, 2), (NoGemm, 0)):
        with pytest.raises(UpstreamSurfaceError, match=f"GEMM was not recognised \\({calls} GEMM calls intercepted"):
            FP32OutputLinear.apply(upstream, x, weight)


def test_a_model_logit_dtype_other_than_fp32_is_refused_naming_both_settings(monkeypatch):
    """Megatron-Bridge's ``logit_dtype`` / Megatron-LM's ``--output-logit-dtype`` reach megatron-core
    as the output layer's ``output_dtype`` (PR #6252). BF16 there with ``MEGAPATCH_LOGITS_DTYPE=fp32``
    is refused, naming both sources; FP32 there (the same request) and None compose."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megapatch.core import options, state
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.logits import _lm_head as logits

    monkeypatch.setattr(state, "_current", options.Settings(logits_dtype="fp32"))
    monkeypatch.setattr(state, "_sources", {"logits_dtype": "env MEGAPATCH_LOGITS_DTYPE"})
    layer = bare_module(ColumnParallelLinear)
    layer._megapatch_expect_call = False
    layer.output_dtype = torch.bfloat16
    with pytest.raises(UnsupportedConfigurationError) as refused:
        with logits.lm_head(layer):
            pass
    message = str(refused.value)
    assert "output_dtype=torch.bfloat16" in message and "logit_dtype" in message
    assert "--output-logit-dtype" in message and "MEGAPATCH_LOGITS_DTYPE=fp32 in the environment" in message
    assert layer.output_dtype is torch.bfloat16  # left as the user built it
    for agreeing in (torch.float32, None):
        layer.output_dtype = agreeing
        with logits.lm_head(layer):
            assert layer.output_dtype is None
        assert layer.output_dtype is agreeing


# -- contracts of the pieces, in-process (the rank jobs above show them end to end) ---------------

def test_the_fp32_gemm_backends_are_called_as_their_contracts_say_and_return_a_new_fp32_tensor(
        fresh_backends, monkeypatch):
    """``linear_fp32`` hands TE's ``general_gemm`` (weight, input) with layout TN and takes element 0
    of what it returns (TE returns a tuple), hands ``torch.mm`` (input, weight^T, out_dtype); any
    leading dims are kept, the output dim is the weight's first, and the result is not a view (megatron's
    cross entropy modifies FP32 logits in place). Stand-ins for the CUDA-only backends, labelled as such:
    they compute the FP32 product the real ones return."""
    fp32_gemm = fresh_backends
    x, weight = _small_bf16((3, 2, 4), 90), _small_bf16((5, 4), 91)  # weight not square: dims are checked
    want = (x.float().reshape(6, 4) @ weight.float().t()).reshape(3, 2, 5)
    calls = []

    def general_gemm(A, B, out_dtype=None, layout=None):  # TE: D = B @ A^T for layout "TN"
        calls.append(("te", A.shape, B.shape, A.is_contiguous() and B.is_contiguous(), out_dtype, layout))
        return (B.float() @ A.float().t(), None, None, None)

    def mm(a, b, out_dtype=None):
        calls.append(("mm", a.shape, b.shape, out_dtype))
        return a.float() @ b.float()

    for name in ("te-general-gemm", "torch-mm-out-dtype", "upcast"):
        with monkeypatch.context() as m:
            m.setattr(fp32_gemm, "backend", lambda device_type=None: name)
            m.setattr(fp32_gemm, "_te_general_gemm", lambda: general_gemm)
            if name == "torch-mm-out-dtype":
                m.setattr(fp32_gemm.torch, "mm", mm)
            out = fp32_gemm.linear_fp32(x, weight)
            transposed = fp32_gemm.matmul_fp32(x, weight.t())
        for result in (out, transposed):
            assert result.dtype == torch.float32 and torch.equal(result, want), name
            assert result._base is None, name  # not a view
    assert calls == [("te", (5, 4), (6, 4), True, torch.float32, "TN")] * 2 + \
        [("mm", (6, 4), (4, 5), torch.float32)] * 2


def test_the_backend_of_a_tensor_follows_its_device_and_the_default_device_follows_cuda(fresh_backends, monkeypatch):
    fp32_gemm = fresh_backends
    with monkeypatch.context() as m:  # undone before the fixture clears the caches
        m.setattr(fp32_gemm, "_te_general_gemm", lambda: "TE's general_gemm")  # stand-in: TE present
        m.setattr(fp32_gemm.torch.cuda, "is_available", lambda: True)
        assert fp32_gemm.backend() == "te-general-gemm" and fp32_gemm.backend("cpu") == "upcast"
        m.setattr(fp32_gemm.torch.cuda, "is_available", lambda: False)
        assert fp32_gemm.backend() == "upcast" and fp32_gemm.backend("cuda") == "te-general-gemm"


def test_the_accumulator_mode_takes_only_a_low_precision_gemm_with_a_2d_weight_of_its_dtype():
    """Inside an upstream linear forward the mode turns exactly the weight GEMM into an FP32-output
    GEMM: a batched matmul (3-D second operand), a vector, FP32 or mixed-dtype operands, an ``out=``
    call or another function reach torch as they are."""
    from megapatch.numerics.fp32_output_linear import _FP32AccumulatorMode

    a, w = _small_bf16((3, 4), 92), _small_bf16((4, 5), 93)
    batched, vector = _small_bf16((2, 4, 5), 94), _small_bf16((4,), 95)
    out_buffer = torch.empty(3, 5, dtype=torch.bfloat16)
    with _FP32AccumulatorMode() as mode:
        untouched = [torch.matmul(a, batched), torch.matmul(a, vector), torch.matmul(a.float(), w.float()),
                     torch.add(a, a)]
        torch.matmul(a, w, out=out_buffer)
        with pytest.raises(RuntimeError):  # torch's own refusal of mixed dtypes, not an FP32 GEMM
            torch.matmul(a, w.half())
        assert mode.intercepted == 0
        taken = [torch.matmul(a, w), a.matmul(w), torch.matmul(a.half(), w.half())]
        assert mode.intercepted == 3
    assert [t.dtype for t in untouched] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
    assert torch.equal(untouched[0], torch.matmul(a, batched)) and torch.equal(untouched[1], torch.matmul(a, vector))
    assert out_buffer.dtype == torch.bfloat16 and torch.equal(out_buffer, torch.matmul(a, w))
    for result in taken:
        assert result.dtype == torch.float32 and torch.equal(result, a.float() @ w.float())


def test_the_linear_apply_wrapper_asks_for_fp32_only_inside_a_request_and_only_of_low_precision_input(monkeypatch):
    """``<LinearFunction>.apply``: no request, or an input that is not BF16/FP16, is upstream's call;
    a request for FP32 runs ``FP32OutputLinear`` on the Function that was called, whose backward hands
    upstream's backward the gradient in the input's dtype, as upstream returns it; any other request,
    or keyword arguments it cannot forward, are refused."""
    from megapatch.core.errors import UpstreamSurfaceError
    from megapatch.numerics import fp32_output_linear as fol

    seen = []

    class Upstream(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return torch.matmul(x, w.t())

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            seen.append(grad.dtype)
            return grad @ w, grad.transpose(-1, -2) @ x

    x, w = _small_bf16((3, 4), 98).requires_grad_(), _small_bf16((5, 4), 99).requires_grad_()
    upstream = lambda *args, **kwargs: ("upstream", args, kwargs)  # noqa: E731
    assert fol.apply_wrapper(upstream, Upstream, (x, w), {})[0] == "upstream"  # no request
    with fol.output_dtype(torch.float32):
        assert fol.requested_output_dtype() is torch.float32
        assert fol.apply_wrapper(upstream, Upstream, (x.float(), w.float()), {})[0] == "upstream"
        assert fol.apply_wrapper(upstream, Upstream, (), {})[0] == "upstream"
        out = fol.apply_wrapper(upstream, Upstream, (x, w), {})
        with pytest.raises(UpstreamSurfaceError, match="unsupported linear output request"):
            fol.apply_wrapper(upstream, Upstream, (x, w), {"extra": 1})
    assert fol.requested_output_dtype() is None
    assert out.dtype == torch.float32 and torch.equal(out, x.float() @ w.float().t())
    grad = _small_bf16((3, 5), 100).float() / 3  # FP32 and not representable in BF16
    out.backward(grad)
    assert seen == [torch.bfloat16]
    assert torch.equal(x.grad, grad.to(torch.bfloat16) @ w) and x.grad.dtype == torch.bfloat16
    with fol.output_dtype(torch.float16):
        with pytest.raises(UpstreamSurfaceError, match="unsupported linear output request torch.float16"):
            fol.apply_wrapper(upstream, Upstream, (x, w), {})


def test_the_head_path_says_which_device_and_whether_upstream_has_its_own_output_dtype(monkeypatch):
    from types import SimpleNamespace

    from megapatch.patches.logits import _lm_head as logits

    assert logits._device_type(SimpleNamespace(weight=torch.empty(2, device="meta"))) == "meta"
    for available, default in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(logits.torch.cuda, "is_available", lambda: available)
        assert logits._device_type(SimpleNamespace(weight=None)) == default  # tied weight passed per call
        assert logits._device_type(SimpleNamespace()) == default
    own = logits._path("cpu", True)
    assert own.startswith("megapatch FP32-output GEMM (upcast), not megatron-core's own output_dtype (PR #6252)")
    assert logits._path("cpu", False) == "megapatch FP32-output GEMM (upcast)"
    for requested, foreign in ((None, False), ("fp32", False), ("float32", False), (torch.float32, False),
                               ("bf16", True), (torch.bfloat16, True), (torch.float16, True)):
        assert logits._foreign_logit_dtype(requested) is foreign, requested


# -- issue 28 item 8: survivors of the sixth fresh mutation sample (seed 33) ----------------------

def test_model_construction_refuses_only_under_fp32_logits_and_only_a_model_with_an_output_layer(monkeypatch):
    """A pipeline stage before the last has no output layer: nothing to refuse under fp32 logits.
    With megapatch's logits native, a model's own logit dtype or head is upstream's business."""
    from types import SimpleNamespace

    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megapatch.core import options, state
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.logits import _lm_head as logits

    built = []
    construct = lambda *a, **k: built.append((a, k))  # noqa: E731
    own_dtype = bare_module(ColumnParallelLinear)
    own_dtype.output_dtype = torch.bfloat16
    for head in (torch.nn.Linear(2, 2), own_dtype):
        monkeypatch.setattr(state, "_current", options.NATIVE)
        logits._model_init(construct, SimpleNamespace(output_layer=head), (1,), {"k": 2})
        monkeypatch.setattr(state, "_current", options.Settings(logits_dtype="fp32"))
        with pytest.raises(UnsupportedConfigurationError):
            logits._model_init(construct, SimpleNamespace(output_layer=head), (1,), {"k": 2})
    logits._model_init(construct, SimpleNamespace(output_layer=None), (), {})
    logits._model_init(construct, SimpleNamespace(), (), {})
    assert built == [((1,), {"k": 2})] * 4 + [((), {})] * 2  # upstream's construction ran first, every time
