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

This module is the tree and its block shapes; beside it: ``block_linear`` (the column- and
row-parallel linear Functions), ``token_tree`` (sums over tokens: norms, biases, the router's
gating GEMM, an expert's routing scale) and ``gradient_terms`` (a weight gradient's terms per
sequence and per source rank, for the exact data-parallel sum).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch.distributed import distributed_c10d as c10d

from megapatch.core import state
from megapatch.core.errors import OptionError
from megapatch.numerics.block_shapes import WIDTH_OPTION, valid_widths, width  # noqa: F401 (used as tpi.*)


def active() -> bool:
    return bool(getattr(state.current(), "tp_invariant", False))


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
        all_gather_single(gathered, flat.contiguous(), group=group)
        return tree_sum([part.view_as(root) for part in gathered.view(t, -1).unbind(0)])
    pad = (-flat.numel()) % t
    send = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.contiguous()
    recv = torch.empty_like(send)
    c10d.all_to_all_single(recv, send, group=group)  # row i: peer i's roots for my slice
    mine = tree_sum(recv.view(t, -1).unbind(0)).to(out_dtype)
    if pad == 0:  # gathered straight into a tensor of the result's shape (not a view)
        out = torch.empty(root.shape, dtype=out_dtype, device=root.device)
        all_gather_single(out.view(-1), mine, group=group)
        return out
    out = torch.empty(t * mine.numel(), dtype=out_dtype, device=root.device)
    all_gather_single(out, mine, group=group)
    return out[: flat.numel()].view_as(root)


# torch >= 2.13 names it all_gather_single (and deprecates the old name)
all_gather_single = getattr(c10d, "all_gather_single", None) or c10d.all_gather_into_tensor


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


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy if it is a view: megatron's cross entropy modifies FP32 logits in place,
    which autograd forbids on a view returned by a custom Function."""
    return t if t._base is None else t.clone()


def on_root(total: torch.Tensor, group) -> torch.Tensor:
    """``total`` (the same on every rank of ``group``) on the group's rank 0, zeros on the others:
    handed to a sum upstream then computes over ``group`` itself (a TP all-reduce or a token
    dispatcher's reduce-scatter), one value plus zeros is exact, so upstream's sum keeps the bits."""
    if group is not None and group.rank() != 0:
        return torch.zeros_like(total)
    return total


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
