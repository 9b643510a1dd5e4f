"""CPU stand-ins that let megatron-core's *dynamic* inference engine run unmodified on CPU ranks.

Used inside :func:`~megapatch.testing.stand_ins.cpu_compat.cpu_workarounds` (which the harness enters):
:func:`dynamic_inference_workarounds` adds the replacements in :data:`WORKAROUNDS`, applied and
restored through the same ``Replacements`` helper, plus a thread-local torch-function mode that
drops ``pin_memory=True`` (a transfer-speed property: the values are the same without it).

Attention: the dynamic engine calls flash-attn's paged kernels (``flash_attn_varlen_func`` with a
``block_table`` for prefill and mixed steps, ``flash_attn_with_kvcache`` for decode-only steps).
The stand-ins honour their contract -- causal attention, aligned to the end of each request's
key/value history, read from the paged cache through the block table, output in the query dtype
-- with the arithmetic of megatron-core's local ``DotProductAttention``: a BF16 (params-dtype)
Q·Kᵀ scaled by 1/sqrt(d), an FP32 softmax rounded back to the params dtype, and a BF16
probabilities·V. So a rollout and the training forward run the same attention arithmetic on other
shapes (one query per decode step, a request's keys so far), which now and then gives a row other
BF16 bits (tests/test_tp_invariant_attention.py); under ``tp_invariant`` megapatch replaces both with
one shape-independent arithmetic (``patches/tp_invariant/attention.py``) and this stand-in is not called.
flash-attn itself accumulates in FP32 with an online softmax: its own rounding is not modelled.

``python -m megapatch.testing.ranks.dynamic_inference_launch SCRIPT.py ...`` (under torchrun) is the CPU
launcher (``megapatch.testing.ranks.cpu_launch``) with these stand-ins around the script as well: it runs
upstream's ``examples/inference/gpt/gpt_dynamic_inference.py``. :func:`dynamic_engine` and
:func:`generate` build and drive a tiny engine in-process (0.16's and 0.17+'s constructors).

What stays unrun on CPU: CUDA graphs (``enable_cuda_graph`` must be False; the stand-ins refuse
nothing, the engine simply never captures), the Triton KV-append kernel (upstream's own torch
fallback runs instead), unified memory, symmetric-memory all-reduces, FlashInfer RoPE, MLA.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import time
from typing import Iterator, Tuple

import torch

from megapatch.numerics.attention import by_request, causal_visible, kv_lengths, paged_rows, repeat_groups
from megapatch.testing.stand_ins import cpu_streams
from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds
from megapatch.testing.stand_ins.replacements import Replacements, Workaround, _resolve

__all__ = ["dynamic_inference_workarounds", "WORKAROUNDS", "paged_causal_attention", "dynamic_engine",
           "generate"]

ATTENTION = "megatron.core.transformer.attention"
DYNAMIC_CONTEXT = "megatron.core.inference.contexts.dynamic_context"


def paged_causal_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_length: int, blocks: torch.Tensor, scale: float) -> torch.Tensor:
    """One request's attention: ``q`` [q_len, heads, dim] are its last ``q_len`` positions; the
    keys and values are its first ``kv_length`` cached positions (causal, end-aligned)."""
    heads, q_len = q.shape[1], q.shape[0]
    k = repeat_groups(paged_rows(k_cache, blocks, kv_length), heads, 1)  # grouped-query attention
    v = repeat_groups(paged_rows(v_cache, blocks, kv_length), heads, 1)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, len, dim]
    scores = torch.baddbmm(torch.empty(heads, q_len, kv_length, dtype=q.dtype),
                           qh, kh.transpose(1, 2), beta=0.0, alpha=scale)
    hidden = ~causal_visible(q_len, kv_length)
    probs = scores.float().masked_fill(hidden, float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.bmm(probs, vh).transpose(0, 1)  # [q_len, heads, dim]


def _varlen(_original):
    # Replaces flash_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
    # max_seqlen_q, max_seqlen_k, softmax_scale=, causal=True, block_table=) as
    # Attention.flash_decode_and_prefill calls it on prefill and mixed steps.
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, block_table=None, **_unused):
        if not causal or block_table is None:
            raise NotImplementedError("CPU stand-in: only the paged causal call of the dynamic engine")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return by_request(lambda rows, keys, blocks: paged_causal_attention(rows, k, v, keys, blocks, scale),
                          q, cu_seqlens_q.tolist(), kv_lengths(cu_seqlens_k), block_table)

    return flash_attn_varlen_func


def _with_kvcache(_original):
    # Replaces flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, causal=True,
    # block_table=, num_splits=) on decode-only steps: q is [batch, 1, heads, dim].
    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, causal=False,
                                block_table=None, softmax_scale=None, **_unused):
        if block_table is None or cache_seqlens is None:
            raise NotImplementedError("CPU stand-in: only the paged call of the dynamic engine")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5

        def attend(rows, keys, blocks):
            return paged_causal_attention(rows, k_cache, v_cache, keys, blocks, scale)

        return by_request(attend, q[:, 0], list(range(q.shape[0] + 1)), cache_seqlens.tolist(),
                          block_table).unsqueeze(1)  # q: [batch, 1, heads, dim], one query a request

    return flash_attn_with_kvcache


def _fa_version(_original):
    # Replaces megatron.core.utils.is_fa_min_version as attention.py imported it: the dynamic
    # engine asserts flash-attn >= 2.7.3 (paged varlen); the stand-ins above honour that API.
    return lambda version, check_equality=True: True


def _no_triton_append(_original):
    # The Triton KV-append kernel cannot launch on CPU; None selects upstream's own torch path
    # (DynamicInferenceContext.append_key_value_cache), which writes the same cache slots.
    return None


class _CpuEvent:
    """torch.cuda.Event(enable_timing=True) for the engine's step timing: wall clock."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True

    def elapsed_time(self, end) -> float:
        return (end._t - self._t) * 1000.0


