"""Norm layers under the mode: their affine part's weight and bias gradients (sums over tokens,
which sequence parallelism splits over TP) run as token blocks in the fixed tree
(``TokenBlockedAffine``); a QK norm's (Qwen3's per-head norms) over tokens and the heads TP splits,
as W leaves, handed to upstream's all-reduce on rank 0 only. Norms the mode does not know are refused."""

from __future__ import annotations

import functools

import torch

from megapatch.numerics import block_tree as tpi
from megapatch.numerics import token_tree
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant
from megapatch.patches.tp_invariant._parallel_state import tp_group_if_initialised


def _norm_affine(module):
    """``(normalise, weight, bias)`` of a norm layer the mode covers, else None: torch's
    ``LayerNorm``/``RMSNorm`` (the local spec without apex) and megatron-core's apex-backed
    ``FusedLayerNorm`` (the local spec with apex), whose affine part the mode computes itself."""
    import torch.nn.functional as F

    kind = type(module)
    if kind is torch.nn.LayerNorm and module.elementwise_affine:
        return (lambda x: F.layer_norm(x, module.normalized_shape, None, None, module.eps),
                module.weight, module.bias)
    if kind is torch.nn.RMSNorm and module.elementwise_affine:
        return lambda x: F.rms_norm(x, module.normalized_shape, None, module.eps), module.weight, None
    if kind.__name__ == "FusedLayerNorm" and kind.__module__ == "megatron.core.fusions.fused_layer_norm":
        weight = module.weight + 1 if module.zero_centered_gamma else module.weight
        return (lambda x: F.layer_norm(x, module.hidden_size, None, None, module.eps), weight, module.bias)
    if kind.__name__ in ("RMSNorm", "LayerNorm") and kind.__module__.startswith("transformer_engine.pytorch"):
        # Transformer Engine's norms (megatron-core's TENorm): per token, gamma zero-centred or not
        shape = tuple(module.weight.shape)
        weight = module.weight + 1 if getattr(module, "zero_centered_gamma", False) else module.weight
        if kind.__name__ == "RMSNorm":
            return lambda x: F.rms_norm(x, shape, None, module.eps), weight, None
        return lambda x: F.layer_norm(x, shape, None, None, module.eps), weight, module.bias
    return None


_QK_NORMS = ("q_layernorm", "k_layernorm")  # the attention's per-head norms (--qk-layernorm)


def is_qk_norm(name: str, config) -> bool:
    """The attention's per-head query/key norm, named as upstream names it (and as its
    ``finalize_model_grads`` finds it); multi-latent attention's norms of that name act on the
    replicated latent, per token."""
    return name.rsplit(".", 1)[-1] in _QK_NORMS and not getattr(config, "multi_latent_attention", False)


def token_blocked_norm(module, heads: bool = False, group=None) -> None:
    """Route a norm layer's affine part through ``TokenBlockedAffine`` (its weight and bias
    gradients sum over tokens, which sequence parallelism splits over TP; ``heads``: a QK norm's,
    over tokens and the heads TP splits); refuse norms with parameters that the mode does not know."""
    if getattr(module, "_megapatch_token_blocked", False):
        return
    if _norm_affine(module) is not None:
        module.forward = functools.partial(_norm_forward, module, module.forward, heads)
        module._megapatch_token_blocked = True
        module._megapatch_tp_group = group
    elif "norm" in type(module).__name__.lower() and any(True for _ in module.parameters(recurse=False)):
        refuse_tp_invariant(f"the norm layer {type(module).__qualname__}",
                "its weight gradient sums tokens in an order the mode does not control; torch's "
                "LayerNorm/RMSNorm and megatron-core's FusedLayerNorm are covered")


def _norm_forward(module, original, heads, hidden):
    if not tpi.active():
        return original(hidden)
    normalise, weight, bias = _norm_affine(module)  # per call: a zero-centred weight is w + 1
    # the model's own TP group: a rollout model at TP 1 beside a TP-2 trainer is not split
    group = getattr(module, "_megapatch_tp_group", None) or tp_group_if_initialised()
    if heads:  # [s, b, heads or KV groups of this rank, head dim]
        if hidden.dim() != 4:
            refuse_tp_invariant(f"a QK norm's input of shape {tuple(hidden.shape)}",
                    "the mode sums its gradient over [sequence, batch, heads, head dim]")
        return token_tree.TokenBlockedAffine.apply(normalise(hidden.float()), weight, bias, group,
                                            tpi.blocks_per_rank(group), False, hidden.dtype, True)
    split = bool(getattr(module.weight, "sequence_parallel", False)) and tpi.group_size(group) > 1
    return token_tree.TokenBlockedAffine.apply(normalise(hidden.float()), weight, bias, group,
                                        tpi.token_blocks(hidden, group, split), split, hidden.dtype)
