"""``tp_invariant`` on Transformer Engine's grouped-GEMM experts (``TEGroupedMLP``, Megatron-LM's
``--moe-grouped-gemm`` with TE layers): one ``TEGroupedLinear`` per fc holds expert ``i``'s weight as
``weight<i>``, and TE runs every local expert in one grouped GEMM whose blocking depends on every
expert's token count. Under the mode upstream's forward runs once per local expert on that expert's
rows, inside the expert call (``numerics.expert_call``) whose ``index`` says which weight;
``tp_invariant.transformer_engine`` runs each ``TEGroupedLinear`` call as the block GEMMs of that
weight, as it runs a sequential TE expert's linears. ``tp_invariant`` marks the weights when the
block is built (gated halves, partition dims for the grad norm: TE gives them no TP attributes) and
links each expert to the dispatcher's token sources.

A record of its own because it is hooked on megatron-core's experts module, which imports the TE
wrappers where TE is installed; a dense model imports the wrappers without it.
"""

from __future__ import annotations

import torch

from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import expert_call
from megapatch.patches._common import MEGATRON_CORE_TP_INVARIANT_TESTED
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant, tp_invariant_patch, tp_invariant_with_te

EXPERTS = "megatron.core.transformer.moe.experts"


def _grouped_experts_forward(wrapped, instance, args, kwargs):
    """``TEGroupedMLP.forward`` (``--moe-grouped-gemm``): upstream's forward run once per local expert
    on that expert's rows, its ``GroupedLinear`` GEMMs the block GEMMs of that expert's weights
    (``tp_invariant.transformer_engine``), as ``SequentialMLP`` runs its experts: the routing probabilities
    scale fc2's input inside the fixed tree (upstream's activation multiplies by ones, exactly), each
    source rank's rows one block. A grouped GEMM's blocking depends on every expert's token count;
    this does not."""
    if not tpi.active():
        return wrapped(*args, **kwargs)
    experts = expert_call.grouped_experts(instance, make=False)
    if experts is None:
        refuse_tp_invariant("a TEGroupedMLP built before tp_invariant was switched on",
                            "the mode marks each expert's weights (gated halves, partition dims) when the model is built")
    hidden = argument(args, kwargs, 0, "permuted_local_hidden_states")
    counts = argument(args, kwargs, 1, "tokens_per_expert").tolist()
    probs = argument(args, kwargs, 2, "permuted_probs")
    on_input = bool(getattr(instance.config, "moe_apply_probs_on_input", False))  # upstream scales the input
    outputs = []
    for expert, rows, scale in zip(experts, hidden.split(counts), probs.split(counts)):
        ones = torch.ones_like(scale)
        call = expert_call.ExpertCall(instance, ones if on_input else scale,
                                      expert_call.token_sources(expert, rows.shape[0]), expert.index)
        with expert_call.running(call):
            output, _ = wrapped(rows, torch.tensor([rows.shape[0]]), scale if on_input else ones)
        outputs.append(output)
    return torch.cat(outputs), None


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.te_grouped_experts",
        summary="TE grouped-GEMM experts (TEGroupedMLP) under tp_invariant: one local expert at a time, "
                "each TEGroupedLinear call the block GEMMs of that expert's weight",
        hook=EXPERTS,
        package="transformer-engine",
        supports={**MEGATRON_CORE_TP_INVARIANT_TESTED, "transformer-engine": "==2.20.2"},
        applies=tp_invariant_with_te,
        targets=(
            Target(EXPERTS, "TEGroupedMLP.forward", _grouped_experts_forward, kind="method",
                   params=("self", "permuted_local_hidden_states", "tokens_per_expert", "permuted_probs")),
        ),
    ),
)