def _cpu_event(_original):
    # Replaces torch.cuda.Event in DynamicInferenceEngine.reset/async_bookkeep (step timing).
    return _CpuEvent


def _empty_memory_stats(_original):
    # Replaces torch.cuda.memory_stats / reset_peak_memory_stats (the engine's and the example's
    # memory logging): no CUDA memory, every statistic reads 0.
    return lambda *args, **kwargs: collections.defaultdict(int)


def _merge_heads(original):
    # Where einops is not installed, attention.py binds ``rearrange`` to None (>= 0.17) and the
    # dynamic path calls rearrange(out, 's b h d -> s b (h d)'); this is that one pattern.
    if original is not None:
        return original

    def rearrange(tensor, pattern):
        if pattern.replace(" ", "") != "sbhd->sb(hd)":
            raise NotImplementedError(f"CPU stand-in for einops.rearrange: {pattern!r}")
        return tensor.flatten(2)

    return rearrange


def _cpu_long_tensor(_original):
    # Replaces torch.cuda.LongTensor([time.time_ns()]) in the example's get_curr_time
    # (examples/inference/gpt/utils.py), a timestamp broadcast for timing.
    return torch.LongTensor


def _no_nvtx(_original):
    # Replaces the NVTX range markers the engine imports from torch.cuda.nvtx (profiling only;
    # a CPU build of torch raises "NVTX functions not installed").
    return lambda *args, **kwargs: None


def _cpu_tensor_check(_original):
    # Replaces communication_utils._is_cuda (asserts ``tensor.is_cuda`` before the pipeline
    # broadcasts and p2p of inference): the tensor must exist; a CPU tensor is accepted.
    def _is_cuda(tensor):
        assert tensor is not None

    return _is_cuda


ENGINE = "megatron.core.inference.engines.dynamic_engine"

WORKAROUNDS: Tuple[Workaround, ...] = (
    Workaround(ATTENTION, "flash_attn_varlen_func",
               "flash-attn paged varlen attention (dynamic prefill / mixed steps)", _varlen),
    Workaround(ATTENTION, "flash_attn_with_kvcache",
               "flash-attn paged KV-cache attention (dynamic decode steps)", _with_kvcache),
    Workaround(ATTENTION, "is_fa_min_version",
               "the flash-attn >= 2.7.3 assertion of dynamic batching", _fa_version),
    Workaround(DYNAMIC_CONTEXT, "triton_append_key_value_cache",
               "the Triton KV-cache append kernel", _no_triton_append, optional=True),
    # <= 0.16 (later releases use megatron's own nvtx helpers, off unless enabled)
    Workaround(ENGINE, "range_push", "NVTX profiling range (engine step)", _no_nvtx, optional=True),
    Workaround(ENGINE, "range_pop", "NVTX profiling range (engine step)", _no_nvtx, optional=True),
    Workaround("megatron.core.inference.communication_utils", "_is_cuda",
               "the is_cuda assertion of the inference pipeline broadcasts", _cpu_tensor_check),
    Workaround(ATTENTION, "rearrange", "einops.rearrange where einops is missing (dynamic attention)",
               _merge_heads, optional=True),
    # the example turns megatron's NVTX ranges on (configure_nvtx_profiling(True))
    Workaround("torch.cuda.nvtx", "range_push", "NVTX ranges (megatron.core.utils.nvtx_range_push)",
               _no_nvtx),
    Workaround("torch.cuda.nvtx", "range_pop", "NVTX ranges (megatron.core.utils.nvtx_range_pop)",
               _no_nvtx),
    Workaround("torch.cuda", "LongTensor", "the inference example's CUDA timestamp tensor",
               _cpu_long_tensor),
    Workaround("torch.cuda", "Stream", "CUDA side streams (>= 0.17 asynchronous scheduling)",
               cpu_streams.cpu_side_stream),
    Workaround("torch.cuda", "stream", "entering a CUDA side stream", cpu_streams.cpu_stream_context),
    Workaround("torch.cuda", "Event", "CUDA events timing the engine's steps", _cpu_event),
    Workaround("torch.cuda", "memory_stats", "CUDA memory statistics (engine logging)",
               _empty_memory_stats),
    Workaround("torch.cuda", "reset_peak_memory_stats", "CUDA peak-memory reset (engine logging)",
               _empty_memory_stats),
)


