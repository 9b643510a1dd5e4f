"""Bitwise tensor-parallel invariance: the arithmetic behind ``tp_invariant=True``.

Every sum that tensor parallelism splits is computed as W fixed-shape blocks (W =
``tp_invariant_width``), each block's partial kept in FP32, and the W partials added in one fixed
pairwise tree: adjacent pairs first, level by level. At TP size t a rank owns W/t consecutive
blocks, which form a complete subtree of that tree (W/t is a power of two); it computes its
subtree root locally; the FP32 roots are exchanged and the top of the tree is computed in the same
order for every element (see ``invariant_sum``). The result is rounded once, to the activation
dtype.

Every GEMM on a TP-sharded tensor runs on W/t blocks of the same shape at every TP size, so the
same kernel runs on the same data and gives the same bits: the block GEMMs run on fresh FP32
copies (exact products, FP32 accumulation), whose shape and alignment do not depend on the TP size
either. Elementwise ops (activations, softmax rows, Adam) are left alone: their result for an
element does not depend on where it sits in the tensor (``tests/test_tp_invariant.py`` checks
this for the activations on the installed torch).

Here only the TP size changes between runs that must agree. The data-parallel size, the pipeline
depth and the micro-batch size may change too where DDP feeds the exact data-parallel sum
(``exact_sum``): weight gradients then go to it per sequence (``by_sequence``) and per source rank
of an expert's tokens (``source_terms``). The global batch, the width W, the hardware and the
libraries must be the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.distributed import distributed_c10d as c10d

from megapatch.core import state
from megapatch.core.errors import OptionError
from megapatch.numerics.block_shapes import WIDTH_OPTION, valid_widths, width  # noqa: F401 (used as tpi.*)


def active() -> bool:
    return bool(getattr(state.current(), "tp_invariant", False))


#: on a parameter: a callable that deposits a list of gradients into the exact data-parallel sum,
#: each a term of its own (set by ``tp_invariant.data_parallel`` on the parameters DDP's hook
#: feeds). With it, a micro-batch of several sequences hands over one weight-gradient term per
#: sequence, each computed exactly as a micro-batch of that sequence alone computes its gradient:
#: the exact sum then gets the same terms at every micro-batch size.
SEQUENCE_TERMS = "_megapatch_sequence_terms"


def sequences(t: torch.Tensor) -> int:
    """The number of sequences in an activation of Megatron's ``[s, b, ...]`` layout."""
    return t.shape[1] if t.dim() >= 3 else 1


def tied(param) -> bool:
    """A weight two layers of one pipeline stage use (tied embeddings at PP 1: megatron-core marks
    it ``zero_out_wgrad``): autograd would add its two gradients in one ``.grad`` per micro-batch."""
    return bool(getattr(param, "zero_out_wgrad", False))


def by_sequence(param, batch: int, term, whole):
    """``param``'s gradient from a micro-batch of ``batch`` sequences: ``whole()`` (the micro-batch's
    sum) unless the parameter's gradient goes into the exact data-parallel sum; then ``term(i)``
    (sequence i's gradient, rounded as the returned gradient is) for every sequence, each but the
    first deposited there as a term of its own, the first returned for DDP's hook to deposit. A tied
    weight deposits every term, at every micro-batch size, and returns zeros: its other use's terms
    then stay terms of their own too, instead of meeting the first sequence's in one ``.grad``."""
    shared = tied(param)
    sink = getattr(param, SEQUENCE_TERMS, None) if (batch > 1 or shared) and active() else None
    if sink is None:
        return whole()
    return _hand_over(sink, [term(i) for i in range(batch)], shared)


def _hand_over(sink, terms: List[torch.Tensor], shared: bool) -> torch.Tensor:
    """The gradient to give autograd when ``terms`` are a parameter's terms of the exact sum: the
    first (DDP's hook deposits it), the others deposited through ``sink``; for a tied weight all of
    them through ``sink``, and zeros to autograd (so DDP's hook still runs for the parameter)."""
    if shared:
        sink(terms)
        return torch.zeros_like(terms[0])
    if len(terms) > 1:
        sink(terms[1:])
    return terms[0]


_moe_sequences = [1]


def note_moe_sequences_per_call(n: int) -> None:
    """Record that the MoE layer just run split its micro-batch into calls of one sequence each
    (``n`` sequences; 1: one call on the whole micro-batch)."""
    _moe_sequences[0] = n


