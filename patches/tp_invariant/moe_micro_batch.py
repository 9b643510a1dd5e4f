"""``tp_invariant``'s micro-batch size for MoE layers: as the word embedding is
(``tp_invariant_micro_batch``), an MoE layer is run one sequence at a time (upstream's
``MoELayer.forward`` per sequence on views of every parameter of the layer): its router's gating GEMM and top-k, the token
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

import torch

from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import gradient_terms
from megapatch.numerics import per_sequence
from megapatch.patches.tp_invariant._mode import tp_invariant_patch

MOE_LAYER = "megatron.core.transformer.moe.moe_layer"


def _moe_forward(wrapped, instance, args, kwargs):
    if per_sequence.inside():  # one sequence's call
        return wrapped(*args, **kwargs)
    hidden = argument(args, kwargs, 0, "hidden_states")
    batch = gradient_terms.sequences(hidden)
    split = (tpi.active() and batch > 1 and torch.is_grad_enabled() and per_sequence.deposits_terms(instance)
             and argument(args, kwargs, 1, "intermediate_tensors", None) is None)
    gradient_terms.note_moe_sequences_per_call(batch if split else 1)
    if not split:
        return wrapped(*args, **kwargs)
    mask = argument(args, kwargs, 2, "padding_mask", None)  # [b, s]

    def call(i):
        return (tpi.sequence(hidden, i),), ({} if mask is None else {"padding_mask": mask[i:i + 1]})

    outputs = per_sequence.run_per_sequence(instance, batch, call,
                                            lambda i: per_sequence.trainable_views(instance, i))
    bias = outputs[0][1]  # the experts' output bias (a parameter, not per token): the same in every call
    return torch.cat([output for output, _ in outputs], dim=1), bias


PATCHES = (
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
