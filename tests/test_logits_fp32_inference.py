"""FP32 logits through megatron-core's static-batching inference wrapper and controller.

Every logits tensor is compared with an independent oracle: the BF16 hidden states and weight the
output layer received, multiplied in plain FP32. At PP=2 (world 2) activations really travel
between the stages and the controller's broadcast runs on its receiving side (the first stage).
"""

import inspect

import pytest
import torch

from megapatch.testing import run_ranks

V, S, B = 128, 8, 4
PP_METHODS = ("forward_pass_with_pipeline_parallel_small_input_batch",  # <= 0.16
              "forward_pass_with_pipeline_parallel_large_input_batch",  # <= 0.16
              "forward_pass_with_pipeline_parallel")                    # >= 0.17


def _inference(ctx, kind="gpt"):
    """World 1: the no-PP path and the PP methods (one stage), each with its oracle; the
    controller broadcast (sender side only at world 1). ``kind="moe"``: the tiny Qwen3-MoE, with
    FP32 reductions (expert sums) on too."""
    import megapatch
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    found = {}
    for mode in ("native", "fp32"):
        megapatch.enable(logits_dtype=mode, **({"tp_reduce_dtype": mode} if kind == "moe" else {}))
        if kind == "moe":
            from megapatch.testing.scenarios import moe_tiny

            model = moe_tiny.build(moe_tiny.qwen3_moe_config(1), seed=5).eval()
        else:
            model = build_tiny_gpt(tiny_gpt_config(tp=1), vocab_size=V, seq_len=S, seed=5).eval()
        calls, oracle = _head_oracle(model)
        row = found[mode] = {}
        methods = [m for m in ("forward_pass_without_pipeline_parallel",) + PP_METHODS
                   if hasattr(GPTInferenceWrapper, m)]
        for method in methods:
            calls.clear()
            logits = _wrapper_run(model, tokens, method, ctx)
            row[method] = (str(logits.dtype), logits.float(), oracle().float())
        last, reference = row["forward_pass_without_pipeline_parallel"][1:]
        out = _broadcast_logits(last.to(torch.float32 if mode == "fp32" else torch.bfloat16).contiguous(),
                                last.shape, ctx)
        row["broadcast"] = (str(out.dtype), out.float(), reference)
    megapatch.disable()
    return found


@pytest.mark.quick("logits.fp32_inference")
def test_fp32_logits_survive_every_inference_path():
    _check_every_path(run_ranks(_inference, world_size=1, timeout=300)[0])


def test_fp32_logits_survive_every_inference_path_of_an_moe_model():
    _check_every_path(run_ranks(_inference, world_size=1, timeout=300, args=("moe",))[0])


def _check_every_path(found):
    fp32, native = found["fp32"], found["native"]
    for path, (dtype, logits, oracle) in fp32.items():
        assert dtype == "torch.float32", (path, dtype)
        assert logits.shape == oracle.shape and (logits - oracle).abs().max() < 1e-5, (path, logits.shape, oracle.shape)
    assert len(fp32) >= 3  # no-PP path, at least one PP path, the broadcast
    for path, (dtype, logits, oracle) in native.items():
        if path != "forward_pass_without_pipeline_parallel":
            assert dtype == "torch.bfloat16", (path, dtype)  # upstream downcasts: the patch is needed
        assert (logits - oracle).abs().max() > 1e-5, path  # the oracle can fail


def _head_oracle(model):
    """Records the BF16 hidden states and weight each call of the model's output layer receives;
    ``oracle()`` is their plain FP32 product, [batch, seq, vocab], micro-batches in call order."""
    calls = []
    if getattr(model, "output_layer", None) is not None:
        model.output_layer.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append(
                (args[0].detach(), (kwargs.get("weight") if kwargs.get("weight") is not None
                                    else module.weight).detach())),
            with_kwargs=True)

    def oracle():
        return torch.cat([(h.float() @ w.float().t()).transpose(0, 1) for h, w in calls], dim=0)

    calls.clear()
    return calls, oracle