def moe_sequences_per_call() -> int:
    """The last MoE layer's sequences run one at a time (1 when it ran the micro-batch whole):
    each of those calls' aux and z losses is one sequence's."""
    return _moe_sequences[0]


#: on a gated fc1's weight and bias (SwiGLU): 2 -- rank r holds [gate_r; up_r] (``column_blocks``)
GATED_HALVES = "_megapatch_gated_halves"


def token_blocks(tokens: torch.Tensor, group, split: bool) -> int:
    """Blocks of consecutive sequence positions this rank's tokens ([s, b, h]) form: W, or W/t when
    sequence parallelism splits the sequence over the TP group. Without it (or over a TP group of
    one, where nothing is split: a rollout model at TP 1 keeps the trainer's sequence_parallel), a
    sequence W does not divide is one block (the same at every TP size; such a run cannot use sequence parallelism
    under the mode, which refuses it, so there is no split run to agree with)."""
    group = group if split else None
    if group_size(group) == 1 and tokens.shape[0] % width():
        return 1
    check_divisible("the sequence (tokens summed into a norm or bias gradient)",
                    tokens.shape[0] * group_size(group), tokens.shape[0], group)
    return blocks_per_rank(group)


def sequence(t: torch.Tensor, i: int) -> torch.Tensor:
    """Sequence ``i`` of an ``[s, b, ...]`` activation, as ``[s, 1, ...]``."""
    return t[:, i:i + 1]


def blocks_per_rank(group) -> int:
    """W / t for this TP group; refuses a TP size that does not divide W."""
    w, t = width(), group_size(group)
    if w % t:
        valid = valid_widths(t)
        raise OptionError(
            f"megapatch tp_invariant: {WIDTH_OPTION}={w} ({state.origin(WIDTH_OPTION)}) is not a multiple of the "
            f"tensor-parallel size {t}; results are TP-invariant only for TP sizes dividing the width. "
            f"Valid widths for TP={t}: {valid}")
    return w // t


def group_size(group) -> int:
    return 1 if group is None else group.size()


def check_divisible(what: str, full: int, local: int, group) -> int:
    """The block size of a dimension split into W blocks; refuses one W does not divide."""
    nb = blocks_per_rank(group)
    if local % nb:
        raise OptionError(
            f"megapatch tp_invariant: {what} has size {full}, not divisible by "
            f"{WIDTH_OPTION}={width()} ({state.origin(WIDTH_OPTION)}); every TP-split dimension must split into "
            f"W equal blocks. Use a width that divides {full} (a power of two that every TP size "
            f"divides), or pad the dimension.")
    return local // nb


def f32(t: torch.Tensor) -> torch.Tensor:
    """A fresh, contiguous FP32 copy: same shape, layout and alignment at every TP size."""
    return t.to(torch.float32, memory_format=torch.contiguous_format, copy=True)


# BF16/FP16 operands with an FP32 result in one GEMM (aten::mm.dtype): CUDA kernels only in torch
# 2.13, so CPU GEMMs run on FP32 copies instead (exact products, FP32 accumulation either way).
_HALF_GEMM = hasattr(torch.ops.aten.mm, "dtype")
_HALF = (torch.bfloat16, torch.float16)


def operand(t: torch.Tensor) -> torch.Tensor:
    """A block GEMM operand: a fresh contiguous copy (layout and alignment independent of the TP
    size), kept in BF16/FP16 where a half-precision-in, FP32-out GEMM exists (CUDA), else FP32."""
    if _HALF_GEMM and t.dtype in _HALF and t.device.type in ("cuda", "meta"):
        return t.clone(memory_format=torch.contiguous_format)
    return f32(t)


def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two ``operand``s (or views of them), FP32 result and accumulation."""
    if a.dtype == b.dtype and a.dtype in _HALF:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


#: CPU FP32 GEMMs give a row other bits at 1-3, 5-7 and 9-11 rows than inside a product of more
#: rows (from 12 on, and at 4 and 8, they agree): a dense layer's forward on fewer token rows runs
#: on zero-padded rows, so that a decode step's few rows (one a request) get the bits the trainer's
#: micro-batch gives them. GPU libraries choose kernels by row count in other ways (results/gpu_check.md).
MIN_TOKEN_ROWS = 16


def token_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``product(a, b)`` for ``a`` = token rows, with the same bits for a row at any row count (CPU)."""
    rows = a.shape[0]
    if rows >= MIN_TOKEN_ROWS or a.device.type != "cpu":
        return product(a, b)
    padded = a.new_zeros((MIN_TOKEN_ROWS, *a.shape[1:]))
    padded[:rows] = a
    return product(padded, b)[:rows]


