"""A Hugging Face Llama through Megatron-Bridge's ``AutoBridge`` on CPU ranks, at TP 1 and TP 2.

Used by ``benchmarks/bridge_llama.py`` and ``tests/test_bridge.py``. One job of two gloo ranks
(:func:`megapatch.testing.run_ranks`) per megapatch mode; the mode comes from the ``MEGAPATCH_*``
variables of the job only (the ranks never call ``megapatch.enable``; the startup hook activates
it). Inside the job, :func:`forward_tp1_tp2`:

1. imports Bridge (:func:`megapatch.testing.stand_ins.bridge_compat.import_bridge`: no TE here);
2. ``AutoBridge.from_hf_pretrained(hf_dir)`` and ``bridge.to_megatron_provider(load_weights=True)``:
   Bridge's own HF -> megatron-core mapping (its ``LlamaBridge``) and weight loading;
3. sets on the provider what a CPU run needs and nothing else: ``tensor_model_parallel_size``,
   megatron-core's *local* layer spec (Bridge's ``local_layer_spec``; its default spec is TE's),
   the CUDA fusions off (``gradient_accumulation_fusion``, ``bias_activation_fusion``,
   ``masked_softmax_fusion``, ``apply_rope_fusion``, ``persist_layer_norm``,
   ``bias_dropout_fusion``), BF16 (or FP32 for the conversion check), then a mode's own provider
   settings (``tp_invariant``: ``cross_entropy_loss_fusion=False``, which Bridge turns on by
   default and the mode refuses), then ``finalize()``;
4. ``provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)`` at
   TP 1 (data parallel 2: both ranks compute the same), runs the token batch forward, then
   re-initialises megatron's parallel state at TP 2 and does the same again.

Rank 0 returns ``{"tp1": logits, "tp2": logits, "logits_dtype": {...}, "megapatch": status line}``
with the vocab-parallel logits all-gathered and trimmed to the true vocabulary.
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["forward_tp1_tp2", "configure_provider", "FUSIONS_OFF"]

#: provider fields switched off on CPU (each selects a CUDA-only fused kernel)
FUSIONS_OFF = ("gradient_accumulation_fusion", "bias_activation_fusion", "masked_softmax_fusion",
               "apply_rope_fusion", "persist_layer_norm", "bias_dropout_fusion")


def configure_provider(provider, tp: int, bf16: bool = True, overrides=None):
    """The CPU settings of the module docstring (step 3) on a Bridge ``GPTModelProvider``, then
    ``overrides`` (provider fields a mode needs, e.g. ``cross_entropy_loss_fusion=False`` for
    ``tp_invariant``)."""
    import torch
    from megatron.bridge.models.gpt_provider import local_layer_spec

    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = 1
    provider.transformer_layer_spec = local_layer_spec
    for name in FUSIONS_OFF:
        if hasattr(provider, name):
            setattr(provider, name, False)
    dtype = torch.bfloat16 if bf16 else torch.float32
    provider.bf16, provider.fp16 = bf16, False
    provider.params_dtype = provider.pipeline_dtype = dtype
    if hasattr(provider, "autocast_dtype"):
        provider.autocast_dtype = dtype
    provider.hidden_dropout = provider.attention_dropout = 0.0
    for name, value in (overrides or {}).items():
        setattr(provider, name, value)
    provider.finalize()
    return provider


def _build(hf_dir: str, tp: int, bf16: bool, overrides=None):
    from megatron.bridge import AutoBridge
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    # the TP RNG tracker, as Bridge's own initialize_model_parallel(seed=...) would add it (CPU-
    # backed under cpu_workarounds); attention dropout is 0, so no draw changes a logit
    model_parallel_cuda_manual_seed(1234)

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = configure_provider(bridge.to_megatron_provider(load_weights=True), tp, bf16, overrides)
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    return model[0].eval()


def _forward(module, tokens, vocab: int, seen: Dict[str, str]):
    import torch
    from megatron.core import parallel_state as ps

    inner = module.module if hasattr(module, "module") else module
    handle = inner.output_layer.register_forward_hook(
        lambda _m, _i, out: seen.__setitem__("dtype", str((out[0] if isinstance(out, tuple) else out).dtype)))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    try:
        with torch.no_grad():
            logits = module(tokens, positions, None).float().contiguous()
    finally:
        handle.remove()
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        torch.distributed.all_gather(parts, logits, group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits[..., :vocab].clone(), int(logits.shape[-1])


def forward_tp1_tp2(ctx, hf_dir: str, tokens_path: str, vocab: int, bf16: bool = True,
                    overrides=None) -> Dict[str, Any]:
    """Rank function (module docstring); TP 1 then TP 2 in one two-rank job. ``overrides``:
    provider fields set after the CPU settings (:func:`configure_provider`)."""
    import torch

    import megapatch
    from megapatch.testing import reinit_model_parallel
    from megapatch.testing.stand_ins import bridge_compat

    bridge_compat.import_bridge()
    tokens = torch.load(tokens_path)
    out: Dict[str, Any] = {"logits_dtype": {}, "padded_vocab": {}}
    for tp in (1, 2):
        if tp != ctx.tp_size:
            ctx = reinit_model_parallel(ctx, tp=tp)
        module = _build(hf_dir, tp, bf16, overrides)
        seen: Dict[str, str] = {}
        out[f"tp{tp}"], out["padded_vocab"][tp] = _forward(module, tokens, vocab, seen)
        out["logits_dtype"][tp] = seen.get("dtype", "?")
        del module
    status = megapatch.status()
    out["enabled"] = status.enabled
    out["sources"] = dict(status.sources)
    out["active"] = list(status.active)
    return out if ctx.rank == 0 else {}