def _drop_pin_memory_mode():
    from torch.overrides import TorchFunctionMode

    class DropPinMemory(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.pin_memory:
                return args[0]
            if kwargs.get("pin_memory"):
                kwargs = dict(kwargs, pin_memory=False)
            return func(*args, **kwargs)

    return DropPinMemory()


@contextlib.contextmanager
def dynamic_inference_workarounds() -> Iterator[None]:
    """Lets the dynamic inference engine (context, controller, engine) run on CPU in this block;
    every replaced attribute is restored on exit. Not re-entrant (one engine per block)."""
    replacements = Replacements()
    with cpu_workarounds():
        try:
            for workaround in WORKAROUNDS:
                target = _resolve(workaround)
                if target is not None:
                    replacements.replace(*target, workaround.make)
            with _drop_pin_memory_mode():
                yield
        finally:
            replacements.restore()


# --- a tiny engine ----------------------------------------------------------------

_request_ids = itertools.count()


def dynamic_engine(model, tp: int, pp: int = 1, max_sequence_length: int = 64, max_requests: int = 8,
                   threshold: int = -1):
    """A ``DynamicInferenceEngine`` over ``model`` built as upstream's gpt_dynamic_inference.py builds
    it (no CUDA graphs; every logit materialised, so log-probs can be returned): the context, the
    GPT inference wrapper, the text-generation controller with an ids-only tokenizer."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController)

    config = model.config
    sizes = dict(max_sequence_length=max_sequence_length, buffer_size_gb=0.05, max_requests=max_requests,
                 max_tokens=max(256, max_requests * max_sequence_length), block_size_tokens=16,
                 materialize_only_last_token_logits=False)
    try:  # <= 0.16
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig)
    except ImportError:  # >= 0.17: one InferenceConfig, the model's own config
        from megatron.core.inference.config import InferenceConfig

        context = DynamicInferenceContext(config, InferenceConfig(**sizes))
        wrapper = GPTInferenceWrapper(model, context)
    else:
        context = DynamicInferenceContext(
            params_dtype=config.params_dtype, num_layers=config.num_layers // pp,
            kv_channels=config.kv_channels,
            num_attention_heads=config.num_query_groups or config.num_attention_heads,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **sizes)
        wrapper = GPTInferenceWrapper(model, InferenceWrapperConfig(
            hidden_size=config.hidden_size, params_dtype=config.params_dtype,
            inference_batch_times_seqlen_threshold=threshold, padded_vocab_size=model.vocab_size),
            context)
    wrapper.model_is_pipeline_parallel = pp > 1  # as upstream's gpt_dynamic_inference.py sets it

    class Tokenizer:  # the engine needs ids only
        bos, eod = None, model.vocab_size - 1

        def detokenize(self, tokens, **_):
            return " ".join(map(str, tokens))

    controller = TextGenerationController(wrapper, Tokenizer())
    if "enable_cuda_graph" not in inspect.signature(DynamicInferenceEngine.__init__).parameters:
        return DynamicInferenceEngine(controller, context)  # >= 0.17: graphs follow the model config
    return DynamicInferenceEngine(controller, context, enable_cuda_graph=False, random_seed=1)


def generate(engine, prompts, tokens: int, temperature: float = 1.0, top_k: int = 1):
    """Requests added as token ids, run to completion (no termination token); returns
    (generated tokens, their log-probs, the prompt's log-probs from the prefill) per prompt, in
    prompt order. ``top_k=1`` is greedy; ``top_k=0`` samples from the full distribution."""
    from megatron.core.inference.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=top_k, return_log_probs=True,
                            num_tokens_to_generate=tokens, termination_id=-1)
    for i, prompt in enumerate(prompts):
        engine.add_request(next(_request_ids), list(prompt), params)
    done = []
    while engine.has_unfinished_requests():
        done.extend(engine.step_modern()["finished_request_records"])
    merged = [r.merge() for r in sorted(done, key=lambda r: r.request_id)]
    return [(list(r.generated_tokens), list(r.generated_log_probs), list(r.prompt_log_probs or ()))
            for r in merged]

