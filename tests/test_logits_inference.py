"""FP32 logits through megatron-core's static-batching inference wrapper and controller."""

import inspect

import torch

from megapatch.testing import run_ranks

V, S, B = 128, 8, 4


def _inference(ctx):
    import megapatch
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    try:  # <= 0.16
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig)
    except ImportError:  # >= 0.17: the wrapper reads the model's config
        InferenceWrapperConfig = None
    from megatron.core.inference.text_generation_controllers import text_generation_controller as tgc
    from megatron.core.inference import communication_utils
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    found = {}
    for mode in ("native", "fp32"):
        megapatch.enable(logits_dtype=mode)
        model = build_tiny_gpt(tiny_gpt_config(tp=1), vocab_size=V, seq_len=S, seed=5).eval()
        config = InferenceWrapperConfig and InferenceWrapperConfig(
            hidden_size=64, params_dtype=torch.bfloat16,
            inference_batch_times_seqlen_threshold=S,  # 1 request per micro-batch
            padded_vocab_size=V)

        def run(method):
            context = StaticInferenceContext(B, S)
            wrapper = (GPTInferenceWrapper(model, config, context) if config is not None
                       else GPTInferenceWrapper(model, context))
            prep = wrapper.prep_model_for_inference
            prep(tokens) if len(inspect.signature(prep).parameters) >= 1 else prep()
            with torch.inference_mode():
                return getattr(wrapper, method)(wrapper.prep_inference_input(tokens))

        row = found[mode] = {}
        methods = [m for m in ("forward_pass_without_pipeline_parallel",
                               "forward_pass_with_pipeline_parallel_small_input_batch",
                               "forward_pass_with_pipeline_parallel_large_input_batch",
                               "forward_pass_with_pipeline_parallel")
                   if hasattr(GPTInferenceWrapper, m)]
        for method in methods:
            logits = run(method)
            row[method] = (str(logits.dtype), logits.float())
        # the controller broadcasts logits from the last stage with dtype=params_dtype
        last = row["forward_pass_without_pipeline_parallel"][1]
        pp_kwargs = ({"pp_group": ctx.pp_group}
                     if "pp_group" in inspect.signature(tgc.broadcast_from_last_pipeline_stage).parameters else {})
        original = getattr(communication_utils, "_is_cuda", None)
        communication_utils._is_cuda = lambda t: None  # CPU tensors: upstream asserts .is_cuda
        try:
            out = tgc.broadcast_from_last_pipeline_stage(list(last.shape), torch.bfloat16,
                                                         last.to(torch.float32 if mode == "fp32" else torch.bfloat16).contiguous(),
                                                         **pp_kwargs)
        finally:
            if original is None:
                del communication_utils._is_cuda
            else:
                communication_utils._is_cuda = original
        row["broadcast"] = (str(out.dtype), out.float())
    megapatch.disable()
    return found


def test_fp32_logits_survive_every_inference_path():
    found = run_ranks(_inference, world_size=1, timeout=300)[0]
    fp32, native = found["fp32"], found["native"]
    reference = fp32["forward_pass_without_pipeline_parallel"][1]
    for path, (dtype, logits) in fp32.items():
        assert dtype == "torch.float32", (path, dtype)
        assert torch.equal(logits, reference) or path.endswith("large_input_batch"), path
    # the large-batch path (<= 0.16) runs one request per micro-batch: same values up to batch-size effects
    large = fp32.get("forward_pass_with_pipeline_parallel_large_input_batch")
    assert large is None or torch.allclose(large[1], reference, atol=1e-5)
    assert len(fp32) >= 3  # no-PP path, at least one PP path, the broadcast
    for path, (dtype, _logits) in native.items():
        if path != "forward_pass_without_pipeline_parallel":
            assert dtype == "torch.bfloat16", (path, dtype)  # upstream downcasts: the patch is needed
