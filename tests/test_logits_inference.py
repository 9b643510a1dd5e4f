"""FP32 logits through megatron-core's static-batching inference wrapper and controller."""

import torch

from megapatch.testing import run_ranks

V, S, B = 128, 8, 4


def _inference(ctx):
    import megapatch
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
    from megatron.core.inference.text_generation_controllers import text_generation_controller as tgc
    from megatron.core.inference import communication_utils
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    tokens = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    found = {}
    for mode in ("native", "fp32"):
        megapatch.enable(logits_dtype=mode)
        model = build_tiny_gpt(tiny_gpt_config(tp=1), vocab_size=V, seq_len=S, seed=5).eval()
        config = InferenceWrapperConfig(hidden_size=64, params_dtype=torch.bfloat16,
                                        inference_batch_times_seqlen_threshold=S,  # 1 request per micro-batch
                                        padded_vocab_size=V)

        def run(method):
            wrapper = GPTInferenceWrapper(model, config, StaticInferenceContext(B, S))
            wrapper.prep_model_for_inference()
            with torch.inference_mode():
                return getattr(wrapper, method)(wrapper.prep_inference_input(tokens))

        row = found[mode] = {}
        for method in ("forward_pass_without_pipeline_parallel",
                       "forward_pass_with_pipeline_parallel_small_input_batch",
                       "forward_pass_with_pipeline_parallel_large_input_batch"):
            logits = run(method)
            row[method] = (str(logits.dtype), logits.float())
        # the controller broadcasts logits from the last stage with dtype=params_dtype
        last = row["forward_pass_without_pipeline_parallel"][1]
        original = communication_utils._is_cuda
        communication_utils._is_cuda = lambda t: None  # CPU tensors: upstream asserts .is_cuda
        try:
            out = tgc.broadcast_from_last_pipeline_stage(list(last.shape), torch.bfloat16,
                                                         last.to(torch.float32 if mode == "fp32" else torch.bfloat16).contiguous(),
                                                         pp_group=ctx.pp_group)
        finally:
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
    # the large-batch path runs one request per micro-batch: same values up to batch-size effects
    assert torch.allclose(fp32["forward_pass_with_pipeline_parallel_large_input_batch"][1], reference, atol=1e-5)
    for path, (dtype, _logits) in native.items():
        if path != "forward_pass_without_pipeline_parallel":
            assert dtype == "torch.bfloat16", (path, dtype)  # upstream downcasts: the patch is needed
