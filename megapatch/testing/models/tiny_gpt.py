"""A deterministic tiny megatron-core ``GPTModel`` and its test inputs.

Contracts:

* :func:`build_tiny_gpt` with the same ``seed`` produces the same *full*
  (unsharded) weights at every TP size: upstream CPU initialisation
  (``use_cpu_initialization=True``) draws each full master weight from the
  CPU generator and keeps this rank's slice, and the generator is reseeded
  from ``seed`` and the model chunk's position in the pipeline only -- never
  from the TP or DP rank.
* :func:`make_batch` depends on its arguments only (a private generator), so
  every rank that calls it with the same seed gets the same batch.
* :func:`gather_tp_logits` / :func:`gather_full_weights` rebuild unsharded
  tensors with plain ``torch.distributed.all_gather`` (independent of the
  megatron code under test), for oracles.

Importing this module imports torch and megatron-core; the package imports
it lazily so that :func:`megapatch.testing.run_ranks` children can set
environment variables before megatron is imported.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Dict, NamedTuple, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds

# Seed offset between model chunks, so pipeline stages / virtual chunks do not
# start from identical layer weights.
_CHUNK_SEED_STRIDE = 7919


def _tiny_defaults(tp: int, pp: int, vpp: Optional[int], sequence_parallel: bool) -> Dict[str, Any]:
    return dict(
        num_layers=max(2, pp * (vpp or 1)),
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
        use_cpu_initialization=True,
        perform_initialization=True,
        init_method_std=0.02,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # Megatron-LM's defaults for pipelining (batch_p2p_comm = not
        # overlap_p2p_comm, overlap only with VPP). Batched p2p must stay off
        # here anyway: at PP=2 gloo matches the batch's two messages to the
        # same peer in posting order and swaps activations and gradients.
        batch_p2p_comm=False,
        overlap_p2p_comm=vpp is not None,
    )


def tiny_gpt_config(tp: int, pp: int = 1, sequence_parallel: bool = False, *,
                    vpp: Optional[int] = None, **overrides: Any) -> TransformerConfig:
    """A ``TransformerConfig`` for a tiny bf16 GPT runnable on CPU.

    2 layers (or one per pipeline chunk if more are needed), hidden 64, 4
    heads, FFN 256, bf16 params, CPU initialisation, no dropout, no fused
    kernels, unbatched p2p (overlapped under VPP).  ``overrides`` go to
    ``TransformerConfig`` verbatim (an unknown field raises ``TypeError``);
    defaults this megatron-core version does not know are dropped.
    """
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    fields = {k: v for k, v in _tiny_defaults(tp, pp, vpp, sequence_parallel).items() if k in known}
    fields.update(overrides)
    return TransformerConfig(**fields)


def _default_stage_flags(vp_stage: Optional[int]) -> tuple:
    """(pre_process, post_process) of this rank's chunk ``vp_stage``."""
    first = parallel_state.is_pipeline_first_stage
    last = parallel_state.is_pipeline_last_stage
    if "vp_stage" in inspect.signature(first).parameters:
        return (first(ignore_virtual=False, vp_stage=vp_stage),
                last(ignore_virtual=False, vp_stage=vp_stage))
    if vp_stage is not None:  # older megatron-core reads the global virtual rank
        parallel_state.set_virtual_pipeline_model_parallel_rank(vp_stage)
    return first(ignore_virtual=False), last(ignore_virtual=False)