def _wrapper_run(model, tokens, method, ctx, params_dtype=torch.bfloat16):
    """One static-batching wrapper pass of ``method`` over ``tokens`` (every version's signature)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    try:  # <= 0.16
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig)
    except ImportError:  # >= 0.17: the wrapper reads the model's config
        InferenceWrapperConfig = None

    config = InferenceWrapperConfig and InferenceWrapperConfig(
        hidden_size=64, params_dtype=params_dtype,
        inference_batch_times_seqlen_threshold=S,  # 1 request per micro-batch
        padded_vocab_size=V)
    context = StaticInferenceContext(B, S)
    wrapper = (GPTInferenceWrapper(model, config, context) if config is not None
               else GPTInferenceWrapper(model, context))
    prep = wrapper.prep_model_for_inference
    prep(tokens) if len(inspect.signature(prep).parameters) >= 1 else prep()
    with torch.inference_mode():
        return getattr(wrapper, method)(wrapper.prep_inference_input(tokens))


def _broadcast_logits(logits, shape, ctx, params_dtype=torch.bfloat16):
    """The controller's broadcast of the last stage's logits (dtype=params_dtype, as upstream calls it)."""
    from megatron.core.inference import communication_utils
    from megatron.core.inference.text_generation_controllers import text_generation_controller as tgc

    pp_kwargs = ({"pp_group": ctx.pp_group}
                 if "pp_group" in inspect.signature(tgc.broadcast_from_last_pipeline_stage).parameters else {})
    original = getattr(communication_utils, "_is_cuda", None)
    communication_utils._is_cuda = lambda t: None  # CPU tensors: upstream asserts .is_cuda
    try:
        return tgc.broadcast_from_last_pipeline_stage(list(shape), params_dtype, logits, **pp_kwargs)
    finally:
        if original is None:
            del communication_utils._is_cuda
        else:
            communication_utils._is_cuda = original


def _inference_pp2(ctx, dtype="bfloat16"):
    """PP=2: both stages run the wrapper's pipeline paths (activations really travel), the last
    stage's logits and their FP32 oracle are kept, then the controller broadcast delivers the
    logits to the first stage, the receiving side. ``dtype``: the model's (BF16, or FP16 with
    megatron's fp16 flags), which upstream downcasts the logits to."""
    import megapatch
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    methods = [m for m in PP_METHODS if hasattr(GPTInferenceWrapper, m)]
    params_dtype = getattr(torch, dtype)
    overrides = ({} if dtype == "bfloat16" else
                 dict(params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=False, fp16=True))
    found = {}
    for mode in ("native", "fp32"):
        megapatch.enable(logits_dtype=mode)
        model = build_tiny_gpt(tiny_gpt_config(tp=1, pp=ctx.pp_size, **overrides), vocab_size=V, seq_len=S,
                               seed=5).eval()
        calls, oracle = _head_oracle(model)
        row = found[mode] = {}
        for method in methods:
            calls.clear()
            logits = _wrapper_run(model, tokens, method, ctx, params_dtype)
            row[method] = (None if logits is None else
                           (str(logits.dtype), logits.float(), oracle().float()))
        first = row[methods[0]]
        sent = first[1].to(torch.float32 if mode == "fp32" else params_dtype).contiguous() \
            if ctx.is_last_stage else None
        # the shape and the oracle reach the first stage by plain torch broadcasts (not the patched one)
        last_rank = torch.distributed.get_process_group_ranks(ctx.pp_group)[-1]
        shape = torch.tensor(first[1].shape) if ctx.is_last_stage else torch.empty(3, dtype=torch.int64)
        torch.distributed.broadcast(shape, src=last_rank, group=ctx.pp_group)
        shape = tuple(shape.tolist())
        got = _broadcast_logits(sent, shape, ctx, params_dtype)
        reference = first[2].contiguous() if ctx.is_last_stage else torch.empty(shape)
        torch.distributed.broadcast(reference, src=last_rank, group=ctx.pp_group)
        row["broadcast"] = (str(got.dtype), got.float(), reference)
    megapatch.disable()
    return found


@pytest.mark.parametrize("model_dtype", ["bfloat16", "float16"])
def test_fp32_logits_cross_the_pipeline_and_reach_the_receiving_stage(model_dtype):
    """BF16 and FP16 models (issue 28 survivor: FP16 logits kept across the stages went unseen
    while every inference test used BF16)."""
    first_stage, last_stage = run_ranks(_inference_pp2, world_size=2, pp=2, args=(model_dtype,), timeout=300)
    native_dtype = f"torch.{model_dtype}"
    for method in ("native", "fp32"):
        assert all(v is None for k, v in first_stage[method].items() if k != "broadcast")  # not last
    fp32, native = last_stage["fp32"], last_stage["native"]
    paths = [k for k in fp32 if k != "broadcast"]
    assert paths, "no pipeline-parallel inference path in this megatron-core"
    for path in paths:
        dtype, logits, oracle = fp32[path]
        assert dtype == "torch.float32", (path, dtype)
        assert logits.shape == oracle.shape and (logits - oracle).abs().max() < 1e-5, (path, logits.shape, oracle.shape)
        dtype, logits, oracle = native[path]
        assert dtype == native_dtype and (logits - oracle).abs().max() > 1e-5, path  # the oracle can fail
    for rank, stage in enumerate((first_stage, last_stage)):
        dtype, got, reference = stage["fp32"]["broadcast"]
        assert dtype == "torch.float32", (rank, dtype)
        assert (got - reference).abs().max() < 1e-5, rank
        assert torch.equal(got, first_stage["fp32"]["broadcast"][1])  # both stages hold the same
        dtype, got, reference = stage["native"]["broadcast"]
        assert dtype == native_dtype and (got - reference).abs().max() > 1e-5, rank


