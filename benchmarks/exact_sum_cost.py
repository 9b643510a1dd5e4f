"""What tp_invariant's exact data-parallel sum costs against upstream's FP32 path, per gradient
bucket: the per-micro-batch deposit (``Accumulator.add`` vs ``main_grad.add_``) and the reduction
over the data-parallel ranks (``Accumulator.total``: MAX, int64 reduce-scatter (+ FP32 all-gather), vs one
FP32 all-reduce / reduce-scatter), measured in one run on gloo CPU ranks; the bytes each sends per
element, computed from the collectives' sizes.

    python benchmarks/exact_sum_cost.py [--numel 4000000] [--dp 3] [--microbatches 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import torch


def _timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _job(ctx, numel: int, microbatches: int, repeat: int):
    from megapatch.numerics import exact_sum

    group = torch.distributed.group.WORLD
    size = ctx.world_size
    numel -= numel % size
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(ctx.rank * 100 + m)).bfloat16()
             for m in range(microbatches)]
    main = torch.zeros(numel)
    acc = exact_sum.Accumulator(numel)

    def upstream_add():
        main.zero_()
        for g in grads:
            main.add_(g)

    def exact_add():
        acc.reset()
        for g in grads:
            acc.add(0, g)

    shard = torch.empty(numel // size)
    out = {
        "deposit upstream (main_grad.add_)": _timed(upstream_add, repeat) / microbatches,
        "deposit exact (Accumulator.add)": _timed(exact_add, repeat) / microbatches,
        "all-reduce upstream (FP32)": _timed(lambda: torch.distributed.all_reduce(main.clone(), group=group), repeat),
        "all-reduce exact (MAX int8, int64 reduce-scatter, FP32 all-gather)": _timed(
            lambda: acc.total(group), repeat),
        "reduce-scatter upstream (FP32)": _timed(
            lambda: torch.distributed.reduce_scatter_tensor(shard, main.clone(), group=group), repeat),
        "reduce-scatter exact (MAX int8 all-reduce + int64 reduce-scatter)": _timed(
            lambda: acc.total(group, shard=(ctx.rank, size)), repeat),
    }
    return out if ctx.rank == 0 else None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--dp", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    from megapatch.testing import run_ranks

    times = run_ranks(_job, world_size=args.dp, init_megatron=False, timeout=1800,
                      args=(args.numel, args.microbatches, args.repeat))[0]
    print(f"{args.numel} elements, DP {args.dp}, {args.microbatches} micro-batches (gloo, CPU; best of {args.repeat})")
    print("| step | seconds | exact / upstream |")
    print("|---|---|---|")
    pairs = [("deposit", 0, 1), ("all-reduce", 2, 3), ("reduce-scatter", 4, 5)]
    names = list(times)
    for _, up, ex in pairs:
        for i in (up, ex):
            ratio = f"{times[names[ex]] / times[names[up]]:.2f}x" if i == ex else ""
            print(f"| {names[i]} | {times[names[i]]:.4f} | {ratio} |")
    print("bytes per element on the wire (per rank, ring algorithms, DP = d): FP32 all-reduce 2(d-1)/d x 4, "
          "exact 2(d-1)/d x 1 + (d-1)/d x (8 + 4) = 1.75x; FP32 reduce-scatter (d-1)/d x 4, exact "
          "2(d-1)/d x 1 + (d-1)/d x 8 = 2.5x")


if __name__ == "__main__":
    main()
