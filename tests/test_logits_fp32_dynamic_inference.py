"""FP32 logits through megatron-core's dynamic inference engine (what Megatron RL rollouts run).

A real ``DynamicInferenceEngine`` (context, GPT inference wrapper, text-generation controller)
generates on CPU ranks (``megapatch.testing.stand_ins.dynamic_inference_compat``). Spies on the controller
record the logits its sampler and its log-prob computation receive, and the log-probs it computes;
the oracle is the BF16 hidden states the output layer received times the full (TP-gathered) output
weight in plain FP32, and its log-softmax. TP 1, TP 2, and PP 2 (the wrapper's pipeline methods,
activations sent between stages, the controller's logits broadcast to the first stage).
"""

import pytest
import torch
from packaging.version import Version

from megapatch.core.upstream_versions import version_of
from megapatch.testing import run_ranks

# the tiny engine builder (megapatch.testing.stand_ins.dynamic_inference_compat) knows the dynamic context's
# constructor of 0.16 and of 0.17+; 0.13-0.15 take other arguments and are not covered here
pytestmark = pytest.mark.skipif(Version(version_of("megatron-core") or "0") < Version("0.16"),
                                reason="the dynamic-engine tests cover megatron-core >= 0.16 (0.16.1, "
                                       "0.19.2, Megatron-LM main ran); older context APIs differ")

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


def _model(ctx, kind):
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    if kind == "moe":  # the tiny Qwen3-MoE (QK norm, 8 experts top-2, alltoall); without sequence
        # parallelism, so that the output layer's input hook sees every token (the oracle's input)
        from megapatch.testing.scenarios import moe_tiny

        return moe_tiny.build(moe_tiny.qwen3_moe_config(ctx.tp_size, sequence_parallel=False), seed=5).eval()
    return build_tiny_gpt(tiny_gpt_config(tp=ctx.tp_size, pp=ctx.pp_size), vocab_size=V,
                          seq_len=MAX_SEQ, seed=5).eval()


def _rollouts(ctx, graph_buffer=False, kind="gpt"):
    import megapatch
    from megapatch.testing import gather_full_weights
    from megapatch.testing.stand_ins.dynamic_inference_compat import dynamic_engine, dynamic_inference_workarounds, generate

    found = {}
    with dynamic_inference_workarounds():
        for mode in ("native", "fp32"):
            # an MoE rollout as RL runs it: FP32 reductions (expert sums included) and FP32 logits
            megapatch.enable(logits_dtype=mode, **({"tp_reduce_dtype": mode} if kind == "moe" else {}))
            model = _model(ctx, kind)
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


@pytest.mark.parametrize("tp,pp,graph_buffer,kind", [(1, 1, False, "gpt"), (2, 1, False, "gpt"), (1, 2, False, "gpt"),
                                                   (1, 1, True, "gpt"), (2, 1, False, "moe")],
                         ids=["tp1", "tp2", "pp2", "tp1-cuda-graph-buffer", "moe-tp2"])
def test_fp32_logits_reach_the_dynamic_engines_sampler_and_log_probs(tp, pp, graph_buffer, kind):
    """``tp1-cuda-graph-buffer``: the controller set up as with ``cuda_graph_impl="local"``; from
    0.17 it then allocates ``_all_logits_cuda`` in params_dtype and copies each step's logits into
    it (on 0.16 it allocates nothing and the case is the plain TP1 one). ``moe-tp2``: the tiny
    Qwen3-MoE (megapatch.testing.scenarios.moe_tiny) with FP32 reductions too."""
    ranks = run_ranks(_rollouts, world_size=tp * pp, tp=tp, pp=pp, args=(graph_buffer, kind), timeout=300)
    _check(ranks, last=len(ranks) - 1, graph_buffer=graph_buffer)
    if kind == "moe":
        assert "tp_reduce.moe" in ranks[0]["fp32"]["status"]


@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_logits_buffer_allocated_in_params_dtype_becomes_fp32(monkeypatch, params_dtype):
    """megatron-core >= 0.17 copies the logits into ``_all_logits_cuda`` (CUDA graphs on), allocated
    in params_dtype by ``_init_dynamic_sampling_tensors``; emulated here on 0.16.1's method. BF16
    and FP16 models alike (issue 28: every inference test used BF16)."""
    import megapatch
    from megatron.core.inference.text_generation_controllers import text_generation_controller as tgc

    def allocates(self):
        self._all_logits_cuda = torch.zeros((1, 4, V), dtype=params_dtype)
        self._sampled_tokens_cuda = torch.empty(4, dtype=torch.int64)

    monkeypatch.setattr(tgc.TextGenerationController, "_init_dynamic_sampling_tensors", allocates)
    dtypes = {}
    for mode in ("native", "fp32"):
        megapatch.enable(logits_dtype=mode)
        controller = object.__new__(tgc.TextGenerationController)
        controller._init_dynamic_sampling_tensors()
        dtypes[mode] = (controller._all_logits_cuda.dtype, controller._all_logits_cuda.shape,
                        controller._sampled_tokens_cuda.dtype)
    assert dtypes["native"] == (params_dtype, (1, 4, V), torch.int64)
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