def test_only_the_controllers_logits_broadcast_is_wrapped_not_the_shared_function():
    """fresh-sample survivor (logits_fp32_inference.py: the broadcast's target with
    ``rebind_aliases=True``): ``broadcast_from_last_pipeline_stage`` is defined in
    ``inference.communication_utils`` and shared by whoever imports it; only the controller's copy
    (its logits broadcasts) may broadcast FP32. Rebinding every alias would turn any other
    module's BF16/FP16 broadcast of the same function into FP32, which its receiver does not
    expect."""
    import megapatch
    from megatron.core.inference import communication_utils
    from megatron.core.inference.text_generation_controllers import text_generation_controller as tgc

    original = communication_utils.broadcast_from_last_pipeline_stage
    assert tgc.broadcast_from_last_pipeline_stage is original  # megapatch off: one shared function
    megapatch.enable(logits_dtype="fp32")
    assert tgc.broadcast_from_last_pipeline_stage is not original  # the controller's logits broadcasts
    assert communication_utils.broadcast_from_last_pipeline_stage is original
    megapatch.disable()
    assert tgc.broadcast_from_last_pipeline_stage is original


# -- the inference patch's pieces, in-process (the rank jobs above show them end to end) ----------

def _logits_dtype(monkeypatch, value):
    from megapatch.core import options, state

    monkeypatch.setattr(state, "_current", options.Settings(logits_dtype=value))


def test_the_pipeline_forward_returns_the_models_fp32_logits_of_every_micro_batch_in_order(monkeypatch):
    """The wrapper's ``_forward`` hands the model's FP32 logits to the enclosing pipeline forward,
    which returns them instead of its own rounded copy: micro-batches concatenated in the order the
    model ran them; a stage that is not the last (no logits, or none from the model) returns
    upstream's value; a shape that does not match upstream's is refused."""
    from megapatch.core.errors import UpstreamSurfaceError
    from megapatch.patches.logits import fp32_inference as patch

    first, second = torch.arange(6.0).view(1, 2, 3), -torch.arange(6.0).view(1, 2, 3) - 1
    model = lambda logits: patch._forward(lambda: logits, None, (), {})  # noqa: E731

    def pipeline(*micro_batches, rounded=None):
        def upstream():
            outputs = [model(m) for m in micro_batches]
            return rounded if rounded is not None else (torch.cat(outputs).to(torch.bfloat16) if outputs else None)
        upstream.__name__ = "forward_pass_with_pipeline_parallel"
        return patch._pipeline_forward(upstream, None, (), {})

    _logits_dtype(monkeypatch, "fp32")
    assert pipeline(first) is first
    both = pipeline(first, second)
    assert both.dtype == torch.float32 and torch.equal(both, torch.cat([first, second]))
    assert pipeline() is None  # not the last stage
    bf16 = first.to(torch.bfloat16)
    assert pipeline(bf16).dtype == torch.bfloat16  # a model without FP32 logits: nothing to hand on
    with pytest.raises(UpstreamSurfaceError, match=r"forward_pass_with_pipeline_parallel returned logits of "
                                                   r"shape \(1, 2, 2\), the model produced \(1, 2, 3\)"):
        pipeline(first, rounded=torch.zeros(1, 2, 2))
    assert model(first) is first  # outside a pipeline forward nothing is kept
    _logits_dtype(monkeypatch, "native")
    assert pipeline(first).dtype == torch.bfloat16


