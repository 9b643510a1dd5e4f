"""Sums over tokens under the fixed tree: a norm's weight and bias gradients, a row-parallel
bias's, the router's gating GEMM and an expert's routing-probability scale. Their tokens are cut
into blocks of consecutive positions that do not move with the TP size (``block_tree.token_blocks``),
across TP where sequence parallelism splits them; a QK norm's over tokens and the heads TP splits."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from megapatch.core import state
from megapatch.core.errors import OptionError
from megapatch.numerics.block_shapes import WIDTH_OPTION
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import packed_bins
from megapatch.numerics.gradient_terms import by_sequence, cut, cuts


def _token_tree(grad: torch.Tensor, factor: Optional[torch.Tensor], group, nb: int,
                split: bool, heads: bool = False) -> torch.Tensor:
    """sum over tokens of ``grad`` (times ``factor``) per feature, as ``nb`` blocks of consecutive
    sequence positions (rows of the [s, b, h] layout flattened to [s * b, h]) with FP32 sums, added
    in the fixed tree -- across ``group`` when ``split`` (sequence parallelism: this rank's tokens
    are W/t consecutive blocks). ``heads``: a QK norm's ``[s, b, n, d]``, summed over tokens and
    this rank's heads as ``head_leaves`` blocks them, always across ``group`` (TP splits the
    heads). Across the group rank 0 returns the total and the others zeros: upstream all-reduces
    sequence-parallel and QK-norm gradients over TP (``finalize_model_grads``), and one value plus
    zeros is exact."""
    if heads:
        parts = head_leaves(grad, factor, nb)
    else:
        g2 = grad.reshape(-1, grad.shape[-1])
        f2 = None if factor is None else factor.reshape(-1, factor.shape[-1])
        parts = [(tpi.f32(g2[sl]) if f2 is None else tpi.f32(g2[sl]) * tpi.f32(f2[sl])).sum(dim=0)
                 for sl in tpi.slices(g2.shape[0], nb)]
    return _token_sum(parts, group if split or heads else None)


def _gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty((tpi.group_size(group) * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    tpi.all_gather_single(out, t.contiguous(), group=group)
    return out


def _per_sequence(ctx, param, grad: torch.Tensor, factor: Optional[torch.Tensor], dtype) -> torch.Tensor:
    """``param``'s gradient, the sum over tokens of ``grad`` (times ``factor``) under the fixed tree, as
    ``gradient_terms.by_sequence`` takes it: one term per sequence of the micro-batch, or per segment of a
    packed bin (``ctx.packed``). A bin split by sequence parallelism is gathered first (a segment's frame
    starts at its own first row, not at a rank's), its terms then summed over all W token blocks on each
    rank and kept on the group's rank 0 -- the tree the split sum computes, over the frame's blocks."""
    packed, group = ctx.packed, ctx.group

    def whole():
        return _token_tree(grad, factor, group, ctx.nb, ctx.split, ctx.heads).to(dtype)

    t = tpi.group_size(group)
    if packed is None or not ctx.split or ctx.heads or t == 1:
        return by_sequence(param, cuts(grad, packed), lambda i: _token_tree(
            cut(grad, i, packed), None if factor is None else cut(factor, i, packed),
            group, ctx.nb, ctx.split, ctx.heads).to(dtype), whole)
    gathered = {}

    def term(i):
        if not gathered:
            gathered["grad"] = _gather_rows(grad, group)
            gathered["factor"] = None if factor is None else _gather_rows(factor, group)
        g, f = gathered["grad"], gathered["factor"]
        total = _token_tree(packed.frame(g, i), None if f is None else packed.frame(f, i), None, ctx.nb * t, False)
        return tpi.on_root(total, group).to(dtype)

    return by_sequence(param, packed.count(), term, whole)


def _token_sum(parts: Sequence[torch.Tensor], group) -> torch.Tensor:
    """The fixed-tree sum of token blocks' FP32 partials, across ``group`` (None: this rank's
    blocks only), kept on the group's rank 0 (``on_root``): upstream all-reduces such gradients
    over TP (``finalize_model_grads``)."""
    return tpi.on_root(tpi.invariant_sum(parts, group), group)


def head_leaves(grad: torch.Tensor, factor: Optional[torch.Tensor], nb: int) -> List[torch.Tensor]:
    """A QK norm's weight (or bias) gradient on this rank, ``nb`` = W/t leaves of the fixed tree.
    ``grad``: ``[s, b, n, d]``, n this rank's heads (query) or KV groups (key): n/t of the model's,
    a contiguous run of its head order. The model's heads fall into W leaves: n/W consecutive heads
    each where W divides n (the same heads, so the same sums, at every TP size); where n divides
    W, one head each followed by W/n - 1 zero leaves (adding zeros is exact: the tree over W leaves
    is then the tree over the n heads). Other head counts are refused when the model is built
    (``block_shapes.qk_norm_refusals``)."""
    s, b, n, d = grad.shape
    g = grad.reshape(s * b, n, d)
    f = None if factor is None else factor.reshape(s * b, n, d)

    def leaf(heads: slice) -> torch.Tensor:
        block = tpi.f32(g[:, heads]) if f is None else tpi.f32(g[:, heads]) * tpi.f32(f[:, heads])
        return block.reshape(-1, d).sum(dim=0)

    if n % nb == 0:
        per = n // nb
        return [leaf(slice(i * per, (i + 1) * per)) for i in range(nb)]
    if nb % n == 0:
        zero = torch.zeros(d, dtype=torch.float32, device=grad.device)
        return [part for h in range(n) for part in [leaf(slice(h, h + 1))] + [zero] * (nb // n - 1)]
    raise OptionError(
        f"megapatch tp_invariant: a QK norm over {n} heads per rank cannot be cut into "
        f"{WIDTH_OPTION}={tpi.width()} ({state.origin(WIDTH_OPTION)}) blocks: W must divide the model's head "
        f"count or be a multiple of it")


class TokenBlockedAffine(torch.autograd.Function):
    """A norm layer's affine part, ``normalised * weight (+ bias)`` in FP32 rounded once to
    ``out_dtype`` (``normalised``: the FP32 output of the norm without affine). The weight and bias
    gradients, sums over tokens (``heads``: and over a QK norm's heads), follow ``_token_tree``;
    the gradient of ``normalised`` is per token."""

    @staticmethod
    def forward(ctx, normalised, weight, bias, group, nb, split, out_dtype, heads=False):
        ctx.save_for_backward(normalised, weight)
        ctx.params = (weight, bias)
        ctx.has_bias, ctx.group, ctx.nb, ctx.split, ctx.heads = bias is not None, group, nb, split, heads
        ctx.packed = packed_bins.current(normalised, tpi.group_size(group) if split and not heads else 1)
        out = normalised * weight.float()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        normalised, weight = ctx.saved_tensors
        dnormalised = grad.float() * weight.float() if ctx.needs_input_grad[0] else None
        dweight = _per_sequence(ctx, ctx.params[0], grad, normalised, weight.dtype)
        dbias = _per_sequence(ctx, ctx.params[1], grad, None, weight.dtype) if ctx.has_bias else None
        return dnormalised, dweight, dbias, None, None, None, None, None


class TokenBlockedBias(torch.autograd.Function):
    """A row-parallel layer's bias expanded to the output's shape (the same values a broadcast add
    reads); its gradient, a sum over tokens, follows ``_token_tree``."""

    @staticmethod
    def forward(ctx, bias, shape, group, nb, split):
        ctx.group, ctx.nb, ctx.split, ctx.dtype, ctx.param = group, nb, split, bias.dtype, bias
        ctx.heads = False
        out = bias.expand(shape).clone()
        ctx.packed = packed_bins.current(out, tpi.group_size(group) if split else 1)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _per_sequence(ctx, ctx.param, grad, None, ctx.dtype), None, None, None, None


class TokenBlockedLinear(torch.autograd.Function):
    """A replicated linear layer applied to this rank's tokens (a MoE router's gating GEMM):
    ``x W^T (+ b)`` as ``nb`` FP32 GEMMs over blocks of consecutive tokens (rows of the flattened
    [s, b] layout; the same blocks at every TP size, sequence parallelism giving each rank W/t of
    them), the result in ``out_dtype``. dgrad per block; the weight and bias gradients, sums over
    tokens, follow ``_token_sum`` (across ``group`` when ``split``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, nb, split, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.group, ctx.nb, ctx.split = bias is not None, group, nb, split
        x2 = x.reshape(-1, x.shape[-1])
        w = tpi.operand(weight)
        outs = []
        for sl in tpi.slices(x2.shape[0], nb):
            out = tpi.product(tpi.operand(x2[sl]), w.t())
            outs.append(out + tpi.f32(bias) if bias is not None else out)
        return torch.cat(outs).to(out_dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        blocks = tpi.slices(x2.shape[0], ctx.nb)
        group = ctx.group if ctx.split else None
        dgrad = wgrad = bgrad = None
        if ctx.needs_input_grad[0]:
            w = tpi.operand(weight)
            dgrad = torch.cat([tpi.product(tpi.operand(g2[sl]), w) for sl in blocks]).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            wgrad = _token_sum([tpi.product(tpi.operand(g2[sl]).t(), tpi.operand(x2[sl])) for sl in blocks],
                               group).to(weight.dtype)
        if ctx.has_bias:
            bgrad = _token_sum([tpi.f32(g2[sl]).sum(dim=0) for sl in blocks], group).to(weight.dtype)
        return dgrad, wgrad, bgrad, None, None, None, None


class ScaledRows(torch.autograd.Function):
    """``(x * scale[..., None]).to(x.dtype)``: a MoE expert's activation times each token's
    routing probability, computed as upstream computes it (elementwise). The probability's
    gradient, a sum over the features expert TP splits, runs as this rank's ``nb`` = W/t feature
    blocks in the fixed tree across ``group``, kept on its rank 0 (``on_root``: upstream sums the
    probabilities' gradients over the expert-TP ranks in the dispatcher's gather backward)."""

    @staticmethod
    def forward(ctx, x, scale, group, nb):
        ctx.save_for_backward(x, scale)
        ctx.group, ctx.nb = group, nb
        return (x * scale.unsqueeze(-1)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        dx = (grad * scale.unsqueeze(-1)).to(x.dtype) if ctx.needs_input_grad[0] else None
        dscale = None
        if ctx.needs_input_grad[1]:
            parts = [(tpi.f32(grad[..., sl]) * tpi.f32(x[..., sl])).sum(dim=-1) for sl in tpi.slices(x.shape[-1], ctx.nb)]
            dscale = _token_sum(parts, ctx.group).to(scale.dtype)
        return dx, dscale, None, None
