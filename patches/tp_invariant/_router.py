"""The MoE router under the mode: the gating GEMM per block of consecutive tokens
(``TokenBlockedLinear``, the same blocks at every TP size; its weight gradient through the token
tree), and top-k routing once per token block, so every call sees the same rows at every TP size."""

from __future__ import annotations

import contextvars

import torch

from megapatch.core.call_args import argument
from megapatch.core.scope import scoped
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import token_tree
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant
from megapatch.patches.tp_invariant._parallel_state import tp_group_if_initialised
from megapatch.patches.tp_invariant._refusal_tables import field_refusal, MOE_REFUSED


ROUTER = "megatron.core.transformer.moe.router"
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_router_blocks = contextvars.ContextVar("megapatch_tp_invariant_router_blocks", default=None)


def _router_layout(router, tokens):
    """``(TP group, sequence parallel, token blocks)`` of a router's input or logits ``[s, b, ...]``."""
    group = getattr(router, "tp_group", None) or tp_group_if_initialised()
    split = bool(getattr(router.config, "sequence_parallel", False)) and tpi.group_size(group) > 1
    return group, split, tpi.token_blocks(tokens, group, split)


def router_gating(wrapped, instance, args, kwargs):
    """The gating GEMM per block of consecutive tokens (the same blocks at every TP size); its weight
    gradient, a sum over tokens, through the token tree -- across TP with sequence parallelism,
    where upstream all-reduces it as a sequence-parallel parameter (``finalize_model_grads``)."""
    if not tpi.active():
        return wrapped(*args, **kwargs)
    input_ = argument(args, kwargs, 0, "input")
    config = instance.config
    refusal = field_refusal(config, "moe_router_dtype", MOE_REFUSED)
    if refusal:
        refuse_tp_invariant(*refusal)
    dtype = torch.float32 if config.moe_router_dtype == "fp32" else input_.dtype
    for param in (instance.weight, instance.bias):
        if param is not None and param.device != input_.device:  # as upstream's gating does at its first call
            param.data = param.data.to(input_.device)
    group, split, nb = _router_layout(instance, input_)
    return token_tree.TokenBlockedLinear.apply(input_, instance.weight, instance.bias, group, nb, split, dtype)


def router_routing(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    _, _, nb = _router_layout(instance, argument(args, kwargs, 0, "logits"))
    with scoped(_router_blocks, nb):
        return wrapped(*args, **kwargs)


def per_token_blocks(wrapped, instance, args, kwargs):
    """Top-k routing (and the aux loss's top-k) called once per token block of the router: every
    call sees the same rows at every TP size, so ties are broken the same way whatever kernel a row
    count would select. Under a router-replay action (recording or replaying, ``router_replay``)
    the call is left whole: upstream records and replays one tensor of indices per call."""
    nb = _router_blocks.get()
    replay = getattr(kwargs.get("router_replay"), "router_replay_action", None)
    if not tpi.active() or not nb or nb == 1 or replay is not None:
        return wrapped(*args, **kwargs)
    logits = argument(args, kwargs, 0, "logits")
    mask = kwargs.get("padding_mask")
    rest = {k: v for k, v in kwargs.items() if k != "logits"}
    parts = []
    for rows in tpi.slices(logits.shape[0], nb):
        if mask is not None:
            rest["padding_mask"] = mask[rows]
        parts.append(wrapped(logits[rows], *args[1:], **rest))
    return tuple(torch.cat(outputs) for outputs in zip(*parts))