def test_the_logits_broadcast_is_asked_for_fp32_with_every_other_argument_passed_on(monkeypatch):
    """``broadcast_from_last_pipeline_stage(size, dtype, tensor=None, pp_group=...)``: a BF16/FP16
    request (positional or keyword) becomes FP32 and the sender's tensor FP32; any other dtype,
    and megapatch's logits native, are upstream's call as made."""
    from megapatch.patches.logits import fp32_inference as patch

    calls = []
    upstream = lambda *args, **kwargs: calls.append((args, kwargs)) or "received"  # noqa: E731
    bf16 = torch.tensor([1.5, 2.25], dtype=torch.bfloat16)
    fp32 = torch.tensor([1.0, 2.0])
    _logits_dtype(monkeypatch, "fp32")
    for low in (torch.bfloat16, torch.float16):
        assert patch._broadcast(upstream, None, ([1, 2], low, bf16, "group"), {}) == "received"
        (size, dtype, tensor, *rest), kwargs = calls.pop()
        assert (size, dtype, rest, kwargs) == ([1, 2], torch.float32, ["group"], {})
        assert tensor.dtype == torch.float32 and torch.equal(tensor, bf16.float())
        patch._broadcast(upstream, None, (), {"size": [2], "dtype": low, "pp_group": "group"})
        assert calls.pop() == (([2], torch.float32, None), {"pp_group": "group"})  # a receiving stage
        patch._broadcast(upstream, None, ([2], low), {"tensor": fp32})
        assert calls.pop()[0][2] is fp32  # already FP32: passed as it is
    for other in (torch.float32, torch.int64, None):
        patch._broadcast(upstream, None, ([2], other, bf16), {})
        assert calls.pop() == (([2], other, bf16), {})
    _logits_dtype(monkeypatch, "native")
    patch._broadcast(upstream, None, ([2], torch.bfloat16, bf16), {})
    assert calls.pop() == (([2], torch.bfloat16, bf16), {})


def test_the_dynamic_engines_logits_buffers_are_reallocated_in_fp32_only_when_low_precision(monkeypatch):
    import types

    from megapatch.patches.logits import fp32_inference as patch

    def controller(buffer):
        return types.SimpleNamespace(_all_logits_cuda=buffer, other=torch.zeros(2, dtype=torch.bfloat16))

    _logits_dtype(monkeypatch, "fp32")
    for low in (torch.bfloat16, torch.float16):
        held = controller(torch.ones(3, 5, dtype=low))
        assert patch._sampling_buffers(lambda: "allocated", held, (), {}) == "allocated"
        assert held._all_logits_cuda.dtype == torch.float32 and held._all_logits_cuda.shape == (3, 5)
        assert held.other.dtype == torch.bfloat16  # only the known logits buffers
    for kept in (torch.ones(3, dtype=torch.float32), None, "not a tensor"):
        held = controller(kept)
        patch._sampling_buffers(lambda: None, held, (), {})
        assert held._all_logits_cuda is kept
    _logits_dtype(monkeypatch, "native")
    held = controller(torch.ones(3, dtype=torch.bfloat16))
    patch._sampling_buffers(lambda: None, held, (), {})
    assert held._all_logits_cuda.dtype == torch.bfloat16


class _Allocates:
    """Source read by ``_dtype_allocations`` (never instantiated)."""

    def allocate(self, n):
        self.direct = torch.empty(n, dtype=self.config.params_dtype)
        dt = self.config.params_dtype
        alias = dt
        self.through_alias = torch.zeros(n, dtype=alias)
        self.fixed = torch.zeros(n, dtype=torch.float32)
        self.undeclared = torch.zeros(n)
        self.not_torch = list(dtype=dt)  # noqa: F821 -- parsed, never run
        self.numpy_buffer = np.zeros(n, dtype=dt)  # noqa: F821 -- a module sorting before "torch"
        self.xla_buffer = xm.zeros(n, dtype=dt)  # noqa: F821 -- and one after it
        other = self
        other.not_self = torch.zeros(n, dtype=dt)

    def elsewhere(self, n):
        self.unrelated = torch.zeros(n, dtype=dt)  # noqa: F821 -- dt is another method's name


def test_the_buffer_probe_reads_which_attributes_are_allocated_in_the_models_dtype():
    from megapatch.patches.logits.fp32_inference import _dtype_allocations

    assert _dtype_allocations(_Allocates) == {"direct": "self.config.params_dtype", "through_alias": "alias"}


def test_the_probe_says_what_it_cannot_read_or_does_not_know(monkeypatch):
    from megapatch.patches.logits import fp32_inference as patch

    assert patch._probe() is None
    monkeypatch.setattr(patch, "_dtype_allocations", lambda cls: {"_all_logits_cuda": "dt", "_draft": "dt"})
    assert patch._probe() == (f"{patch.CONTROLLER}.TextGenerationController allocates self._draft (dtype=dt) in "
                              f"the model's dtype, a buffer megapatch does not know: its logits would stay in BF16/FP16")

    for error in (OSError, TypeError, SyntaxError):  # no source file; a built-in; source it cannot parse
        def unreadable(cls, error=error):
            raise error("cannot read it")

        monkeypatch.setattr(patch, "_dtype_allocations", unreadable)
        assert patch._probe().endswith(f"to check its logits buffers ({error.__name__}: cannot read it)")
    from megatron.core.inference.model_inference_wrappers import abstract_model_inference_wrapper as amiw

    for name in patch.PP_METHODS:
        monkeypatch.delattr(amiw.AbstractModelInferenceWrapper, name, raising=False)
    assert patch._probe().endswith("the pipeline-parallel inference path changed")
