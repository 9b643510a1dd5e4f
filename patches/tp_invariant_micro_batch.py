"""``tp_invariant``'s micro-batch size: the word embedding's weight gradient one sequence at a time.

The mode's own layers (``block_tree``: the linears' weight and bias gradients, the norms') compute a
micro-batch of several sequences' weight gradients per sequence and hand each to the exact
data-parallel sum as a term of its own (``block_tree.by_sequence``), so the summed gradient has
the same terms at micro-batch sizes 1, 2 and 4. The embedding's weight gradient is upstream's
(``F.embedding``'s backward adds every token of the micro-batch into one dense gradient, rounded
to the parameter's dtype once): here a micro-batch of ``b > 1`` sequences runs upstream's
``VocabParallelEmbedding.forward`` once per sequence, each on a view of the weight whose backward
deposits that sequence's gradient -- the one a micro-batch of that sequence alone gives -- as its
own term. The outputs are concatenated along the batch (upstream's TP reduction of each sequence is
one non-zero per token: exact). A weight tied to the output layer (PP 1) deposits every sequence's
term, the first too, so that the output layer's terms stay terms of their own (``block_tree.tied``).
Micro-batches of one sequence of an untied weight, and parameters whose gradient does not go into
the exact sum (no DDP), take upstream's path untouched.

An MoE layer is run the same way, one sequence at a time (upstream's ``MoELayer.forward`` per
sequence on views of every parameter of the layer): its router's gating GEMM and top-k, the token
dispatch, each expert's GEMMs on the tokens routed to it and each expert's weight-gradient term
(per source data-parallel rank, ``block_tree.source_terms``) then see exactly the rows a
micro-batch of that sequence alone gives them, so the router's, the experts' and the shared
experts' weight-gradient terms are the same at micro-batch sizes 1, 2 and 4. The aux and z losses
are then computed per sequence -- upstream's objective at micro-batch size 1, where at a larger
size upstream pools the micro-batch's tokens into one load-balancing term -- and their gradient
scale is ``1 / sequences`` of the global batch (``tp_invariant.loss_scale`` reads
``block_tree.moe_sequences_per_call``), one FP32 value at every micro-batch size.
"""

from __future__ import annotations

import contextvars

import torch

from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics import block_tree as tpi
from megapatch.patches._common import LAYERS, tp_invariant_patch

MOE_LAYER = "megatron.core.transformer.moe.moe_layer"

_INSIDE = contextvars.ContextVar("megapatch_one_sequence", default=False)  # inside one sequence's call


class _SequenceTerm(torch.autograd.Function):
    """A parameter, as one sequence's forward reads it; backward: that sequence's gradient is
    passed on (the first sequence, for DDP's hook to deposit) or deposited as a term of its own."""

    @staticmethod
    def forward(ctx, weight, first):
        ctx.param, ctx.first = weight, first
        view = weight.view_as(weight)
        # what the mode's layers read on a parameter (its exact-sum sink, tied, sequence parallel, ...)
        view.__dict__.update(weight.__dict__)
        return view

    @staticmethod
    def backward(ctx, grad):
        if ctx.first:
            return grad, None
        getattr(ctx.param, tpi.SEQUENCE_TERMS)([grad])
        # a tied weight (every sequence deposited): zeros, so that DDP's hook still runs for it
        return (torch.zeros_like(grad) if tpi.tied(ctx.param) else None), None


def _embedding_forward(wrapped, instance, args, kwargs):
    tokens = argument(args, kwargs, 0, "input_")
    weight = instance.weight
    if (_INSIDE.get() or not tpi.active() or tokens.dim() != 2 or (tokens.shape[0] < 2 and not tpi.tied(weight))
            or not (torch.is_grad_enabled() and weight.requires_grad)
            or getattr(weight, tpi.SEQUENCE_TERMS, None) is None):
        return wrapped(*args, **kwargs)
    from torch.func import functional_call

    outputs = []
    for i in range(tokens.shape[0]):
        inside = _INSIDE.set(True)
        try:
            first = i == 0 and not tpi.tied(weight)
            outputs.append(functional_call(instance, {"weight": _SequenceTerm.apply(weight, first)},
                                           (tokens[i:i + 1],)))
        finally:
            _INSIDE.reset(inside)
    # upstream's layouts: [b, s, h], or [s/t, b, h] when it reduce-scatters into sequence parallelism
    return torch.cat(outputs, dim=1 if getattr(instance, "reduce_scatter_embeddings", False) else 0)


def _one_sequence_at_a_time(module, batch: int) -> bool:
    """Whether ``module``'s forward on a micro-batch of ``batch`` sequences runs once per sequence:
    under the mode, with gradients, when every trainable parameter of it deposits its terms into the
    exact data-parallel sum (without DDP, or for a frozen layer, upstream's whole micro-batch)."""
    if _INSIDE.get() or not tpi.active() or batch < 2 or not torch.is_grad_enabled():
        return False
    trainable = [p for p in module.parameters() if p.requires_grad]
    return bool(trainable) and all(getattr(p, tpi.SEQUENCE_TERMS, None) is not None for p in trainable)


def _sequence_views(module, i: int) -> dict:
    """Every trainable parameter of ``module`` as sequence ``i`` reads it (``_SequenceTerm``)."""
    return {name: _SequenceTerm.apply(p, i == 0 and not tpi.tied(p))
            for name, p in module.named_parameters() if p.requires_grad}


def _moe_forward(wrapped, instance, args, kwargs):
    if _INSIDE.get():  # one sequence's call
        return wrapped(*args, **kwargs)
    hidden = argument(args, kwargs, 0, "hidden_states")
    batch = tpi.sequences(hidden)
    split = (_one_sequence_at_a_time(instance, batch)
             and argument(args, kwargs, 1, "intermediate_tensors", None) is None)
    tpi.note_moe_sequences_per_call(batch if split else 1)
    if not split:
        return wrapped(*args, **kwargs)
    from torch.func import functional_call

    mask = argument(args, kwargs, 2, "padding_mask", None)  # [b, s]
    outputs = []
    for i in range(batch):
        inside = _INSIDE.set(True)
        try:
            extra = {} if mask is None else {"padding_mask": mask[i:i + 1]}
            outputs.append(functional_call(instance, _sequence_views(instance, i),
                                           (tpi.sequence(hidden, i),), extra))
        finally:
            _INSIDE.reset(inside)
    bias = outputs[0][1]  # the experts' output bias (a parameter, not per token): the same in every call
    return torch.cat([output for output, _ in outputs], dim=1), bias


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.micro_batch",
        summary="the word embedding's weight gradient per sequence, each a term of the exact "
                "data-parallel sum (with the mode's layers': the same summed gradient at any "
                "micro-batch size)",
        hook=LAYERS,
        targets=(
            Target(LAYERS, "VocabParallelEmbedding.forward", _embedding_forward, kind="method",
                   params=("self", "input_")),
        ),
    ),
    tp_invariant_patch(
        name="tp_invariant.moe_micro_batch",
        summary="an MoE layer run one sequence at a time on a micro-batch of several (router, experts and "
                "shared experts: each sequence's weight-gradient terms as at micro-batch size 1; aux and "
                "z losses per sequence)",
        hook=MOE_LAYER,
        targets=(
            Target(MOE_LAYER, "MoELayer.forward", _moe_forward, kind="method", params=("self", "hidden_states")),
        ),
    ),
)