class SequenceParallelTorchNorm:
    """``WrappedTorchNorm`` without its refusal of sequence parallelism.

    The local spec falls back to ``WrappedTorchNorm`` when Apex is missing,
    and that asserts ``not config.sequence_parallel``.  A torch LayerNorm on a
    sequence shard computes exactly what it computes on the full sequence; like
    megatron's ``FusedLayerNorm`` we mark its parameters ``sequence_parallel``
    so that ``finalize_model_grads`` all-reduces their grads over TP.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _swap_module(spec: Any, old: type, new: type) -> Any:
    """A copy of a (nested) ModuleSpec/submodules tree with class ``old`` -> ``new``."""
    if spec is old:
        return new
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, module=_swap_module(spec.module, old, new),
                                   submodules=_swap_module(spec.submodules, old, new))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _swap_module(getattr(spec, f.name), old, new)
                   for f in dataclasses.fields(spec) if f.init}
        return dataclasses.replace(spec, **changes)
    return spec


def _num_layers_to_build(config: TransformerConfig, vp_stage: Optional[int]) -> int:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if "vp_stage" in inspect.signature(get_num_layers_to_build).parameters:
        return get_num_layers_to_build(config, vp_stage=vp_stage)
    return get_num_layers_to_build(config)


def _spec_kwargs(config: TransformerConfig) -> Dict[str, Any]:
    """The local spec's switches this config needs: MoE layers (sequential experts: grouped GEMM
    needs TE or the grouped_gemm package) and QK layernorm. Empty for a dense model without QK
    norm, so the dense spec is upstream's default one."""
    kwargs: Dict[str, Any] = {}
    if getattr(config, "num_moe_experts", None):
        kwargs.update(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if getattr(config, "qk_layernorm", False):
        kwargs["qk_layernorm"] = True
    return kwargs


def _layer_spec(config: TransformerConfig, vp_stage: Optional[int]):
    """The local GPT layer spec; with SP and no Apex, a block spec using
    :class:`SequenceParallelTorchNorm` for every norm (final norm included)."""
    spec = get_gpt_layer_local_spec(**_spec_kwargs(config))
    if not config.sequence_parallel:
        return spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    norm = spec.submodules.input_layernorm
    if norm is not WrappedTorchNorm:  # Apex FusedLayerNorm supports SP
        return spec
    layer = _swap_module(spec, WrappedTorchNorm, SequenceParallelTorchNorm)
    return TransformerBlockSubmodules(layer_specs=[layer] * _num_layers_to_build(config, vp_stage),
                                      layer_norm=SequenceParallelTorchNorm)


def _chunk_seed(seed: int, vp_stage: Optional[int]) -> int:
    """CPU init seed of this rank's model chunk: depends on PP position only."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    return seed + _CHUNK_SEED_STRIDE * (pp_rank + pp_size * (vp_stage or 0))


def build_tiny_gpt(
    config: TransformerConfig,
    vocab_size: int = 128,
    seq_len: int = 32,
    seed: int = 1234,
    parallel_output: bool = True,
    share_embeddings_and_output_weights: bool = False,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    layer_spec: Any = None,
    **gpt_kwargs: Any,
) -> GPTModel:
    """Builds a ``GPTModel`` with the local (non-TE) layer spec, deterministically.

    Needs megatron's parallel state.  ``pre_process``/``post_process`` default
    to this rank's pipeline position (of chunk ``vp_stage`` under VPP).
    ``vocab_size`` must be divisible by the TP size.  Seeds megatron's RNG
    tracker (``model_parallel_cuda_manual_seed(seed)``, CPU-backed through
    :func:`cpu_workarounds`) and the CPU generator, then constructs the model
    and casts it to ``config.params_dtype``; extra ``gpt_kwargs`` go to
    ``GPTModel``; ``layer_spec`` replaces the local spec (e.g. the Transformer Engine one).
    With ``config.sequence_parallel`` and no Apex, the local spec's
    torch norms become :class:`SequenceParallelTorchNorm` (same numerics).
    Running the model on CPU needs :func:`cpu_workarounds` active
    (:func:`~megapatch.testing.run_ranks` enters it for every rank).
    """
    default_pre, default_post = _default_stage_flags(vp_stage)
    kwargs = dict(
        config=config,
        transformer_layer_spec=_layer_spec(config, vp_stage) if layer_spec is None else layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=seq_len,
        pre_process=default_pre if pre_process is None else pre_process,
        post_process=default_post if post_process is None else post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        **gpt_kwargs,
    )
    if vp_stage is not None and "vp_stage" in inspect.signature(GPTModel.__init__).parameters:
        kwargs["vp_stage"] = vp_stage
    with cpu_workarounds():
        model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(_chunk_seed(seed, vp_stage))
        model = GPTModel(**kwargs)
    # Some parameters (e.g. learned position embeddings) are created in fp32;
    # cast everything to params_dtype as Megatron-LM's Float16Module does
    # (without its fp32 cast of the outputs).
    return model.to(config.params_dtype)


def llama_config(tp: int, num_query_groups: int = 2, **overrides: Any) -> TransformerConfig:
    """:func:`tiny_gpt_config` for a Llama-shaped model: SwiGLU MLP, RMSNorm, grouped-query
    attention (``num_query_groups`` KV heads), no linear biases. Build it with
    ``build_tiny_gpt(config, ..., position_embedding_type="rope")`` (RoPE; the output layer is
    untied by default). The gated fc1 holds [gate_r; up_r] on rank r (``partition_stride`` 2);
    megatron's CPU initialisation splits its master weight with that stride, so the full model is
    the same at every TP size, as for the other layers."""
    import torch.nn.functional as F

    fields = dict(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                  add_bias_linear=False, num_query_groups=num_query_groups, num_attention_heads=8)
    fields.update(overrides)
    return tiny_gpt_config(tp, **fields)


class Batch(NamedTuple):
    """One batch in megatron's conventions (``attention_mask``: True = masked)."""

    tokens: torch.Tensor  # [batch, seq] int64
    position_ids: torch.Tensor  # [batch, seq] int64
    labels: torch.Tensor  # [batch, seq] int64, the next token
    attention_mask: torch.Tensor  # [batch, 1, seq, seq] bool, causal


def make_batch(seed: int, batch: int, seq_len: int, vocab: int) -> Batch:
    """Random tokens with next-token labels and an explicit causal mask.

    An explicit mask avoids megatron's ``get_default_causal_mask``, which
    allocates with ``device="cuda"``.
    """
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch, -1).contiguous()
    causal = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    mask = causal.expand(batch, 1, seq_len, seq_len).contiguous()
    return Batch(stream[:, :-1].contiguous(), position_ids, stream[:, 1:].contiguous(), mask)