def tree_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Pairwise sum of a power-of-two number of tensors: adjacent pairs, level by level."""
    parts = list(parts)
    if len(parts) & (len(parts) - 1):
        raise ValueError(f"tree_sum needs a power-of-two count, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def invariant_sum(partials: Sequence[torch.Tensor], group,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The fixed-tree FP32 sum of all W block partials, given this rank's W/t of them; every rank
    gets the same bits. With ``out_dtype``, the sum is returned rounded to it.

    Without ``out_dtype`` the FP32 subtree roots are all-gathered (t x 4 bytes per element
    received). With it, each rank receives every peer's roots for one 1/t slice of the elements
    (all-to-all), computes the top of the tree there, rounds, and the rounded slices are
    all-gathered: (t-1)/t x (4 + 2) bytes per element for BF16, 1.5x a native ring all-reduce."""
    root = tree_sum(partials)
    t = group_size(group)
    if t == 1:
        return root if out_dtype is None else root.to(out_dtype)
    flat = root.reshape(-1)
    if out_dtype is None:
        gathered = torch.empty(t * flat.numel(), dtype=root.dtype, device=root.device)
        _all_gather_single(gathered, flat.contiguous(), group=group)
        return tree_sum([part.view_as(root) for part in gathered.view(t, -1).unbind(0)])
    pad = (-flat.numel()) % t
    send = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.contiguous()
    recv = torch.empty_like(send)
    c10d.all_to_all_single(recv, send, group=group)  # row i: peer i's roots for my slice
    mine = tree_sum(recv.view(t, -1).unbind(0)).to(out_dtype)
    if pad == 0:  # gathered straight into a tensor of the result's shape (not a view)
        out = torch.empty(root.shape, dtype=out_dtype, device=root.device)
        _all_gather_single(out.view(-1), mine, group=group)
        return out
    out = torch.empty(t * mine.numel(), dtype=out_dtype, device=root.device)
    _all_gather_single(out, mine, group=group)
    return out[: flat.numel()].view_as(root)


# torch >= 2.13 names it all_gather_single (and deprecates the old name)
_all_gather_single = getattr(c10d, "all_gather_single", None) or c10d.all_gather_into_tensor


def slices(size: int, nb: int) -> List[slice]:
    """``nb`` equal consecutive slices of ``size``. The callers' shape checks make ``nb`` divide
    ``size``; a remainder would drop rows from a sum, so it is an error here, never a truncation."""
    if size % nb:
        raise ValueError(f"megapatch tp_invariant: {size} rows do not split into {nb} equal blocks")
    step = size // nb
    return [slice(i * step, (i + 1) * step) for i in range(nb)]


