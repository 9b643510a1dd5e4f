#!/usr/bin/env python
"""CPU benchmark of align_fp8_transposes: per-stage idle time and step time, aligned vs lazy.

    /work/venv/bin/python benchmarks/fp8_alignment.py [--configs 2x2,2x4,4x2,4x4] [--k 2e-7]

What is REAL (measured): megatron-core's interleaved schedule, ``GPTModel`` (local spec, fp32),
``DistributedDataParallel`` (distributed-optimizer buffers, ``overlap_param_gather``,
``align_param_gather``, real async all-gathers over gloo), the megapatch patch, spawned ranks.
Wall-clock step time of ``forward_backward`` per rank, and per-stage idle time
= step time - time in ``schedules.forward_step`` - time in ``schedules.backward_step``
- stand-in processing time outside forward steps (both schedule functions are wrapped for timing
only; they run unchanged).

What is SIMULATED: the FP8 transpose. There is no FP8 on CPU, so the name megatron-core
dispatches to after a finished param all-gather (``param_and_grad_buffer.post_all_gather_processing``)
is replaced by ``time.sleep(k * numel)`` over the params of the bucket group (cost proportional to
parameter size), and ``param_and_grad_buffer.is_float8tensor`` answers True for the model weights.
The optimizer is an SGD step on the buffers. Both modes run in the SAME job on the same model:
iterations alternate lazy (megapatch disabled) and aligned (enabled) after one warm-up each, so
CPU noise hits both alike. On 2 cores, 4 ranks share the CPUs: use the ratios, not the seconds.
"""

import argparse
import statistics
import sys
import time

SEQ, MICRO_BATCH, VOCAB = 16, 2, 64


def _job(ctx, microbatches, k, reps):
    import torch
    import megatron.core.distributed.param_and_grad_buffer as pgb
    import megatron.core.pipeline_parallel.schedules as sched
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import megapatch
    from megapatch.testing import build_tiny_gpt, make_batch, tiny_gpt_config

    torch.set_num_threads(1)
    pp, vpp = ctx.pp_size, ctx.vpp_size
    config = tiny_gpt_config(1, pp=pp, vpp=vpp, params_dtype=torch.float32,
                             pipeline_dtype=torch.float32, bf16=False, num_layers=pp * vpp,
                             microbatch_group_size_per_vp_stage=pp)
    chunks = [build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ, vp_stage=v) for v in range(vpp)]
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True,
        align_param_gather=True)
    model = [DistributedDataParallel(config, ddp_config, m) for m in chunks]
    for m in model:
        m.broadcast_params()
    config.no_sync_func = [m.no_sync for m in model]
    config.param_sync_func = [m.start_param_sync for m in model]  # Megatron-LM training.py
    config.finalize_model_grads_func = lambda cs, *a, **kw: [m.finish_grad_sync() for m in cs]

    acc = {"fwd": 0.0, "bwd": 0.0, "proc_out": 0.0, "in_fwd": False}
    ours = {id(p) for m in model for p in m.parameters()}

    def post_all_gather_processing(params):  # SIMULATED FP8 transpose, cost ~ numel
        t = k * sum(p.numel() for p in params)
        time.sleep(t)
        if not acc["in_fwd"]:
            acc["proc_out"] += t

    saved = (pgb.post_all_gather_processing, pgb.is_float8tensor, sched.forward_step, sched.backward_step)
    pgb.post_all_gather_processing = post_all_gather_processing
    pgb.is_float8tensor = lambda t: id(t) in ours

    def timed(name, f):
        def run(*a, **kw):
            t0 = time.perf_counter()
            acc["in_fwd"] = name == "fwd"
            try:
                return f(*a, **kw)
            finally:
                acc["in_fwd"] = False
                acc[name] += time.perf_counter() - t0
        return run

    sched.forward_step = timed("fwd", saved[2])
    sched.backward_step = timed("bwd", saved[3])

    def forward_step(data_iterator, chunk):
        b = next(data_iterator)
        out = chunk(b.tokens, b.position_ids, b.attention_mask, labels=b.labels)
        return out, lambda o: (o.float().mean(), {})

    rows = {"lazy": [], "aligned": []}
    modes = ["lazy", "aligned"] * (reps + 1)
    try:
        for i, mode in enumerate(modes):
            if mode == "aligned":
                megapatch.enable(align_fp8_transposes=True)
            else:
                megapatch.disable()
            for m in model:
                m.zero_grad_buffer()
            batches = [make_batch(i * 100 + j, MICRO_BATCH, SEQ, VOCAB) for j in range(microbatches)]
            acc.update(fwd=0.0, bwd=0.0, proc_out=0.0)
            torch.distributed.barrier()
            fwd_bwd = get_forward_backward_func()  # per step, as Megatron-LM's train_step does
            t0 = time.perf_counter()
            fwd_bwd(forward_step_func=forward_step, data_iterator=[iter(batches) for _ in model],
                    model=model, num_microbatches=microbatches, seq_length=SEQ,
                    micro_batch_size=MICRO_BATCH, forward_only=False)
            step = time.perf_counter() - t0
            with torch.no_grad():
                for m in model:
                    for buf in m.buffers:
                        for bucket in buf.buckets:
                            n = ctx.dp_size
                            pgb.shard_buffer(bucket.param_data, n)[ctx.dp_rank].add_(
                                pgb.shard_buffer(bucket.grad_data, n)[ctx.dp_rank], alpha=-0.01)
            if i >= 2:  # first lazy + first aligned are warm-up
                if "--debug" in sys.argv:
                    print(ctx.pp_rank, mode, round(step, 3), {k_: round(v, 3) for k_, v in acc.items() if k_ != "in_fwd"}, flush=True)
                idle = step - acc["fwd"] - acc["bwd"] - acc["proc_out"]
                rows[mode].append((step, idle))
    finally:
        pgb.post_all_gather_processing, pgb.is_float8tensor, sched.forward_step, sched.backward_step = saved
        megapatch.disable()

    from megapatch.patches.fp8 import align_transposes as pm

    return dict(pp_rank=ctx.pp_rank, rows=rows, decision=dict(pm.last_decision))


