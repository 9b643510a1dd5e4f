"""``tp_invariant.mlp``: refuses MLP configurations the mode does not cover (TE activations, fused
bias-activation); a gated linear unit's (SwiGLU) fc1 holds [gate_r; up_r] on rank r, so its column
blocks split gate and up apart and the dgrad tree pairs gate block k with up block k
(``block_tree.column_blocks``); a routed expert's probabilities scale the activation inside fc2's
wrapper. The activation itself is elementwise and position-independent."""

from __future__ import annotations

import contextlib

from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.core.scope import scoped
from megapatch.numerics import expert_call
from megapatch.numerics import block_tree as tpi
from megapatch.patches.tp_invariant._marks import gated_fc1, mark_gated_fc1
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant, tp_invariant_patch
from megapatch.patches.tp_invariant._refusal_tables import field_refusal


MLP = "megatron.core.transformer.mlp"


def _mlp_forward(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    config = instance.config
    for field in ("use_te_activation_func", "bias_activation_fusion"):
        refusal = field_refusal(config, field)
        if refusal:
            refuse_tp_invariant(*refusal)
    scale = argument(args, kwargs, 1, "per_token_scale", None)
    with contextlib.ExitStack() as scopes:
        if config.gated_linear_unit:
            mark_gated_fc1(instance)  # also for a model built before the mode was switched on
            scopes.enter_context(scoped(gated_fc1, instance.linear_fc1))  # its column blocks split gate and up
        if scale is None:
            return wrapped(*args, **kwargs)
        # a routed expert: the probabilities scale the activation inside fc2's wrapper, where the
        # sum of their gradient over the features expert TP splits runs in the fixed tree
        hidden = argument(args, kwargs, 0, "hidden_states")
        sources = expert_call.token_sources(instance, hidden.shape[0])
        scopes.enter_context(expert_call.running(expert_call.ExpertCall(instance, scale, sources)))
        rest = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "per_token_scale")}
        return wrapped(hidden, None, **rest)


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.mlp",
        summary="refuses MLP configurations tp_invariant does not cover (TE, fused); marks a gated fc1 (SwiGLU)",
        hook=MLP,
        targets=(Target(MLP, "MLP.forward", _mlp_forward, kind="method", params=("self", "hidden_states")),),
    ),
)
