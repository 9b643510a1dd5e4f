"""Cost of megapatch's TP reductions relative to native, measured side by side in one run.

    python benchmarks/reduce_cost.py [--sizes-kib 64,256,1024,4096,16384,65536] [--tp 2,4]

For each TP size and message size (BF16 bytes), the three modes run interleaved (native, fp32,
fp32-accumulate, repeated), on CPU gloo ranks; the table shows each mode's median time divided
by native's median. The wire-byte bounds are 2.0x (fp32) and 1.0x (fp32-accumulate); on CPU,
gloo's reduction arithmetic and the casts also count. Then the forward+backward step time of the
tiny GPT at TP=2, same method. Absolute times on shared 2-core machines are noise; ratios from
interleaved runs are what this reports.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

MODES = ("native", "fp32", "fp32-accumulate")


def _time_collectives(ctx, sizes_kib, tps, reps):
    import megapatch
    from megatron.core.tensor_parallel import mappings
    from megapatch.testing import reinit_model_parallel

    results = {}
    for tp in tps:
        ctx = reinit_model_parallel(ctx, tp=tp)
        for kib in sizes_kib:
            numel = kib * 1024 // 2
            base = torch.randn(numel).to(torch.bfloat16)
            samples = {m: [] for m in MODES}
            n = max(3, min(reps, int(reps * 1024 / kib) or 3))
            for _ in range(n):
                for mode in MODES:
                    megapatch.enable(tp_reduce_dtype=mode)
                    x = base.clone()
                    torch.distributed.barrier(group=ctx.tp_group)
                    start = time.perf_counter()
                    mappings._reduce(x, ctx.tp_group)
                    samples[mode].append(time.perf_counter() - start)
            megapatch.disable()
            results[(tp, kib)] = {m: statistics.median(v) for m, v in samples.items()}
    return results if ctx.rank == 0 else None


def _time_steps(ctx, reps):
    import megapatch
    from megapatch.testing import build_tiny_gpt, make_batch, tiny_gpt_config

    batch = make_batch(seed=5, batch=4, seq_len=64, vocab=1024)
    samples = {m: [] for m in MODES}
    models = {}
    for mode in MODES:
        models[mode] = build_tiny_gpt(tiny_gpt_config(tp=ctx.tp_size, hidden_size=256, ffn_hidden_size=1024),
                                      vocab_size=1024, seq_len=64)
    for i in range(reps + 1):
        for mode in MODES:
            megapatch.enable(tp_reduce_dtype=mode)
            torch.distributed.barrier()
            start = time.perf_counter()
            logits = models[mode](batch.tokens, batch.position_ids, batch.attention_mask)
            logits.float().sum().backward()
            if i:  # the first round warms up
                samples[mode].append(time.perf_counter() - start)
    megapatch.disable()
    return {m: statistics.median(v) for m, v in samples.items()} if ctx.rank == 0 else None


def main(argv=None):
    from megapatch.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-kib", default="64,256,1024,4096,16384,65536")
    parser.add_argument("--tp", default="2,4")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--step-reps", type=int, default=8)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    tps = [int(t) for t in args.tp.split(",")]
    coll = run_ranks(_time_collectives, world_size=max(tps), args=(sizes, tps, args.reps), timeout=1800)[0]
    print("TP all-reduce (megatron-core mappings._reduce), median time relative to native:\n")
    print("| TP | message (BF16) | native | fp32 | fp32-accumulate |")
    print("|---|---|---|---|---|")
    for (tp, kib), t in coll.items():
        size = f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"
        print(f"| {tp} | {size} | 1.00 ({t['native'] * 1e3:.2f} ms) | {t['fp32'] / t['native']:.2f} | "
              f"{t['fp32-accumulate'] / t['native']:.2f} |")
    steps = run_ranks(_time_steps, world_size=2, tp=2, args=(args.step_reps,), timeout=1800)[0]
    print("\nTiny GPT (hidden 256, ffn 1024, vocab 1024, 4x64 tokens) forward+backward at TP=2, median:\n")
    print("| native | fp32 | fp32-accumulate |")
    print("|---|---|---|")
    print(f"| 1.00 ({steps['native'] * 1e3:.1f} ms) | {steps['fp32'] / steps['native']:.2f} | "
          f"{steps['fp32-accumulate'] / steps['native']:.2f} |")


if __name__ == "__main__":
    main()
