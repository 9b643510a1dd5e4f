"""Cost of ``tp_invariant=True`` relative to native and to ``tp_reduce_dtype="fp32"``, on CPU.

    python benchmarks/tp_invariant_cost.py [--tp 1,2,4] [--reps 6]

A GPT (2 layers, hidden 256, 8 heads, FFN 1024, vocab 1024, BF16; 4 x 64 tokens) trains with
megatron-core's BF16 optimizer (AdamW, clipping on) on ``max(tp)`` gloo ranks; at each TP size the
three modes run interleaved, one full step each (forward, backward, optimizer step), repeated; the
first round warms up. Reported per TP size: each mode's median step time divided by native's, and
the peak resident memory a step adds above the rank's resident memory before it (sampled every
0.5 ms by a thread reading /proc/self/statm; median over steps), divided by native's. At TP sizes
below the rank count the other ranks are data-parallel replicas doing the same work on the same
2 cores, so absolute times are noise; the ratios within one TP size are what this reports.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

MODES = ("native", "fp32", "tp-invariant")
SHAPE = dict(hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024)
VOCAB, SEQ, BATCH = 1024, 64, 4


def _options(mode):
    return {"tp_invariant": True} if mode == "tp-invariant" else {"tp_reduce_dtype": mode}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """Peak resident memory while the block runs, sampled by a thread."""

    def __enter__(self):
        self.base = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def added(self) -> int:
        return self.peak - self.base


def _job(ctx, tps, reps):
    import megapatch
    from megapatch.testing import build_tiny_gpt, make_batch, reinit_model_parallel, tiny_gpt_config
    from megapatch.testing.tiny_gpt import build_bf16_optimizer, cuda_type_names

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
        memory = {m: [] for m in MODES}
        for i in range(reps + 1):
            for mode in MODES:
                model, optimizer = runs[mode]
                megapatch.enable(**_options(mode))
                torch.distributed.barrier()
                with _PeakRss() as rss:
                    start = time.perf_counter()
                    optimizer.zero_grad()
                    loss = model(batch.tokens, batch.position_ids, batch.attention_mask,
                                 labels=batch.labels)
                    loss.float().mean().backward()
                    with cuda_type_names():
                        optimizer.step()
                    elapsed = time.perf_counter() - start
                megapatch.disable()
                if i:
                    times[mode].append(elapsed)
                    memory[mode].append(rss.added)
        results[tp] = {m: (statistics.median(times[m]), statistics.median(memory[m])) for m in MODES}
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