def _has_mtp_single_step() -> bool:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    return hasattr(LanguageModule, "compute_mtp_single_step")


def _mtp_drafts(ctx):
    """``compute_mtp_single_step`` (what the dynamic engine's speculative decoding calls for each
    MTP depth) on a tiny GPT with one MTP layer, natively and with FP32 logits."""
    from unittest import mock

    import megapatch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import multi_token_prediction
    from megapatch.testing import build_tiny_gpt, gather_full_weights, tiny_gpt_config

    found = {}
    for mode in ("native", "fp32"):
        megapatch.enable(logits_dtype=mode)
        config = tiny_gpt_config(tp=ctx.tp_size, mtp_num_layers=1)
        spec = get_gpt_mtp_block_spec(config, get_gpt_layer_local_spec(), use_transformer_engine=False)
        # main, without TE: upstream's inference-layer classes are mocks and its isinstance check
        # raises; no inference-optimized (TE) layer exists here, so the answer is False (0.18/0.19
        # have no such check: create=True adds a name nothing reads)
        with mock.patch.object(multi_token_prediction, "is_inference_column_parallel_linear",
                               lambda module: False, create=True):
            model = build_tiny_gpt(config, vocab_size=V, seq_len=MAX_SEQ, seed=5, mtp_block_spec=spec).eval()
        hidden = []
        model.output_layer.register_forward_pre_hook(lambda module, args: hidden.append(args[0].detach().clone()))
        torch.manual_seed(0)
        states = torch.randn(3, 1, config.hidden_size).to(config.params_dtype)
        mtp_hidden, logits = model.compute_mtp_single_step(
            hidden_states=states, next_token_ids=torch.tensor([[3, 14, 71]]),
            position_ids=torch.tensor([[11, 9, 2]]), depth=0)
        weight = gather_full_weights(model, ctx)["output_layer.weight"].float()
        oracle = hidden[0].float() @ weight.t()  # the BF16 MTP hidden states times the full weight
        found[mode] = dict(dtype=str(logits.dtype), shape=tuple(logits.shape), calls=len(hidden),
                           error=(logits.float() - oracle).abs().max().item(), mtp_hidden=mtp_hidden.clone())
        megapatch.disable()
    return found


@pytest.mark.skipif(not _has_mtp_single_step(), reason="this megatron-core has no "
                    "LanguageModule.compute_mtp_single_step (MTP speculative decoding: 0.18+)")
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_mtp_draft_logits_are_fp32(tp):
    """The MTP draft logits of speculative decoding: upstream calls the output layer in
    ``compute_mtp_single_step``, outside ``GPTModel.forward``; with FP32 logits it is marked too."""
    for found in run_ranks(_mtp_drafts, world_size=tp, tp=tp, timeout=300):
        native, fp32 = found["native"], found["fp32"]
        assert native["shape"] == fp32["shape"] == (3, 1, V) and native["calls"] == fp32["calls"] == 1
        assert fp32["dtype"] == "torch.float32" and fp32["error"] < 1e-5, fp32
        assert native["dtype"] == "torch.bfloat16" and native["error"] > 1e-4, native  # the oracle can fail
        assert torch.equal(native["mtp_hidden"], fp32["mtp_hidden"])  # only the head changes


EXAMPLE = "examples/inference/gpt/gpt_dynamic_inference.py"
PROMPTS_TEXT = ("w1 w2 w3 . w4 w5 w6 w7", "w9 . w10 w11 w12 w13 w14 w15 w16 w17 w18")


