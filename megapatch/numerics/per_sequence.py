"""A module's forward run once per sequence of a micro-batch, each sequence on views of the
parameters whose backward deposits that sequence's weight gradient as a term of its own in the
exact data-parallel sum (``block_tree.SEQUENCE_TERMS``): the gradient terms a micro-batch of that
sequence alone gives, whatever the micro-batch size (``tp_invariant``'s micro-batch patches).
"""

from __future__ import annotations

import contextvars
from typing import Callable, Dict, List

import torch

from megapatch.numerics import gradient_terms

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
        getattr(ctx.param, gradient_terms.SEQUENCE_TERMS)([grad])
        # a tied weight (every sequence deposited): zeros, so that DDP's hook still runs for it
        return (torch.zeros_like(grad) if gradient_terms.tied(ctx.param) else None), None


def inside() -> bool:
    """Whether this call runs inside one sequence's forward (the wrapper passes it through)."""
    return _INSIDE.get()


def term_view(param: torch.Tensor, i: int) -> torch.Tensor:
    """``param`` as sequence ``i`` reads it: the first sequence's gradient goes to DDP's hook (unless
    the weight is tied: then every sequence deposits its own term)."""
    return _SequenceTerm.apply(param, i == 0 and not gradient_terms.tied(param))


def trainable_views(module, i: int) -> Dict[str, torch.Tensor]:
    """Every trainable parameter of ``module`` as sequence ``i`` reads it."""
    return {name: term_view(p, i) for name, p in module.named_parameters() if p.requires_grad}


def deposits_terms(module) -> bool:
    """Whether every trainable parameter of ``module`` deposits its terms into the exact
    data-parallel sum (without DDP, or for a frozen layer: no)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    return bool(trainable) and all(getattr(p, gradient_terms.SEQUENCE_TERMS, None) is not None for p in trainable)


def run_per_sequence(module, sequences: int, call: Callable[[int, Dict[str, torch.Tensor]], tuple],
                     views: Callable[[int], Dict[str, torch.Tensor]]) -> List:
    """``[module's forward on sequence i, i < sequences]``: ``torch.func.functional_call`` with
    ``views(i)`` as the parameters and ``call(i)`` = ``(args, kwargs)`` of sequence ``i``."""
    from torch.func import functional_call

    outputs = []
    for i in range(sequences):
        token = _INSIDE.set(True)
        try:
            args, kwargs = call(i)
            outputs.append(functional_call(module, views(i), args, kwargs))
        finally:
            _INSIDE.reset(token)
    return outputs