def _all_gather_cat(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return tensor.detach().clone()
    tensor = tensor.detach().contiguous()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=dim)


def _tp_group(ctx):
    return ctx.tp_group if ctx is not None else parallel_state.get_tensor_model_parallel_group()


def gather_tp_logits(logits: torch.Tensor, ctx=None) -> torch.Tensor:
    """All-gathers vocab-parallel logits along the last dim (detached, every rank).

    ``ctx`` is a :class:`~megapatch.testing.RankContext`; without it megatron's
    current TP group is used.
    """
    return _all_gather_cat(logits, -1, _tp_group(ctx))


def partition_dim(name: str, param: torch.nn.Parameter) -> int:
    """The dim TP splits ``param`` along. Transformer Engine marks a routed expert's fc2 weight
    (``TERowParallelLinear`` run by TE with ``parallel_mode=None``: the token dispatcher does its TP
    communication) with ``partition_dim`` 0, as it marks every linear that is not ``"row"``; it
    holds a slice of the input features, as every fc2 weight does."""
    if re.search(r"linear_fc2\.weight\d*$", name):  # TE's GroupedLinear: weight0, weight1, ...
        return 1
    return getattr(param, "partition_dim", 0)  # (TE's grouped expert weights carry no TP attributes)


def is_tp_sharded(name: str, param: torch.nn.Parameter) -> bool:
    """Whether each TP rank holds a slice of ``param``: megatron's ``tensor_model_parallel`` mark, or a
    weight of TE's grouped-GEMM experts (``experts.linear_fc1.weight3``: TE runs them with
    ``parallel_mode=None`` and gives them no TP attributes; each expert-TP rank holds a slice)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or re.search(
        r"\.experts\.linear_fc\d\.weight\d+$", name) is not None


def _gather_param(name: str, tensor: torch.Tensor, param: torch.nn.Parameter, model, group) -> torch.Tensor:
    """The unsharded tensor: gathered along the partition dim; a gated fc1's [gate_r; up_r] rows
    reassembled as [gate; up] (the layout at TP=1)."""
    if not is_tp_sharded(name, param):
        return tensor.detach().clone()
    gated = getattr(getattr(model, "config", None), "gated_linear_unit", False)
    if gated and ".linear_fc1." in f".{name}" and partition_dim(name, param) == 0:  # (partition_stride 2; experts too)
        gate, up = tensor.detach().chunk(2, dim=0)
        return torch.cat([_all_gather_cat(gate, 0, group), _all_gather_cat(up, 0, group)], dim=0)
    if getattr(param, "partition_stride", 1) != 1:
        raise NotImplementedError(f"{name}: partition_stride != 1")
    return _all_gather_cat(tensor, partition_dim(name, param), group)


def gather_full_weights(model: torch.nn.Module, ctx=None) -> Dict[str, torch.Tensor]:
    """Unsharded copies of every parameter, keyed by name (same on all TP ranks).

    TP-sharded parameters (``tensor_model_parallel`` attribute) are gathered
    along their ``partition_dim`` (a gated fc1 as [gate; up]); only
    ``partition_stride == 1`` is supported.
    """
    group = _tp_group(ctx)
    return {name: _gather_param(name, param, param, model, group) for name, param in model.named_parameters()}


def gather_full_grads(model: torch.nn.Module, ctx=None) -> Dict[str, torch.Tensor]:
    """Unsharded FP32 copies of every parameter's gradient (``main_grad`` where megatron's DDP
    keeps it), keyed by name; TP-sharded ones gathered along their ``partition_dim``."""
    group = _tp_group(ctx)
    full = {}
    for name, param in model.named_parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is None:
            continue
        full[name] = _gather_param(name, grad, param, model, group).float()
    return full


def sum_tp_replicated_grads(ctx, model) -> None:
    """What megatron-core's ``finalize_model_grads`` does for parameters replicated over TP whose
    gradients each TP rank sums over only part of the work (these harnesses train without its DDP
    wrapper): sequence-parallel parameters (norms, the MoE router's gate) and the QK norms (found
    by name: each TP rank's backward sums only its own heads), all-reduced over the TP group
    (``_allreduce_non_tensor_model_parallel_grads``, core_v0.16.1)."""
    if ctx.tp_size == 1:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    for name, param in model.named_parameters():
        qk_norm = "q_layernorm" in name or "k_layernorm" in name
        if param.grad is not None and (getattr(param, "sequence_parallel", False) or qk_norm):
            dist.all_reduce(param.grad, group=group)


class _CudaTypeNames(torch.overrides.TorchFunctionMode):
    """``Tensor.type()`` answers with the CUDA type name: megatron's mixed-precision optimizer
    accepts parameters and clips gradients only after checking ``'torch.cuda.*Tensor'`` names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else "torch.cuda." + name[len("torch."):]
        return func(*args, **kwargs)


def cuda_type_names():
    """A context in which megatron's optimizer classes accept CPU tensors (see ``_CudaTypeNames``);
    enter it around the optimizer's construction and ``step()``."""
    return _CudaTypeNames()


def build_bf16_optimizer(model: torch.nn.Module, lr: float = 1e-2, clip_grad: float = 1.0,
                         weight_decay: float = 0.1):
    """megatron-core's ``Float16OptimizerWithFloat16Params`` (FP32 main params and grads, the
    non-distributed optimizer Megatron-LM uses for BF16) over ``torch.optim.AdamW``, with gradient
    clipping at ``clip_grad``. Call its ``step()`` inside :func:`cuda_type_names`."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, bf16=True,
                             params_dtype=torch.bfloat16, clip_grad=clip_grad)
    inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    with cuda_type_names():
        return Float16OptimizerWithFloat16Params(inner, config, None, lambda optimizer: None)


def forward_backward(ctx, model: torch.nn.Module, batch) -> Dict[str, Any]:
    """One forward without gradients (the logits) and one with the loss, its mean backward, the
    TP-replicated gradients summed as Megatron-LM's ``finalize_model_grads`` does: ``{"logits"}``
    (gathered over TP, FP32), ``{"loss"}`` (per token, FP32) and ``{"grads"}`` (full tensors)."""
    with torch.no_grad():
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
    loss = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
    loss.float().mean().backward()
    sum_tp_replicated_grads(ctx, model)
    return {"logits": gather_tp_logits(logits, ctx).float(), "loss": loss.detach().float(),
            "grads": gather_full_grads(model, ctx)}

