"""FP32 logits through megatron-core's dynamic inference engine (what Megatron RL rollouts run).

A real ``DynamicInferenceEngine`` (context, GPT inference wrapper, text-generation controller)
generates on CPU ranks (``megapatch.testing.dynamic_inference_compat``). Spies on the controller
record the logits its sampler and its log-prob computation receive, and the log-probs it computes;
the oracle is the BF16 hidden states the output layer received times the full (TP-gathered) output
weight in plain FP32, and its log-softmax. TP 1, TP 2, and PP 2 (the wrapper's pipeline methods,
activations sent between stages, the controller's logits broadcast to the first stage).
"""

import pytest
import torch

from megapatch.testing import run_ranks

V, MAX_SEQ = 128, 64
PROMPTS = ([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43, 38, 32, 79, 50, 28, 84, 19], [71, 69])


def _spy(controller, name, found):
    original = getattr(controller, name)

    def spy(*args, **kwargs):
        # <= 0.16 passes the logits; >= 0.17 reads the rows of this step from the controller's buffer
        rows = controller.inference_wrapped_model.inference_context.padded_active_token_count
        logits = args[0] if args else controller._all_logits_cuda[:, :rows]
        result = original(*args, **kwargs)
        found.append((name, str(logits.dtype), logits.detach().float().clone(),
                      result[1].detach().clone() if isinstance(result, tuple) else None))
        return result

    setattr(controller, name, spy)


def _rollouts(ctx, graph_buffer=False):
    import megapatch
    from megapatch.testing import build_tiny_gpt, gather_full_weights, tiny_gpt_config
    from megapatch.testing.dynamic_inference_compat import dynamic_engine, dynamic_inference_workarounds, generate

    found = {}
    with dynamic_inference_workarounds():
        for mode in ("native", "fp32"):
            megapatch.enable(logits_dtype=mode)
            model = build_tiny_gpt(tiny_gpt_config(tp=ctx.tp_size, pp=ctx.pp_size), vocab_size=V,
                                   seq_len=MAX_SEQ, seed=5).eval()
            hidden = []
            if ctx.is_last_stage:
                model.output_layer.register_forward_pre_hook(
                    lambda module, args: hidden.append(args[0].detach().clone()))
            engine = dynamic_engine(model, ctx.tp_size, ctx.pp_size, max_sequence_length=MAX_SEQ)
            if graph_buffer:  # >= 0.17 then copies the logits into a buffer the sampler reads (no
                # graph is captured: the engine was built without them)
                model.config.cuda_graph_impl = "local"
                engine.controller._init_dynamic_sampling_tensors()
            buffer = getattr(engine.controller, "_all_logits_cuda", None)
            seen = []
            for name in ("_dynamic_step_sample_logits", "_dynamic_step_calculate_log_probs"):
                _spy(engine.controller, name, seen)
            outputs = generate(engine, PROMPTS, tokens=5)
            weight = gather_full_weights(model, ctx)["output_layer.weight"].float() if ctx.is_last_stage else None
            oracle = [(h.float() @ weight.t()).transpose(0, 1) for h in hidden] if weight is not None else None
            found[mode] = dict(seen=seen, oracle=oracle, outputs=outputs,
                               buffer=None if buffer is None else str(buffer.dtype),
                               buffer_kept=buffer is getattr(engine.controller, "_all_logits_cuda", None),
                               status=list(megapatch.status().active))
            megapatch.disable()
    return found