@pytest.fixture(scope="module")
def example_checkout(tmp_path_factory):
    """core_v0.16.1's checkout, a word-level tokenizer with a BOS (the example strips it; neither
    NullTokenizer has one), and a pretrain_gpt.py checkpoint of the initial weights at TP 1 and 2."""
    import importlib.util
    import os
    from pathlib import Path

    from conftest import REPO
    from megapatch.testing.ranks import megatron_lm_runs as mlm

    missing = mlm.missing_training_modules() + [m for m in ("simpy", "transformers", "tokenizers")
                                                if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"upstream's dynamic-inference example needs {', '.join(missing)} (pip install them)")
    tarball = Path(os.environ.get("MEGATRON_LM_TARBALLS", Path(REPO).parent / "shared" / "megatron-lm")) \
        / mlm.TARBALLS["core_v0.16.1"]
    if not tarball.is_file():
        pytest.skip(f"no Megatron-LM source: {tarball} is absent")
    root = tmp_path_factory.mktemp("example")
    checkout = mlm.unpack(tarball, root / "src")
    from megapatch.testing.scenarios.llama_hf import _tokenizer

    _tokenizer(256).save_pretrained(str(root / "tokenizer"))
    for tp in (1, 2):
        run = mlm.launch(checkout, _example_flags(tp, ["--save", str(root / f"ckpt{tp}"), "--save-interval", "1"]),
                         nproc=tp, timeout=300)
        assert run.returncode == 0, run.tail()
    return checkout, root


def _example_flags(tp, extra):
    from megapatch.testing.ranks import megatron_lm_runs as mlm

    # vocab 255 + EOD pads to 256 at TP 1 and 2 (the tokenizer's 256 too); lr 0 keeps the initial
    # weights, the same full model at both TP sizes
    return mlm.tiny_gpt_flags(tp=tp, iters=1, vocab=255, seq=64, lr=0.0,
                              extra=["--ckpt-format", "torch", *extra])


def _run_example(example_checkout, tp, env):
    import json

    from megapatch.testing.ranks import megatron_lm_runs as mlm

    checkout, root = example_checkout
    out = root / f"out-{tp}-{len(env)}.json"
    flags = _example_flags(tp, [
        "--load", str(root / f"ckpt{tp}"), "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(root / "tokenizer"), "--prompts", *PROMPTS_TEXT,
        "--num-tokens-to-generate", "6", "--return-log-probs", "--top_k", "1",
        "--inference-dynamic-batching-buffer-size-gb", "0.05",
        "--inference-dynamic-batching-block-size", "16", "--inference-dynamic-batching-max-requests", "8",
        "--inference-dynamic-batching-max-tokens", "512", "--output-path", str(out)])
    run = mlm.launch(checkout, flags, nproc=tp, timeout=300, script=EXAMPLE,
                     megapatch_env=env,
                     entry=["-m", "megapatch.testing.ranks.dynamic_inference_launch"],
                     extra_env={"PYTHONPATH": str(checkout)})  # as upstream's launch scripts set it
    assert run.returncode == 0, run.tail()
    results = [r for r in json.loads(out.read_text()).values() if isinstance(r, dict) and "input_prompt" in r]
    return run, sorted(results, key=lambda r: r["input_prompt"])


def test_upstreams_dynamic_inference_example_runs_on_cpu_ranks_with_fp32_logits(example_checkout):
    """core_v0.16.1's examples/inference/gpt/gpt_dynamic_inference.py, unmodified, through the CPU
    launcher, megapatch activated by MEGAPATCH_* variables as in any launch: natively, and with
    FP32 logits + tp_invariant at TP 1 and TP 2. The prompt log-probs come from the prefill (its
    input does not depend on sampling): FP32 logits change them; and with tp_invariant the TP 2
    rollout's log-probs, prompt and greedy generation alike, equal TP 1's bit for bit."""
    patched = {"MEGAPATCH_LOGITS_DTYPE": "fp32", "MEGAPATCH_TP_INVARIANT": "1"}
    native_run, native = _run_example(example_checkout, 1, {})
    fp32_run, fp32 = _run_example(example_checkout, 1, patched)
    _, fp32_tp2 = _run_example(example_checkout, 2, patched)
    assert "logits.fp32_inference" in fp32_run.log and "logits.fp32_inference" not in native_run.log
    assert [r["input_prompt"] for r in native] == [r["input_prompt"] for r in fp32] == sorted(PROMPTS_TEXT)
    for a, b, c in zip(native, fp32, fp32_tp2):
        assert len(a["generated_logprobs"]) == len(b["generated_logprobs"]) == 6
        assert len(b["prompt_logprobs"]) == len(b["input_prompt"].split()) - 1
        change = max(abs(x - y) for x, y in zip(a["prompt_logprobs"], b["prompt_logprobs"]))
        assert change > 1e-5, change  # native: log-softmax of BF16 logits
        assert (b["prompt_logprobs"], b["generated_logprobs"], b["generated_tokens"]) == \
            (c["prompt_logprobs"], c["generated_logprobs"], c["generated_tokens"])
