"""Core attention whose every query row has the same bits at any query count and key length, in
memory that grows with S x block, not S x S.

A rollout's decode step attends one query per request over the request's keys so far; the trainer
attends a whole sequence's queries over all its keys at once. Upstream's arithmetic -- BF16
``baddbmm``/``bmm`` on the shapes at hand -- lets the GEMM library choose its blocking by shape, and on
CPU a row's BF16 result then differs now and then between the two (a few rows in a thousand, seen
in ``train_rl.py`` as a train-vs-rollout log-prob mismatch of 3e-6). Here every product runs in FP32 on
fixed shapes and is rounded as upstream rounds it:

* keys (and values) are zero-padded to a multiple of :data:`KEY_BLOCK` and cut into blocks of that
  many, always in the same order; query rows are taken :data:`QUERY_BLOCK` at a time (each chunk
  padded to ``block_tree.MIN_TOKEN_ROWS`` rows on CPU: CPU GEMMs give a row the same bits from 12 rows
  on). One chunk's scores over all key blocks, ``[chunk rows, keys]``, are all that is ever held;
* scores: one FP32 GEMM per (chunk, key block), ``[rows, d] x [d, KEY_BLOCK]``, scaled and rounded to
  the activation dtype (upstream's BF16 ``baddbmm``); masked keys at upstream's -10000 (a row that sees
  no key averages the values, as upstream's does), padding keys at -inf;
* pass 1, the row max over all keys (exact in any order); pass 2, ``p = exp(s - max)`` in FP32 and the
  row sum ``l`` as one fixed pairwise tree over the padded keys -- adjacent pairs within a block, then
  adjacent blocks, level by level (:func:`tree_sum`), so blocks of exact zeros past a decode step's
  last key change nothing; pass 3, the probabilities ``p / l`` rounded to the activation dtype (as
  upstream's ``FusedScaleMaskSoftmax`` rounds them), one FP32 GEMM per key block ``[rows, KEY_BLOCK] x
  [KEY_BLOCK, d]``, the blocks' products added in the same pairwise tree, rounded once.

The visibility (causal from positions, or an explicit mask) is formed one query chunk at a time,
never as an S x S tensor. Per (sequence, head) and per row, so the TP size (heads per rank), the
micro-batch size and the batching of requests do not move a bit either. Under autograd each query
chunk is checkpointed (``torch.utils.checkpoint``): backward recomputes the chunk, so training holds
one chunk's intermediates at a time too -- the price is one more forward of the attention. FLOPs: the
scores and PV GEMMs once each, 4 x S x L x d a head (rows padded to 16 on CPU for chunks under 16 rows,
keys to a multiple of 64); causal without a mask, a chunk leaves out the key blocks past its last row's
keys -- all masked, they would add exact zeros -- which about halves that. Why a pairwise tree and not
a running sum over the blocks: the same invariance (trailing zeros are exact either way) in log2(blocks)
tensor ops instead of one per block, and the mode's other sums take the same tree.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from megapatch.numerics.block_tree import MIN_TOKEN_ROWS

__all__ = ["KEY_BLOCK", "QUERY_BLOCK", "causal_visible", "row_invariant_attention", "tree_sum",
           "paged_rows", "repeat_groups", "by_request", "kv_lengths"]

#: keys are cut into blocks of this many (the last zero-padded and masked), so a decode step over 55
#: keys and a training sequence of 300 reduce each block on the same shape, in the same order
KEY_BLOCK = 64
#: query rows taken at a time: one chunk's scores over all keys, [QUERY_BLOCK, keys] a head, are the
#: largest thing held (a constant: the chunking, hence a gradient's sum order, does not depend on the
#: heads a TP rank holds or the micro-batch size)
QUERY_BLOCK = 128


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def causal_visible(queries: int, keys: int, device=None) -> torch.Tensor:
    """[queries, keys]: True where a query sees a key; the queries are the last ``queries`` positions
    of a sequence of ``keys`` (end-aligned, as flash-attn's causal mask and a prefill chunk are)."""
    rows = torch.arange(queries, device=device).unsqueeze(1) + (keys - queries)
    return torch.arange(keys, device=device).unsqueeze(0) <= rows


def tree_sum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over ``dim`` as a fixed pairwise tree: adjacent pairs, level by level, an odd last term
    carried up unchanged (the tree over the count padded with zeros to a power of two: a trailing run
    of exact zeros, however long, leaves the sum's bits alone). Elementwise adds only: each output's
    bits depend on its own terms, not on the tensor's shape."""
    while t.shape[dim] > 1:
        n = t.shape[dim]
        pairs = t.narrow(dim, 0, n - n % 2)
        halves = pairs.unflatten(dim, (n // 2, 2))
        summed = halves.select(dim + 1 if dim >= 0 else dim, 0) + halves.select(dim + 1 if dim >= 0 else dim, 1)
        t = torch.cat([summed, t.narrow(dim, n - 1, 1)], dim=dim) if n % 2 else summed
    return t.squeeze(dim)


def _chunk(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, hidden: Optional[torch.Tensor],
           scale: float, keys: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """One chunk of query rows: ``q`` [*, R, d] FP32 (R >= rows, zero rows past ``rows``), ``kb``/``vb``
    [*, n, KEY_BLOCK, d] FP32 key blocks, ``hidden`` [*|1, n, rows, KEY_BLOCK] True where masked (or
    None), ``dtype`` the activation dtype. Returns [*, rows, d] FP32: the products' tree sum, not
    yet rounded."""
    blocks = kb.shape[-3]
    # scores, one [R, d] x [d, KEY_BLOCK] GEMM per key block: [*, n, rows, KEY_BLOCK]
    scores = torch.matmul(q.unsqueeze(-3), kb.transpose(-1, -2))[..., :rows, :]
    scores = (scores * scale).to(dtype).float()
    if hidden is not None:
        scores = scores.masked_fill(hidden, -10000.0)
    tail = keys - (blocks - 1) * KEY_BLOCK
    if tail < KEY_BLOCK:  # the padding keys: exact zeros after exp
        pad = torch.zeros(KEY_BLOCK, dtype=torch.bool, device=scores.device)
        pad[tail:] = True
        last = torch.zeros(blocks, 1, 1, dtype=torch.bool, device=scores.device)
        last[-1] = True
        scores = scores.masked_fill(last & pad, float("-inf"))
    top = scores.amax(dim=(-3, -1), keepdim=True)  # pass 1: [*, 1, rows, 1], exact
    p = torch.exp(scores - top)  # pass 2
    total = tree_sum(tree_sum(p, -1), -2).unsqueeze(-2).unsqueeze(-1)  # within blocks, then across
    probs = (p / total).to(dtype).float()  # pass 3: rounded as upstream's softmax rounds them
    probs = _pad(probs, -2, q.shape[-2])
    products = torch.matmul(probs, vb)[..., :rows, :]  # [*, n, rows, d], one GEMM per key block
    return tree_sum(products, -3)


def row_invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                            causal: bool = False, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q kᵀ x scale, over the visible keys) v for ``q`` [*, M, d], ``k``/``v`` [*, L, d] (each
    head its own keys: repeat grouped keys first); ``causal``: query i (of the sequence's last M
    positions) sees keys 0..i + L - M; ``hidden``: a bool tensor broadcastable to [*, M, L], True where
    masked (upstream's mask; read a query chunk at a time). Returns [*, M, d] in ``q``'s dtype; scores
    and probabilities rounded to it as upstream rounds them (module doc)."""
    rows, keys, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    lead = q.shape[:-2]
    blocks = -(-keys // KEY_BLOCK)
    kb = _pad(k.float(), -2, blocks * KEY_BLOCK).unflatten(-2, (blocks, KEY_BLOCK))
    vb = _pad(v.float(), -2, blocks * KEY_BLOCK).unflatten(-2, (blocks, KEY_BLOCK))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs = []
    for first in range(0, rows, QUERY_BLOCK):
        count = min(QUERY_BLOCK, rows - first)
        qc = q[..., first:first + count, :].float()
        if q.device.type == "cpu":
            qc = _pad(qc, -2, max(count, MIN_TOKEN_ROWS))
        # causal, no mask: the key blocks past the chunk's last visible key are all masked, exact zeros
        # in both sums (as past a decode step's last key): left out, the same bits at half the work
        used = blocks
        if causal and hidden is None:
            used = min(blocks, (first + count - 1 + keys - rows) // KEY_BLOCK + 1)
        seen = min(keys, used * KEY_BLOCK)
        masked = None
        if causal:
            ends = torch.arange(first, first + count, device=q.device).unsqueeze(1) + (keys - rows)
            masked = torch.arange(seen, device=q.device).unsqueeze(0) > ends  # as causal_visible: end-aligned
        if hidden is not None:
            part = hidden[..., first:first + count, :] if hidden.shape[-2] != 1 else hidden
            part = part.expand(*part.shape[:-2], count, keys)
            masked = part if masked is None else (part | masked)
        if masked is not None:  # [*|1, count, L] -> [*|1, n, count, KEY_BLOCK]
            masked = _pad(masked, -1, used * KEY_BLOCK).unflatten(-1, (used, KEY_BLOCK)).transpose(-3, -2)
        kc, vc = kb[..., :used, :, :], vb[..., :used, :, :]
        if grad:
            out = checkpoint(_chunk, qc, kc, vc, masked, scale, seen, count, q.dtype, use_reentrant=False,
                             preserve_rng_state=False)
        else:
            out = _chunk(qc, kc, vc, masked, scale, seen, count, q.dtype)
        outs.append(out.to(q.dtype))
    if not outs:
        return q.new_zeros(*lead, 0, dim)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def paged_rows(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` positions of one request's paged KV cache ([blocks, block size, heads,
    dim] read through its block-table row): [length, heads, dim]."""
    return cache[blocks.long()].flatten(0, 1)[:length]


def repeat_groups(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Grouped keys/values repeated to one per query head along ``dim`` (upstream's ``repeat_interleave``)."""
    return t.repeat_interleave(heads // t.shape[dim], dim=dim) if t.shape[dim] != heads else t


def kv_lengths(cu_seqlens_k: torch.Tensor) -> list:
    """Each request's key count from flash-attn's cumulative key lengths."""
    bounds = cu_seqlens_k.tolist()
    return [end - start for start, end in zip(bounds, bounds[1:])]


def by_request(attend, q: torch.Tensor, q_bounds, kv_counts, table: torch.Tensor) -> torch.Tensor:
    """A paged attention call taken request by request: ``q`` [tokens, heads, dim] holds the requests'
    queries one after another (request i: rows ``q_bounds[i]:q_bounds[i + 1]``), each request's rows go
    through ``attend(rows, its key count, its block-table row)``; rows of no request (padding) and
    requests without keys stay zero."""
    out = torch.zeros_like(q)
    for i, keys in enumerate(kv_counts):
        start, end = q_bounds[i], q_bounds[i + 1]
        if end > start and keys > 0:
            out[start:end] = attend(q[start:end], keys, table[i])
    return out