def _check(ranks, last, graph_buffer=False):
    """Every rank's sampler and log-prob inputs against the last stage's oracle, step by step."""
    for mode in ("native", "fp32"):
        oracle = ranks[last][mode]["oracle"]
        assert oracle and len(oracle) >= 5  # one prefill, then decode steps
        for rank, found in enumerate(ranks):
            seen = found[mode]["seen"]
            sampled = [s for s in seen if s[0] == "_dynamic_step_sample_logits"]
            logprob = [s for s in seen if s[0] == "_dynamic_step_calculate_log_probs"]
            assert len(sampled) == len(logprob) == len(oracle), (mode, rank)
            for step, ((_, dtype, logits, _), (_, dtype2, logits2, log_probs), reference) in enumerate(
                    zip(sampled, logprob, oracle)):
                assert logits.shape == reference.shape and torch.equal(logits, logits2), (mode, rank, step)
                reference_lp = torch.log_softmax(reference[0, :log_probs.shape[0]], dim=-1)
                error = (logits - reference).abs().max().item()
                lp_error = (log_probs - reference_lp).abs().max().item()
                if mode == "fp32":
                    assert dtype == dtype2 == "torch.float32", (rank, step, dtype)
                    assert error < 1e-5 and lp_error < 1e-5, (rank, step, error, lp_error)
                else:  # upstream's BF16 logits: the oracle tells them apart
                    assert dtype == "torch.bfloat16", (rank, step, dtype)
                    assert error > 1e-4 and lp_error > 1e-4, (rank, step, error, lp_error)
        assert all(found[mode]["outputs"] == ranks[0][mode]["outputs"] for found in ranks)
    if graph_buffer and ranks[0]["native"]["buffer"] is not None:  # >= 0.17 (0.16 has no buffer)
        assert ranks[0]["native"]["buffer"] == "torch.bfloat16" and ranks[0]["fp32"]["buffer"] == "torch.float32"
        assert ranks[0]["native"]["buffer_kept"] and ranks[0]["fp32"]["buffer_kept"]  # copied into
    fp32 = ranks[0]["fp32"]
    assert "logits.fp32_inference" in fp32["status"] and "logits.fp32_lm_head" in fp32["status"]
    assert all(len(tokens) == 5 and len(prompt_lp) == len(prompt) - 1
               for (tokens, _, prompt_lp), prompt in zip(fp32["outputs"], PROMPTS))


@pytest.mark.parametrize("tp,pp,graph_buffer", [(1, 1, False), (2, 1, False), (1, 2, False), (1, 1, True)],
                         ids=["tp1", "tp2", "pp2", "tp1-cuda-graph-buffer"])
def test_fp32_logits_reach_the_dynamic_engines_sampler_and_log_probs(tp, pp, graph_buffer):
    """``tp1-cuda-graph-buffer``: the controller set up as with ``cuda_graph_impl="local"``; from
    0.17 it then allocates ``_all_logits_cuda`` in params_dtype and copies each step's logits into
    it (on 0.16 it allocates nothing and the case is the plain TP1 one)."""
    ranks = run_ranks(_rollouts, world_size=tp * pp, tp=tp, pp=pp, args=(graph_buffer,), timeout=300)
    _check(ranks, last=len(ranks) - 1, graph_buffer=graph_buffer)


def test_a_logits_buffer_allocated_in_params_dtype_becomes_fp32(monkeypatch):
    """megatron-core >= 0.17 copies the logits into ``_all_logits_cuda`` (CUDA graphs on), allocated
    in params_dtype by ``_init_dynamic_sampling_tensors``; emulated here on 0.16.1's method."""
    import megapatch
    from megatron.core.inference.text_generation_controllers import text_generation_controller as tgc

    def allocates(self):
        self._all_logits_cuda = torch.zeros((1, 4, V), dtype=torch.bfloat16)
        self._sampled_tokens_cuda = torch.empty(4, dtype=torch.int64)

    monkeypatch.setattr(tgc.TextGenerationController, "_init_dynamic_sampling_tensors", allocates)
    dtypes = {}
    for mode in ("native", "fp32"):
        megapatch.enable(logits_dtype=mode)
        controller = object.__new__(tgc.TextGenerationController)
        controller._init_dynamic_sampling_tensors()
        dtypes[mode] = (controller._all_logits_cuda.dtype, controller._all_logits_cuda.shape,
                        controller._sampled_tokens_cuda.dtype)
    assert dtypes["native"] == (torch.bfloat16, (1, 4, V), torch.int64)
    assert dtypes["fp32"] == (torch.float32, (1, 4, V), torch.int64)


def test_an_unknown_logits_buffer_is_refused_at_enable(monkeypatch):
    import megapatch
    from megapatch.core.errors import UpstreamSurfaceError
    from megatron.core.inference.text_generation_controllers import text_generation_controller as tgc

    class TextGenerationController(tgc.TextGenerationController):  # a release with a new buffer
        def _init_dynamic_sampling_tensors(self):
            dtype = self.inference_wrapped_model.inference_wrapper_config.params_dtype
            self._draft_logits = torch.empty((4, V), dtype=dtype)

    monkeypatch.setattr(tgc, "TextGenerationController", TextGenerationController)
    with pytest.raises(UpstreamSurfaceError) as err:
        megapatch.enable(logits_dtype="fp32")
    message = str(err.value)
    assert ("megatron.core.inference.text_generation_controllers.text_generation_controller."
            "TextGenerationController allocates self._draft_logits") in message
    assert "megatron-core 0." in message and "torch 2." in message
    status = megapatch.enable(logits_dtype="fp32", strict=False)
    assert status.patch("logits.fp32_inference").state == "skipped"
    assert "logits.fp32_inference" not in status.active
