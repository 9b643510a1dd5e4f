"""What a multi-rank test pays to start its ranks (issue 27 item 1): spawned interpreters, the rank
server (two preload profiles), and a pool of long-lived rank workers, measured in one run.

    python benchmarks/rank_start.py [--repeats 3] [--out results/rank_start.md]

The job is the shape of most of the suite's multi-rank tests: 4 ranks, megatron's parallel state at
TP=2, megapatch switched on by ``MEGAPATCH_TP_REDUCE_DTYPE=fp32`` in the ranks' environment, one
FP32-summed all-reduce through megatron's mappings. Rows:

* ``spawn``: ``run_ranks(start="spawn")``, fresh interpreters (the harness before issue 27);
* ``server (base)``: forked from a server that imported torch and the third-party stack (what
  torchrun's workers get: a Megatron-LM checkout imports its own megatron);
* ``server (megatron)``: the installed megatron-core preloaded too (``run_ranks``' default);
* ``pool (lower bound)``: what long-lived workers would pay per test -- K tests run back to back in
  one job, each re-initialising the parallel state and switching megapatch off and on, per test
  ``(T(K) - T(1)) / (K - 1)``. A real pool would add the per-test isolation work this leaves out
  (undoing a test's imports and module state), so this is its best case.

Medians of ``--repeats`` jobs after one warm-up job (the server's own start is excluded: it is paid
once per pytest session; it is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORLD, TP = 4, 2
ENV = {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}


def _one_test(ctx):
    import torch
    from megatron.core.tensor_parallel import mappings

    x = torch.full((64,), 1.0 + ctx.rank, dtype=torch.bfloat16)
    return mappings.reduce_from_tensor_model_parallel_region(x, group=ctx.tp_group)[0].item()


def _tests_back_to_back(ctx, count):
    import megapatch

    from megapatch.testing import reinit_model_parallel

    out = []
    for _ in range(count):
        megapatch.disable()
        ctx = reinit_model_parallel(ctx, tp=TP)
        megapatch.enable(tp_reduce_dtype="fp32")
        out.append(_one_test(ctx))
    return out


def _job(ctx):
    return _one_test(ctx)


def _time(fn, repeats):
    fn()  # warm-up (starts the server where there is one)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool-tests", type=int, default=8, help="K, tests per job for the pool's bound")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from megapatch.testing import run_ranks
    from megapatch.testing.ranks import rank_server

    t0 = time.perf_counter()
    rank_server.address(preload="megatron")
    server_start = time.perf_counter() - t0
    rows = {}
    for label, start, preload in (("spawn", "spawn", None), ("server (base)", "server", "base"),
                                  ("server (megatron)", "server", "megatron")):
        rows[label] = _time(lambda: run_ranks(_job, WORLD, tp=TP, env=ENV, start=start, preload=preload,
                                              timeout=300), args.repeats)
        print(f"{label}: {rows[label]:.2f} s per job", flush=True)
    one = _time(lambda: run_ranks(_tests_back_to_back, WORLD, tp=TP, args=(1,), timeout=300), args.repeats)
    many = _time(lambda: run_ranks(_tests_back_to_back, WORLD, tp=TP, args=(args.pool_tests,), timeout=300),
                 args.repeats)
    rows["pool (lower bound)"] = (many - one) / (args.pool_tests - 1)
    print(f"pool (lower bound): {rows['pool (lower bound)']:.2f} s per test", flush=True)
    lines = ["# Starting a test's ranks", "",
             f"Produced by `python benchmarks/rank_start.py {' '.join(argv or sys.argv[1:])}` "
             f"({WORLD} ranks, TP={TP}, megapatch on from the environment, one FP32 all-reduce; median "
             f"of {args.repeats} after a warm-up; the rank server's own start, paid once per session: "
             f"{server_start:.1f} s).", "",
             "| how ranks start | seconds per test | vs spawn |", "|---|---|---|"]
    for label, seconds in rows.items():
        lines.append(f"| {label} | {seconds:.2f} | {seconds / rows['spawn']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