def column_blocks(rows: int, nb: int, halves: int = 1):
    """Row slices of a column-parallel weight: ``(layout order, tree order)``.

    ``halves=2`` is a gated fc1 (SwiGLU): rank r holds [gate_r; up_r], so each half is cut into its
    own ``nb`` blocks -- the blocks then hold the same rows of the full gate and up weights at
    every TP size -- and the fixed tree pairs gate block k with up block k at its leaves, which
    keeps a rank's blocks one complete subtree (W gate + W up leaves in all)."""
    half = rows // halves
    step = half // nb
    per_half = [[slice(h * half + b * step, h * half + (b + 1) * step) for b in range(nb)]
                for h in range(halves)]
    layout = [s for blocks in per_half for s in blocks]
    tree = [per_half[h][b] for b in range(nb) for h in range(halves)]
    return layout, tree


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy if it is a view: megatron's cross entropy modifies FP32 logits in place,
    which autograd forbids on a view returned by a custom Function."""
    return t if t._base is None else t.clone()


@dataclasses.dataclass(frozen=True)
class TokenSources:
    """Where a routed expert's input rows come from, for the GEMMs on them and the sum of its weight
    gradient over them: ``counts[i]`` consecutive rows from data-parallel rank ``leaves[i]`` (that
    rank's tokens routed to this expert, in sequence order), in this rank's row order; ``group``:
    the ranks that hold the same expert weights and receive the other data-parallel ranks' rows
    (expert data parallel); ``total``: the data-parallel size, the number of leaves of the tree."""

    counts: Tuple[int, ...]
    leaves: Tuple[int, ...]
    group: Any
    total: int

    def segments(self) -> List[slice]:
        found, start = [], 0
        for n in self.counts:
            found.append(slice(start, start + n))
            start += n
        return found


def _segments(sources: Optional[TokenSources], rows: int) -> List[slice]:
    return [slice(0, rows)] if sources is None else sources.segments()


def _by_source(f, sources: Optional[TokenSources], rows: int) -> torch.Tensor:
    """``f(rows)`` over each source's rows (all rows without sources), concatenated: every GEMM on an
    expert's tokens sees one data-parallel rank's tokens, however many ranks' an EP rank received."""
    parts = [f(rows_) for rows_ in _segments(sources, rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def source_terms(param, parts: Sequence[torch.Tensor], sources: TokenSources, dtype) -> torch.Tensor:
    """An expert weight gradient from its per-source FP32 partials. Where the parameter's gradient
    goes into the exact data-parallel sum (``SEQUENCE_TERMS``), each source's partial is rounded to
    ``dtype`` and is a term of that sum of its own -- as a dense layer's micro-batch gradient is: a
    source's tokens give the same term whichever EP rank computed them, and whether they arrive as
    another data-parallel rank's micro-batch or as this rank's next one, so the sum is independent
    of the EP size and of the data-parallel size. Elsewhere (no DDP) the fixed tree over the sources
    (``source_sum``)."""
    sink = getattr(param, SEQUENCE_TERMS, None) if active() else None
    if sink is None:
        return source_sum(parts, sources).to(dtype)
    return _hand_over(sink, [part.to(dtype) for part in parts], tied(param))


def source_sum(parts: Sequence[torch.Tensor], sources: TokenSources) -> torch.Tensor:
    """An expert weight gradient from its per-source FP32 partials (one per entry of
    ``sources.counts``): the partials of every data-parallel rank's tokens, gathered over the
    expert-data-parallel ``group``, added in one fixed tree in data-parallel rank order, kept on the
    group's rank 0 (``on_root``: upstream's DDP then all-reduces expert gradients over that group).
    The same bits whichever EP rank received which data-parallel rank's tokens."""
    if sources.total & (sources.total - 1):
        from megapatch.core.errors import UnsupportedConfigurationError

        raise UnsupportedConfigurationError(
            f"megapatch tp_invariant: an expert weight gradient over {sources.total} data-parallel ranks "
            f"without DDP's exact sum: the fixed tree over the ranks needs a power-of-two data-parallel size. "
            f"Wrap the model in megatron-core's DistributedDataParallel (its exact sum takes any size), or "
            f"run a power-of-two data-parallel size")
    local = torch.stack(list(parts))
    leaves = torch.tensor(sources.leaves, dtype=torch.long)
    n = group_size(sources.group)
    if n > 1:
        gathered = torch.empty((n * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
        _all_gather_single(gathered, local.contiguous(), group=sources.group)
        every = torch.empty(n * leaves.numel(), dtype=torch.long)
        _all_gather_single(every, leaves, group=sources.group)
        local, leaves = gathered, every
    order = sorted(range(leaves.numel()), key=lambda i: int(leaves[i]))
    if [int(leaves[i]) for i in order] != list(range(sources.total)):
        raise ValueError(f"expert gradient sources {sorted(leaves.tolist())} do not cover the "
                         f"{sources.total} data-parallel ranks once each")
    return on_root(tree_sum([local[i] for i in order]), sources.group)


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
        xs = x.reshape(-1, x.shape[-1])
        x2 = operand(xs) if sources is None else None
        outs = []
        for sl in column_blocks(weight.shape[0], nb, halves)[0]:
            w = operand(weight[sl]).t()
            out = (token_product(x2, w) if sources is None
                   else _by_source(lambda rows: token_product(operand(xs[rows]), w), sources, xs.shape[0]))
            if bias is not None:
                out = out + f32(bias[sl])
            outs.append(out.view(*x.shape[:-1], out.shape[-1]))
        return _owned(torch.cat(outs, dim=-1).to(out_dtype or x.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        sources = ctx.sources
        g2 = grad.reshape(-1, grad.shape[-1])
        partials = []
        layout, tree = column_blocks(weight.shape[0], ctx.nb, ctx.halves)
        if ctx.needs_input_grad[0]:
            partials = [_by_source(lambda rows, sl=sl: product(operand(g2[rows, sl]), operand(weight[sl])),
                                   sources, g2.shape[0]) for sl in tree]
        dgrad = wgrad = bgrad = None
        if partials:
            group = ctx.group if ctx.reduce_dgrad else None
            dgrad = invariant_sum(partials, group, x.dtype).view(x.shape)
            if ctx.dgrad_on_root:
                dgrad = on_root(dgrad, group)
        if ctx.needs_input_grad[1] and sources is not None:  # per source: the blocks' wgrads, then the sources' tree
            x2 = x.reshape(-1, x.shape[-1])
            wgrads = [[product(operand(g2[rows, sl]).t(), operand(x2[rows])) for rows in sources.segments()]
                      for sl in layout]
            wgrad = source_terms(ctx.params[0], [torch.cat(blocks, dim=0) for blocks in zip(*wgrads)], sources,
                              weight.dtype)
        elif ctx.needs_input_grad[1]:
            wgrad = by_sequence(ctx.params[0], sequences(x),
                                lambda i: _column_wgrad(sequence(x, i), sequence(grad, i), layout, weight.dtype),
                                lambda: _column_wgrad(x, grad, layout, weight.dtype))
        if ctx.has_bias:
            bgrad = by_sequence(ctx.params[1], sequences(grad),
                                lambda i: _column_bgrad(sequence(grad, i), layout, weight.dtype),
                                lambda: _column_bgrad(grad, layout, weight.dtype))
        return dgrad, wgrad, bgrad, None, None, None, None, None, None, None


def _column_wgrad(x: torch.Tensor, grad: torch.Tensor, layout, dtype) -> torch.Tensor:
    x2, g2 = operand(x.reshape(-1, x.shape[-1])), grad.reshape(-1, grad.shape[-1])
    return torch.cat([product(operand(g2[:, sl]).t(), x2) for sl in layout], dim=0).to(dtype)


def _column_bgrad(grad: torch.Tensor, layout, dtype) -> torch.Tensor:
    g2 = grad.reshape(-1, grad.shape[-1])
    return torch.cat([operand(g2[:, sl]).sum(dim=0, dtype=torch.float32) for sl in layout]).to(dtype)


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
        x2 = x.reshape(-1, x.shape[-1])
        partials = [_by_source(lambda rows, sl=sl: token_product(operand(x2[rows, sl]), operand(weight[:, sl]).t()),
                               sources, x2.shape[0]).view(*x.shape[:-1], weight.shape[0])
                    for sl in slices(weight.shape[1], nb)]
        out = _owned(invariant_sum(partials, group, x.dtype))
        return on_root(out, group) if on_root_only else out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        sources = ctx.sources
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad.reshape(-1, grad.shape[-1])
        g2 = operand(g2) if sources is None else g2
        dgrads, wgrads = [], []
        blocks = slices(weight.shape[1], ctx.nb)
        for sl in blocks:
            if ctx.needs_input_grad[0]:
                dgrads.append(product(g2, operand(weight[:, sl])) if sources is None else
                              _by_source(lambda rows: product(operand(g2[rows]), operand(weight[:, sl])),
                                         sources, g2.shape[0]))
            if ctx.needs_input_grad[1] and sources is not None:
                wgrads.append([product(operand(g2[rows]).t(), operand(x2[rows, sl])) for rows in sources.segments()])
        dgrad = torch.cat(dgrads, dim=-1).to(x.dtype).view(x.shape) if dgrads else None
        wgrad = None
        if wgrads:  # per source: the blocks' wgrads, then the sources' tree
            wgrad = source_terms(ctx.param, [torch.cat(blocks, dim=-1) for blocks in zip(*wgrads)], sources,
                              weight.dtype)
        elif ctx.needs_input_grad[1]:
            wgrad = by_sequence(ctx.param, sequences(x),
                                lambda i: _row_wgrad(sequence(x, i), sequence(grad, i), blocks, weight.dtype),
                                lambda: _row_wgrad(x, grad, blocks, weight.dtype))
        return dgrad, wgrad, None, None, None, None


def _row_wgrad(x: torch.Tensor, grad: torch.Tensor, blocks, dtype) -> torch.Tensor:
    x2, g2 = x.reshape(-1, x.shape[-1]), operand(grad.reshape(-1, grad.shape[-1]))
    return torch.cat([product(g2.t(), operand(x2[:, sl])) for sl in blocks], dim=-1).to(dtype)


def on_root(total: torch.Tensor, group) -> torch.Tensor:
    """``total`` (the same on every rank of ``group``) on the group's rank 0, zeros on the others:
    handed to a sum upstream then computes over ``group`` itself (a TP all-reduce or a token
    dispatcher's reduce-scatter), one value plus zeros is exact, so upstream's sum keeps the bits."""
    if group is not None and group.rank() != 0:
        return torch.zeros_like(total)
    return total


def _own_rows(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/t of ``x`` along dim 0 (the sequence), as a tensor of its own."""
    rows = x.shape[0] // group_size(group)
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
        t = group_size(group)
        out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=group)
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


def _token_tree(grad: torch.Tensor, factor: Optional[torch.Tensor], group, nb: int,
                split: bool, heads: bool = False) -> torch.Tensor:
    """sum over tokens of ``grad`` (times ``factor``) per feature, as ``nb`` blocks of consecutive
    sequence positions (rows of the [s, b, h] layout flattened to [s * b, h]) with FP32 sums, added
    in the fixed tree -- across ``group`` when ``split`` (sequence parallelism: this rank's tokens
    are W/t consecutive blocks). ``heads``: a QK norm's ``[s, b, n, d]``, summed over tokens and
    this rank's heads as ``_head_leaves`` blocks them, always across ``group`` (TP splits the
    heads). Across the group rank 0 returns the total and the others zeros: upstream all-reduces
    sequence-parallel and QK-norm gradients over TP (``finalize_model_grads``), and one value plus
    zeros is exact."""
    if heads:
        parts = _head_leaves(grad, factor, nb)
    else:
        g2 = grad.reshape(-1, grad.shape[-1])
        f2 = None if factor is None else factor.reshape(-1, factor.shape[-1])
        parts = [(f32(g2[sl]) if f2 is None else f32(g2[sl]) * f32(f2[sl])).sum(dim=0)
                 for sl in slices(g2.shape[0], nb)]
    return _token_sum(parts, group if split or heads else None)


def _token_sum(parts: Sequence[torch.Tensor], group) -> torch.Tensor:
    """The fixed-tree sum of token blocks' FP32 partials, across ``group`` (None: this rank's
    blocks only), kept on the group's rank 0 (``on_root``): upstream all-reduces such gradients
    over TP (``finalize_model_grads``)."""
    return on_root(invariant_sum(parts, group), group)


def _head_leaves(grad: torch.Tensor, factor: Optional[torch.Tensor], nb: int) -> List[torch.Tensor]:
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
        block = f32(g[:, heads]) if f is None else f32(g[:, heads]) * f32(f[:, heads])
        return block.reshape(-1, d).sum(dim=0)

    if n % nb == 0:
        per = n // nb
        return [leaf(slice(i * per, (i + 1) * per)) for i in range(nb)]
    if nb % n == 0:
        zero = torch.zeros(d, dtype=torch.float32, device=grad.device)
        return [part for h in range(n) for part in [leaf(slice(h, h + 1))] + [zero] * (nb // n - 1)]
    raise OptionError(
        f"megapatch tp_invariant: a QK norm over {n} heads per rank cannot be cut into "
        f"{WIDTH_OPTION}={width()} ({state.origin(WIDTH_OPTION)}) blocks: W must divide the model's head "
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
        out = normalised * weight.float()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        normalised, weight = ctx.saved_tensors
        dnormalised = grad.float() * weight.float() if ctx.needs_input_grad[0] else None
        def tree(param, factor):
            return by_sequence(
                param, sequences(grad),
                lambda i: _token_tree(sequence(grad, i), None if factor is None else sequence(factor, i),
                                      ctx.group, ctx.nb, ctx.split, ctx.heads).to(weight.dtype),
                lambda: _token_tree(grad, factor, ctx.group, ctx.nb, ctx.split, ctx.heads).to(weight.dtype))

        dweight = tree(ctx.params[0], normalised)
        dbias = tree(ctx.params[1], None) if ctx.has_bias else None
        return dnormalised, dweight, dbias, None, None, None, None, None


class TokenBlockedBias(torch.autograd.Function):
    """A row-parallel layer's bias expanded to the output's shape (the same values a broadcast add
    reads); its gradient, a sum over tokens, follows ``_token_tree``."""

    @staticmethod
    def forward(ctx, bias, shape, group, nb, split):
        ctx.group, ctx.nb, ctx.split, ctx.dtype, ctx.param = group, nb, split, bias.dtype, bias
        return bias.expand(shape).clone()

    @staticmethod
    def backward(ctx, grad):
        dbias = by_sequence(ctx.param, sequences(grad),
                            lambda i: _token_tree(sequence(grad, i), None, ctx.group, ctx.nb, ctx.split).to(ctx.dtype),
                            lambda: _token_tree(grad, None, ctx.group, ctx.nb, ctx.split).to(ctx.dtype))
        return dbias, None, None, None, None


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
        w = operand(weight)
        outs = []
        for sl in slices(x2.shape[0], nb):
            out = product(operand(x2[sl]), w.t())
            outs.append(out + f32(bias) if bias is not None else out)
        return torch.cat(outs).to(out_dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        blocks = slices(x2.shape[0], ctx.nb)
        group = ctx.group if ctx.split else None
        dgrad = wgrad = bgrad = None
        if ctx.needs_input_grad[0]:
            w = operand(weight)
            dgrad = torch.cat([product(operand(g2[sl]), w) for sl in blocks]).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            wgrad = _token_sum([product(operand(g2[sl]).t(), operand(x2[sl])) for sl in blocks],
                               group).to(weight.dtype)
        if ctx.has_bias:
            bgrad = _token_sum([f32(g2[sl]).sum(dim=0) for sl in blocks], group).to(weight.dtype)
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
            parts = [(f32(grad[..., sl]) * f32(x[..., sl])).sum(dim=-1) for sl in slices(x.shape[-1], ctx.nb)]
            dscale = _token_sum(parts, ctx.group).to(scale.dtype)
        return dx, dscale, None, None


def sum_exp_partials(exp_logits: torch.Tensor, nb: int) -> List[torch.Tensor]:
    """Per-block FP32 sums over the vocab shard's last dim (W/t blocks of V/W)."""
    e2 = exp_logits.reshape(-1, exp_logits.shape[-1])
    return [f32(e2[:, sl]).sum(dim=-1) for sl in slices(e2.shape[-1], nb)]


def squared_norms(grads: Sequence[torch.Tensor], partition_dims: Sequence[Optional[int]],
                  group, halves: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Sum of squares of each (possibly TP-sharded) gradient, the same at every TP size, as one
    FP32 vector.

    Sharded (partition dim given): W blocks along the partition dim, one fixed tree across the
    group (one all-gather for all of them). ``halves[i] == 2``: a gated fc1's gradient, rank r
    holding [gate_r; up_r] along the partition dim -- each half cut into W blocks and gate block k
    paired with up block k at the leaves, as ``column_blocks`` orders them (blocks cut across the
    local rows would mix gate and up differently at each TP size). Replicated (``None``): one FP32
    sum of the whole tensor, computed alike by every rank."""
    nb = blocks_per_rank(group)
    totals = torch.zeros(len(grads), dtype=torch.float32)
    blocks = []  # per sharded gradient: its W/t block sums
    sharded = []
    for i, (grad, dim) in enumerate(zip(grads, partition_dims)):
        if dim is None:
            g = f32(grad)
            totals[i] = (g * g).sum().cpu()
            continue
        split = halves[i] if halves else 1
        rows = grad.shape[dim] // split
        size = check_divisible(f"a gradient of shape {tuple(grad.shape)} (partition dim {dim}"
                               + (", each of gate and up)" if split == 2 else ")"),
                               rows * group_size(group), rows, group)
        sums = []
        for b in range(nb):
            leaves = [f32(grad.narrow(dim, h * rows + b * size, size)) for h in range(split)]
            sums.append(tree_sum([(g * g).sum() for g in leaves]).cpu())
        blocks.append(torch.stack(sums))
        sharded.append(i)
    if sharded:
        per_block = torch.stack(blocks, dim=1)  # [W/t, sharded gradients]
        totals[sharded] = invariant_sum(list(per_block.unbind(0)), group)
    return totals
