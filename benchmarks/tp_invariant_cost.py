"""Cost of ``tp_invariant=True`` relative to native and to ``tp_reduce_dtype="fp32"``, on CPU.

    python benchmarks/tp_invariant_cost.py [--tp 1,2,4] [--reps 6]

A GPT (2 layers, hidden 256, 8 heads, FFN 1024, vocab 1024, BF16; 4 x 64 tokens) trains with
megatron-core's BF16 optimizer (AdamW, clipping on) on ``max(tp)`` gloo ranks; at each TP size the
three modes run interleaved, one full step each (forward, backward, optimizer step), repeated; the
first round warms up. Reported per TP size: each mode's median step time divided by native's, and
the peak heap memory one more step adds above what was in use before it (glibc ``mallinfo2``
read after every aten op of the step by a dispatch mode: activations, gradients, FP32 block
copies, collective buffers), divided by native's. At TP sizes
below the rank count the other ranks are data-parallel replicas doing the same work on the same
2 cores, so absolute times are noise; the ratios within one TP size are what this reports.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODES = ("native", "fp32", "tp-invariant")
SHAPE = dict(hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024)
VOCAB, SEQ, BATCH = 1024, 64, 4


def _options(mode):
    return {"tp_invariant": True} if mode == "tp-invariant" else {"tp_reduce_dtype": mode}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = ctypes.CDLL(None)
_libc.mallinfo2.restype = _Mallinfo2


def _heap_in_use() -> int:
    """Bytes glibc malloc has handed out and not taken back (torch's CPU tensors, gloo buffers)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class _PeakHeap(TorchDispatchMode):
    """The most heap in use after any op while the block runs, above what was in use before."""

    def __enter__(self):
        self.base = self.peak = _heap_in_use()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _heap_in_use())
        return out

    @property
    def added(self) -> int:
        return self.peak - self.base


def _step(model, optimizer, batch):
    from megapatch.testing.tiny_gpt import cuda_type_names

    optimizer.zero_grad()
    loss = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
    loss.float().mean().backward()
    with cuda_type_names():
        optimizer.step()


def _job(ctx, tps, reps):
    import megapatch
    from megapatch.testing import build_tiny_gpt, make_batch, reinit_model_parallel, tiny_gpt_config
    from megapatch.testing.tiny_gpt import build_bf16_optimizer

    batch = make_batch(seed=5, batch=BATCH, seq_len=SEQ, vocab=VOCAB)
    results = {}
    for tp in tps:
        ctx = reinit_model_parallel(ctx, tp=tp)
        runs = {}
        for mode in MODES:
            megapatch.enable(**_options(mode))
            model = build_tiny_gpt(tiny_gpt_config(tp=tp, **SHAPE), vocab_size=VOCAB, seq_len=SEQ)
            runs[mode] = (model, build_bf16_optimizer(model, clip_grad=1.0))
            megapatch.disable()
        times = {m: [] for m in MODES}
        for i in range(reps + 1):
            for mode in MODES:
                megapatch.enable(**_options(mode))
                torch.distributed.barrier()
                start = time.perf_counter()
                _step(*runs[mode], batch)
                elapsed = time.perf_counter() - start
                megapatch.disable()
                if i:  # the first round warms up
                    times[mode].append(elapsed)
        memory = {}
        for mode in MODES:  # one more step per mode, under the heap tracker
            megapatch.enable(**_options(mode))
            torch.distributed.barrier()
            with _PeakHeap() as heap:
                _step(*runs[mode], batch)
            megapatch.disable()
            memory[mode] = heap.added
        results[tp] = {m: (statistics.median(times[m]), memory[m]) for m in MODES}
    return results if ctx.rank == 0 else None


def main(argv=None):
    from megapatch.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args(argv)
    tps = [int(t) for t in args.tp.split(",")]
    results = run_ranks(_job, world_size=max(tps), args=(tps, args.reps), timeout=3600)[0]
    print(f"GPT 2 layers, hidden {SHAPE['hidden_size']}, FFN {SHAPE['ffn_hidden_size']}, vocab {VOCAB}, "
          f"{BATCH}x{SEQ} tokens, BF16; one training step (forward, backward, clipped AdamW), median "
          f"of {args.reps}, {max(tps)} CPU ranks:\n")
    print("| TP | step time native | fp32 / native | tp-invariant / native | tp-invariant / fp32 | "
          "step memory native | fp32 / native | tp-invariant / native |")
    print("|---|---|---|---|---|---|---|---|")
    for tp, r in results.items():
        (tn, mn), (tf, mf), (ti, mi) = r["native"], r["fp32"], r["tp-invariant"]
        ratio = lambda a, b: f"{a / b:.2f}" if b > 0 else "n/a"
        print(f"| {tp} | {tn * 1e3:.0f} ms | {tf / tn:.2f} | {ti / tn:.2f} | {ti / tf:.2f} | "
              f"{mn / 2 ** 20:.1f} MiB | {ratio(mf, mn)} | {ratio(mi, mn)} |")


if __name__ == "__main__":
    main()
