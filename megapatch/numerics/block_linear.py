"""Column- and row-parallel linear layers as autograd Functions over the fixed block tree
(``block_tree``): every GEMM on W/t same-shape blocks, TP sums through the tree, weight gradients per
block (per sequence and per source rank where the exact data-parallel sum takes them:
``gradient_terms``); with sequence parallelism the gather and the scatter of the sequence."""

from __future__ import annotations

import torch

from megapatch.numerics import block_tree as tpi
from megapatch.numerics import packed_bins
from megapatch.numerics.gradient_terms import by_sequence, by_source, cut, cuts, source_terms


class ColumnParallel(torch.autograd.Function):
    """A column-parallel linear (output dim split over TP), optionally summing dgrad over TP.

    forward: each block of N/W output features is one [M, K] x [K, N/W] FP32 GEMM (+ bias),
    rounded once. backward: dgrad is the tree sum of the W blocks' [M, N/W] x [N/W, K] partials
    (over the TP group when ``reduce_dgrad``); wgrad and bias grad are per block. ``halves=2``: a
    gated fc1 (see ``column_blocks``). ``dgrad_on_root``: the summed dgrad is kept by the group's
    rank 0 and zeros elsewhere (an expert's fc1, whose dgrad upstream sums over expert TP itself:
    ``on_root``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, reduce_dgrad, nb, out_dtype=None, halves=1, dgrad_on_root=False,
                sources=None):
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)
        ctx.has_bias, ctx.group, ctx.reduce_dgrad, ctx.nb = bias is not None, group, reduce_dgrad, nb
        ctx.halves, ctx.dgrad_on_root, ctx.sources = halves, dgrad_on_root, sources
        ctx.packed = packed_bins.current(x)
        xs = x.reshape(-1, x.shape[-1])
        x2 = tpi.operand(xs) if sources is None else None
        outs = []
        for sl in tpi.column_blocks(weight.shape[0], nb, halves)[0]:
            w = tpi.operand(weight[sl]).t()
            out = (tpi.token_product(x2, w) if sources is None
                   else by_source(lambda rows: tpi.token_product(tpi.operand(xs[rows]), w), sources, xs.shape[0]))
            if bias is not None:
                out = out + tpi.f32(bias[sl])
            outs.append(out.view(*x.shape[:-1], out.shape[-1]))
        return tpi.owned(torch.cat(outs, dim=-1).to(out_dtype or x.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        sources = ctx.sources
        g2 = grad.reshape(-1, grad.shape[-1])
        partials = []
        layout, tree = tpi.column_blocks(weight.shape[0], ctx.nb, ctx.halves)
        if ctx.needs_input_grad[0]:
            partials = [by_source(lambda rows, sl=sl: tpi.product(tpi.operand(g2[rows, sl]), tpi.operand(weight[sl])),
                                   sources, g2.shape[0]) for sl in tree]
        dgrad = wgrad = bgrad = None
        if partials:
            group = ctx.group if ctx.reduce_dgrad else None
            dgrad = tpi.invariant_sum(partials, group, x.dtype).view(x.shape)
            if ctx.dgrad_on_root:
                dgrad = tpi.on_root(dgrad, group)
        if ctx.needs_input_grad[1] and sources is not None:  # per source: the blocks' wgrads, then the sources' tree
            x2 = x.reshape(-1, x.shape[-1])
            wgrads = [[tpi.product(tpi.operand(g2[rows, sl]).t(), tpi.operand(x2[rows])) for rows in sources.segments()]
                      for sl in layout]
            wgrad = source_terms(ctx.params[0], [torch.cat(blocks, dim=0) for blocks in zip(*wgrads)], sources,
                              weight.dtype)
        elif ctx.needs_input_grad[1]:
            packed = ctx.packed
            wgrad = by_sequence(ctx.params[0], cuts(x, packed),
                                lambda i: _column_wgrad(cut(x, i, packed), cut(grad, i, packed), layout, weight.dtype),
                                lambda: _column_wgrad(x, grad, layout, weight.dtype))
        if ctx.has_bias:
            bgrad = by_sequence(ctx.params[1], cuts(grad, ctx.packed),
                                lambda i: _column_bgrad(cut(grad, i, ctx.packed), layout, weight.dtype),
                                lambda: _column_bgrad(grad, layout, weight.dtype))
        return dgrad, wgrad, bgrad, None, None, None, None, None, None, None


def _column_wgrad(x: torch.Tensor, grad: torch.Tensor, layout, dtype) -> torch.Tensor:
    x2, g2 = tpi.operand(x.reshape(-1, x.shape[-1])), grad.reshape(-1, grad.shape[-1])
    return torch.cat([tpi.product(tpi.operand(g2[:, sl]).t(), x2) for sl in layout], dim=0).to(dtype)


def _column_bgrad(grad: torch.Tensor, layout, dtype) -> torch.Tensor:
    g2 = grad.reshape(-1, grad.shape[-1])
    return torch.cat([tpi.operand(g2[:, sl]).sum(dim=0, dtype=torch.float32) for sl in layout]).to(dtype)


class RowParallel(torch.autograd.Function):
    """A row-parallel linear (input dim K split over TP) *including* its TP sum.

    forward: each block of K/W input features is one [M, K/W] x [K/W, N] FP32 GEMM; the W
    partials go through the fixed tree (across the TP group) and are rounded once. The output is
    the same on every rank, so its gradient is too; dgrad and wgrad are per block. ``on_root``: the
    output is kept by the group's rank 0, zeros elsewhere (an expert's fc2, whose output upstream's
    token dispatcher sums over expert TP: ``on_root``); its gradient, the same on every rank after
    upstream's gather, still reaches every rank's blocks."""

    @staticmethod
    def forward(ctx, x, weight, group, nb, on_root_only=False, sources=None):
        ctx.save_for_backward(x, weight)
        ctx.nb, ctx.sources, ctx.param = nb, sources, weight
        ctx.packed = packed_bins.current(x)
        x2 = x.reshape(-1, x.shape[-1])
        partials = [by_source(lambda rows, sl=sl: tpi.token_product(tpi.operand(x2[rows, sl]), tpi.operand(weight[:, sl]).t()),
                               sources, x2.shape[0]).view(*x.shape[:-1], weight.shape[0])
                    for sl in tpi.slices(weight.shape[1], nb)]
        out = tpi.owned(tpi.invariant_sum(partials, group, x.dtype))
        return tpi.on_root(out, group) if on_root_only else out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        sources = ctx.sources
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad.reshape(-1, grad.shape[-1])
        g2 = tpi.operand(g2) if sources is None else g2
        dgrads, wgrads = [], []
        blocks = tpi.slices(weight.shape[1], ctx.nb)
        for sl in blocks:
            if ctx.needs_input_grad[0]:
                dgrads.append(tpi.product(g2, tpi.operand(weight[:, sl])) if sources is None else
                              by_source(lambda rows: tpi.product(tpi.operand(g2[rows]), tpi.operand(weight[:, sl])),
                                         sources, g2.shape[0]))
            if ctx.needs_input_grad[1] and sources is not None:
                wgrads.append([tpi.product(tpi.operand(g2[rows]).t(), tpi.operand(x2[rows, sl])) for rows in sources.segments()])
        dgrad = torch.cat(dgrads, dim=-1).to(x.dtype).view(x.shape) if dgrads else None
        wgrad = None
        if wgrads:  # per source: the blocks' wgrads, then the sources' tree
            wgrad = source_terms(ctx.param, [torch.cat(blocks, dim=-1) for blocks in zip(*wgrads)], sources,
                              weight.dtype)
        elif ctx.needs_input_grad[1]:
            packed = ctx.packed
            wgrad = by_sequence(ctx.param, cuts(x, packed),
                                lambda i: _row_wgrad(cut(x, i, packed), cut(grad, i, packed), blocks, weight.dtype),
                                lambda: _row_wgrad(x, grad, blocks, weight.dtype))
        return dgrad, wgrad, None, None, None, None


def _row_wgrad(x: torch.Tensor, grad: torch.Tensor, blocks, dtype) -> torch.Tensor:
    x2, g2 = x.reshape(-1, x.shape[-1]), tpi.operand(grad.reshape(-1, grad.shape[-1]))
    return torch.cat([tpi.product(g2.t(), tpi.operand(x2[:, sl])) for sl in blocks], dim=-1).to(dtype)


def _own_rows(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/t of ``x`` along dim 0 (the sequence), as a tensor of its own."""
    rows = x.shape[0] // tpi.group_size(group)
    rank = group.rank()
    return x[rank * rows:(rank + 1) * rows].contiguous()


class GatherSequence(torch.autograd.Function):
    """The sequence-parallel input of a column-parallel layer, all-gathered along the sequence
    (dim 0; exact). Backward: the gradient arriving here is already the fixed-tree TP sum (the same
    on every rank, ``ColumnParallel`` with ``reduce_dgrad``), so this rank's slice of it is taken
    where upstream's reduce-scatter would add the TP partials in its own order."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t = tpi.group_size(group)
        out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        tpi.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _own_rows(grad, ctx.group), None


class ScatterSequence(torch.autograd.Function):
    """The sequence-parallel output of a row-parallel layer: its fixed-tree TP sum (the same on
    every rank) sliced to this rank's part of the sequence (exact). Backward: the slices'
    gradients all-gathered (exact)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_rows(x, group)

    @staticmethod
    def backward(ctx, grad):
        return GatherSequence.forward(ctx, grad, ctx.group), None
