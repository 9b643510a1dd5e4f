"""``tp_invariant.construction``: what the mode cannot cover is refused when a ``TransformerBlock``
is built, before any step: config fields and shapes the fixed tree cannot split (``_refusal_tables``,
``megapatch.numerics.block_shapes``; ``megapatch doctor`` calls the same functions through the
record's preflight), and Transformer Engine modules other than those
``tp_invariant.transformer_engine`` runs. The block's norms are routed through the token tree
(``_norms``), a gated fc1 and the experts marked (``_marks``, ``_experts``)."""

from __future__ import annotations

from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics import block_shapes
from megapatch.numerics import block_tree as tpi
from megapatch.patches.tp_invariant._attention_backend import notes, say_attention_backend
from megapatch.patches.tp_invariant._experts import mark_experts
from megapatch.patches.tp_invariant._marks import mark_gated_fc1
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant, tp_invariant_patch
from megapatch.patches.tp_invariant._norms import is_qk_norm, token_blocked_norm
from megapatch.patches.tp_invariant._parallel_state import collection_layout, expert_layout
from megapatch.patches.tp_invariant._refusal_tables import config_refusals, described


def _check_config(config, pg_collection=None) -> None:
    # in a Megatron-LM job every stage's block refuses its padded vocabulary, naming the flags,
    # and (sequence parallelism) a --seq-length W does not divide, as the doctor does from the flags
    refusals = config_refusals(config, block_shapes.megatron_lm_vocabulary(),
                                block_shapes.megatron_lm_sequence_length(config),
                                collection_layout(pg_collection) or expert_layout())
    if refusals:
        refuse_tp_invariant(*refusals[0])


def _preflight_model(config):
    # Transformer Engine layers: tp_invariant.transformer_engine's preflight
    return described(config_refusals(config, config))  # the flags' config carries the vocabulary's fields


#: Transformer Engine modules the mode runs (tp_invariant.transformer_engine; TE's norms here)
_TE_COVERED = ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear",
               "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear", "TEDotProductAttention", "RMSNorm",
               "LayerNorm")


def _transformer_engine(module, name: str) -> bool:
    """Whether ``module`` is a Transformer Engine module (refused unless the mode covers it)."""
    kind = type(module)
    if not kind.__module__.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine")):
        return False
    if kind.__name__ not in _TE_COVERED:
        refuse_tp_invariant(f"the Transformer Engine module {kind.__qualname__} ({name})",
                "the mode covers TE's column/row-parallel linears, LayerNormLinear, norms and "
                "DotProductAttention; use --transformer-impl local")
    return True


def block_init(wrapped, instance, args, kwargs):
    """Refuse, before any step runs, what the mode cannot make invariant: the config first, then
    the layers the block built (Transformer Engine modules)."""
    if not tpi.active():
        return wrapped(*args, **kwargs)
    config = argument(args, kwargs, 0, "config")
    # TransformerBlock(config, spec, post_layer_norm, pre_process, post_process, pg_collection, ...)
    _check_config(config, argument(args, kwargs, 5, "pg_collection", None))
    say_attention_backend(config)  # accepted: core attention runs as the mode's whatever it asks for
    result = wrapped(*args, **kwargs)
    te_covered = []  # a covered TE module's own TE submodules (attention backends) do not run under the mode
    own_group = getattr(getattr(instance, "pg_collection", None), "tp", None)
    for name, module in instance.named_modules():
        if any(name.startswith(prefix) for prefix in te_covered):
            continue
        if _transformer_engine(module, name):
            te_covered.append(name + ".")
            if type(module).__name__.endswith("Linear"):  # its fused norm: tp_invariant.transformer_engine
                continue
        token_blocked_norm(module, is_qk_norm(name, config), own_group)
        mark_gated_fc1(module)
        mark_experts(name, module)
    return result


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.construction",
        summary="refuses at model construction what tp_invariant does not cover (fusions, TE, MoE, few KV groups, shapes W cannot split)",
        hook="megatron.core.transformer.transformer_block",
        targets=(Target("megatron.core.transformer.transformer_block", "TransformerBlock.__init__",
                        block_init, kind="method", params=("self", "config")),),
        preflight=_preflight_model,
        notes=notes,
    ),
)