def run_config(pp, vpp, k, reps, timeout):
    from megapatch.testing import run_ranks

    microbatches = 2 * pp
    res = run_ranks(_job, world_size=pp, tp=1, pp=pp, vpp=vpp, args=(microbatches, k, reps),
                    timeout=timeout)
    for r in res:
        if not r["decision"]["aligned"]:
            raise RuntimeError(f"the patch did not align: {r['decision']}")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = {}
    for mode in ("lazy", "aligned"):
        step = max(med([s for s, _ in r["rows"][mode]]) for r in res)  # the pipeline's step time
        idle = [med([i for _, i in r["rows"][mode]]) for r in sorted(res, key=lambda r: r["pp_rank"])]
        out[mode] = (step, idle)
    return microbatches, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="2x2,2x4,4x2,4x4", help="PPxVPP list")
    ap.add_argument("--k", type=float, default=1e-6, help="simulated transpose seconds per element")
    ap.add_argument("--reps", type=int, default=3, help="measured iterations per mode")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--debug", action="store_true", help="print per-iteration timings of every rank")
    a = ap.parse_args(argv)
    print(f"simulated transpose cost: {a.k:g} s/element (sleep); medians of {a.reps} iterations "
          "per mode, modes alternating in one job")
    print()
    print("| PP | VPP | M | step lazy [s] | step aligned [s] | step aligned/lazy | "
          "idle per stage lazy [s] | idle per stage aligned [s] | total idle aligned/lazy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cfg in a.configs.split(","):
        pp, vpp = (int(x) for x in cfg.lower().split("x"))
        t0 = time.perf_counter()
        m, out = run_config(pp, vpp, a.k, a.reps, a.timeout)
        (sl, il), (sa, ia) = out["lazy"], out["aligned"]
        fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        ratio = sum(ia) / sum(il) if sum(il) > 0 else float("nan")
        print(f"| {pp} | {vpp} | {m} | {sl:.3f} | {sa:.3f} | {sa / sl:.2f} | {fmt(il)} | {fmt(ia)} | "
              f"{ratio:.2f} |", flush=True)
        print(f"<!-- {cfg}: {time.perf_counter() - t0:.0f} s -->", file=sys.stderr)


if __name__ == "__main__":
    main()
