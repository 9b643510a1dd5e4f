"""Peak memory and time per call of the mode's blocked core attention
(``megapatch.numerics.attention.row_invariant_attention``) against the full-matrix version it replaced
(issue 49; kept here, not in the runtime package). Causal self-attention, one sequence, BF16 inputs,
forward only (no autograd), on this machine's CPU.

    python tools/bench_attention_blocks.py [--heads 8] [--dim 64] [--full-up-to 4096] 1024 4096

Peak memory: the most bytes of tensor storage allocated inside the call and alive at once (counted
by a ``TorchDispatchMode``, inputs excluded); time: the best of ``--repeats`` calls without the meter.
"""

from __future__ import annotations

import argparse
import time

import torch

from megapatch.numerics.attention import KEY_BLOCK, row_invariant_attention
from megapatch.numerics.block_tree import MIN_TOKEN_ROWS
from megapatch.testing.memory import LiveBytes


def _pad(t, dim, size):
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def full_matrix_attention(q, k, v, scale, visible):
    """The version before issue 49: the whole [B, S, S] score matrix and a [B|1, S, S] ``visible`` mask."""
    rows, keys = q.shape[1], k.shape[1]
    padded_keys = -(-keys // KEY_BLOCK) * KEY_BLOCK
    padded_rows = max(rows, MIN_TOKEN_ROWS) if q.device.type == "cpu" else rows
    qf, kf, vf = _pad(q.float(), 1, padded_rows), _pad(k.float(), 1, padded_keys), _pad(v.float(), 1, padded_keys)
    scores = (torch.bmm(qf, kf.transpose(1, 2))[:, :rows, :keys] * scale).to(q.dtype)
    scores = scores.float().masked_fill(~visible, -10000.0)
    scores = torch.cat([scores, scores.new_full((*scores.shape[:2], padded_keys - keys), float("-inf"))], dim=2)
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.bmm(_pad(probs.float(), 1, padded_rows), vf)[:, :rows].to(q.dtype)


def _calls(seq, heads, dim):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(heads, seq, dim, generator=gen).bfloat16() for _ in range(3))
    scale = dim ** -0.5

    def full():
        visible = torch.ones(seq, seq, dtype=torch.bool).tril().unsqueeze(0)
        return full_matrix_attention(q, k, v, scale, visible)

    def blocked():
        return row_invariant_attention(q, k, v, scale, causal=True)

    return {"full matrix": full, "blocked": blocked}


def measure(fn, repeats):
    meter = LiveBytes()
    with torch.no_grad(), meter:
        out = fn()
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return meter.peak, best, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seq", type=int, nargs="+")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--full-up-to", type=int, default=4096, help="longest S the full-matrix version runs at")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"heads {args.heads}, dim {args.dim}, BF16, causal")
    print("| S | version | peak memory (MiB) | time per call (s) | max abs diff vs full matrix |")
    print("|---|---|---|---|---|")
    for seq in args.seq:
        outs = {}
        for name, fn in _calls(seq, args.heads, args.dim).items():
            if name == "full matrix" and seq > args.full_up_to:
                print(f"| {seq} | {name} | (not run: > --full-up-to) | | |")
                continue
            peak, best, outs[name] = measure(fn, args.repeats)
            diff = ""
            if name == "blocked" and "full matrix" in outs:
                diff = f"{(outs[name].float() - outs['full matrix'].float()).abs().max().item():.2g}"
            print(f"| {seq} | {name} | {peak / 2 ** 20:.1f} | {best:.3f} | {diff} |", flush=True)


if __name__ == "__main__":
    main()
