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
(An MoE layer likewise: ``tp_invariant_moe_micro_batch``.)
"""

from __future__ import annotations

import torch

from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import gradient_terms
from megapatch.numerics import packed_bins
from megapatch.numerics import per_sequence
from megapatch.patches._common import LAYERS
from megapatch.patches.tp_invariant._mode import tp_invariant_patch


def _packed_embedding(instance, tokens, packed):
    """A packed bin's lookup one segment at a time (``numerics.packed_bins``), each segment's weight
    gradient a term of its own. Under sequence parallelism each segment's lookup is TP-summed whole (one
    non-zero per token: the same bits as upstream's reduce-scatter) and the bin then cut to this rank's
    rows, whose backward gathers the rows' gradients as upstream's reduce-scatter backward does."""
    scatter = bool(getattr(instance, "reduce_scatter_embeddings", False))
    instance.reduce_scatter_embeddings = False
    try:
        outputs = per_sequence.run_per_sequence(
            instance, packed.count(), lambda i: ((tokens[:, slice(packed.segments[i][0], sum(packed.segments[i]))],), {}),
            lambda i: {"weight": per_sequence.term_view(instance.weight, i)})
    finally:
        instance.reduce_scatter_embeddings = scatter
    output = torch.cat(outputs, dim=1)  # [1, rows, h], upstream's layout without the reduce-scatter
    if not scatter:
        return output
    from megapatch.numerics.block_linear import ScatterSequence

    return ScatterSequence.apply(output.transpose(0, 1).contiguous(), instance.tp_group)


def _embedding_forward(wrapped, instance, args, kwargs):
    tokens = argument(args, kwargs, 0, "input_")
    weight = instance.weight
    if (per_sequence.inside() or not tpi.active() or tokens.dim() != 2
            or not (torch.is_grad_enabled() and weight.requires_grad)
            or getattr(weight, gradient_terms.SEQUENCE_TERMS, None) is None):
        return wrapped(*args, **kwargs)
    packed = packed_bins.for_tokens(tokens)
    if packed is not None:
        return _packed_embedding(instance, tokens, packed)
    if tokens.shape[0] < 2 and not gradient_terms.tied(weight):
        return wrapped(*args, **kwargs)
    outputs = per_sequence.run_per_sequence(instance, tokens.shape[0], lambda i: ((tokens[i:i + 1],), {}),
                                            lambda i: {"weight": per_sequence.term_view(weight, i)})
    # upstream's layouts: [b, s, h], or [s/t, b, h] when it reduce-scatters into sequence parallelism
    return torch.cat(outputs, dim=1 if getattr(instance, "reduce_scatter_embeddings", False) else 0)


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
)
