"""Core attention whose every query row has the same bits at any query count and key length.

A rollout's decode step attends one query per request over the request's keys so far; the trainer
attends a whole sequence's queries over all its keys at once. Upstream's arithmetic -- BF16
``baddbmm``/``bmm`` on the shapes at hand -- lets the GEMM library choose its blocking by shape, and on
CPU a row's BF16 result then differs now and then between the two (a few rows in a thousand, seen
in ``train_rl.py`` as a train-vs-rollout log-prob mismatch of 3e-6). Here both products run in FP32
on fixed shapes and are rounded once, as upstream rounds them: keys (and values) are zero-padded to a
multiple of :data:`KEY_BLOCK`, masked to ``-inf`` past the visible ones, and query rows are padded to
``block_tree.MIN_TOKEN_ROWS`` (CPU GEMMs give a row the same bits from 12 rows on). The softmax runs
in FP32 over the padded row and its probabilities are rounded to the query dtype, as upstream's
``FusedScaleMaskSoftmax`` rounds them. Per (sequence, head) and per row, so the TP size (heads per
rank), the micro-batch size and the batching of requests do not move a bit either.
"""

from __future__ import annotations

import torch

from megapatch.numerics.block_tree import MIN_TOKEN_ROWS

__all__ = ["KEY_BLOCK", "causal_visible", "row_invariant_attention", "paged_rows", "repeat_groups",
           "by_request", "kv_lengths"]

#: keys are padded to a multiple of this, so a decode step over 55 keys and a training sequence of
#: 64 reduce over the same 64 terms in the same order
KEY_BLOCK = 64


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


def row_invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            visible: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ x scale, over visible keys) v for ``q`` [B, M, d], ``k``/``v`` [B, L, d] (B: sequences
    x heads, each head its own keys: repeat grouped keys first) and ``visible`` [B or 1, M, L]; returns
    [B, M, d] in ``q``'s dtype. Scores and probabilities are rounded to ``q``'s dtype as upstream's
    BF16 ``baddbmm`` and softmax round them; the products are FP32 on padded shapes (module doc)."""
    rows, keys = q.shape[1], k.shape[1]
    padded_keys = -(-keys // KEY_BLOCK) * KEY_BLOCK
    padded_rows = max(rows, MIN_TOKEN_ROWS) if q.device.type == "cpu" else rows
    qf = _pad(q.float(), 1, padded_rows)
    kf = _pad(k.float(), 1, padded_keys)
    vf = _pad(v.float(), 1, padded_keys)
    scores = (torch.bmm(qf, kf.transpose(1, 2))[:, :rows, :keys] * scale).to(q.dtype)
    # masked keys as upstream's attention_mask_func masks them (a row that sees nothing averages
    # them, as upstream's does), the padding keys at -inf: exp gives an exact 0 for both
    scores = scores.float().masked_fill(~visible, -10000.0)
    scores = torch.cat([scores, scores.new_full((*scores.shape[:2], padded_keys - keys), float("-inf"))], dim=2)
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.bmm(_pad(probs.float(), 1, padded_rows), vf)[:, :rows].to(q.dtype)


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
