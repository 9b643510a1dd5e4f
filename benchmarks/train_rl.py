"""Megatron-LM's own ``train_rl.py`` (core_v0.16.1, or main with ``--revision``) on CPU ranks: Megatron RL's logged train-vs-rollout
log-prob mismatch per megapatch mode and trainer/rollout layout (results/train_rl.md).

    python benchmarks/train_rl.py [--revision core_v0.16.1|main-d98e8a64] [--megatron-lm DIR] [--iters 3] [--layouts 2/1,4/2,1/2]
                                  [--modes ...] [--moe [--ep 2/2]] [--group 4] [--no-sequence-parallel]
                                  [--hidden 64 --ffn 128 [--moe-ffn N]]

A tiny dense Qwen3-shaped model (QK RMSNorm, SwiGLU, GQA), GRPO, 2 prompts x 4 rollouts a step in
micro-batches of 2, the rollouts on the dynamic engine at the rollout TP size and a refit before
each step's rollouts (``megapatch.testing.scenarios.train_rl``). The figures are what ``train_rl.py``
hands its loggers (upstream's ``update_inference_logprobs_group_stats``), recorded per step by
``megapatch.testing.stand_ins.rl_compat``; each cell is the worst of the job's steps.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = {"native": {}, "fp32": {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"},
         "FP32 logits": {"MEGAPATCH_LOGITS_DTYPE": "fp32"},
         "fp32 + FP32 logits": {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_LOGITS_DTYPE": "fp32"},
         "tp_invariant + FP32 logits": {"MEGAPATCH_TP_INVARIANT": "1", "MEGAPATCH_LOGITS_DTYPE": "fp32"}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revision", default="core_v0.16.1", choices=("core_v0.16.1", "main-d98e8a64"),
                        help="which pinned Megatron-LM (main needs Python >= 3.12 and the rl-main extra); with "
                             "--megatron-lm, which one that checkout is (its train_rl.py flags differ)")
    parser.add_argument("--megatron-lm", help="a Megatron-LM checkout (default: the pinned --revision tarball)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--layouts", default="2/1,4/2,1/2", help="trainer TP / rollout TP, comma-separated")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--moe", action="store_true",
                        help="the Qwen3-MoE-shaped model (4 experts top-2, alltoall) at EP 1 on both sides")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (8 heads of hidden/8)")
    parser.add_argument("--ffn", type=int, default=128, help="FFN hidden size (and the experts' with --moe "
                        "unless --moe-ffn)")
    parser.add_argument("--moe-ffn", type=int, default=None, help="the experts' FFN size (default: 64 at "
                        "hidden 64, else --ffn)")
    parser.add_argument("--ep", default="1/1", help="with --moe: trainer EP / rollout EP (the job then has "
                                                    "trainer TP x trainer EP ranks at least)")
    parser.add_argument("--group", type=int, default=4,
                        help="rollouts per prompt (upstream's engines on different data-parallel ranks sample "
                             "with one seed: a group needs members on one engine to differ)")
    parser.add_argument("--all-ranks", action="store_true",
                        help="each step's worst rank (default: rank 0's statistics, what upstream logs)")
    parser.add_argument("--no-sequence-parallel", action="store_true",
                        help="the trainer without --sequence-parallel (default: on at TP > 1)")
    args = parser.parse_args(argv)
    from megapatch.testing.ranks import megatron_lm_runs as mlm
    from megapatch.testing.scenarios import train_rl

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkout = Path(args.megatron_lm) if args.megatron_lm else mlm.pinned_checkout(root / "src", args.revision)
        print("| trainer TP / rollout TP | mode | max abs(p_train - p_inf) | mean abs(p_train - p_inf) | "
              "min / max p_train / p_inf | grad norms | wall (s) |")
        print("|---|---|---|---|---|---|---|")
        layouts = [tuple(int(x) for x in layout.split("/")) for layout in args.layouts.split(",")]
        moe_ffn = args.moe_ffn or (64 if args.hidden == 64 else args.ffn)
        ep, rollout_ep = (int(x) for x in args.ep.split("/"))
        for tp, rollout_tp in layouts:
            for mode in args.modes.split(","):
                env = MODES[mode]
                start = time.monotonic()
                nproc = max(tp * ep, rollout_tp * rollout_ep) if args.moe else max(tp, rollout_tp)
                job, steps = train_rl.run(checkout, root, nproc=nproc, tp=tp, rollout_tp=rollout_tp,
                                          iters=args.iters, megapatch_env=env, name=f"{tp}-{rollout_tp}",
                                          group=args.group, timeout=300,
                                          sequence_parallel=not args.no_sequence_parallel,
                                          hidden=args.hidden, ffn=args.ffn, moe_ffn=moe_ffn, revision=args.revision,
                                          **(dict(moe=True, ep=ep, rollout_ep=rollout_ep) if args.moe else {}))
                wall = time.monotonic() - start
                if args.all_ranks:  # each rank's statistics of its own rollouts; the worst rank per step
                    ranks = [train_rl.rank_stats(job, r) for r in range(nproc)]
                    steps = [max(row, key=lambda s: s["max_inf_train_prob_abs_diff"]) for row in zip(*ranks)]
                if job.returncode != 0 and len(steps) == args.iters:
                    mode += f" (every step logged; the job then did not exit: {job.returncode})"
                elif job.returncode != 0 or len(steps) != args.iters:
                    print(f"| {tp} / {rollout_tp} | {mode} | failed (exit {job.returncode}, {len(steps)} steps "
                          f"logged) | | | | {wall:.0f} |")
                    print(job.tail(3000), file=sys.stderr)
                    continue
                worst = max(s["max_inf_train_prob_abs_diff"] for s in steps)
                mean = max(s["mean_inf_train_prob_abs_diff"] for s in steps)
                low = min(s["min_piold_to_inf_prob"] for s in steps)
                high = max(s["max_piold_to_inf_prob"] for s in steps)
                norms = ", ".join(re.findall(r"grad norm: ([0-9.]+)", job.log))
                per_step = ", ".join(f"{s['max_inf_train_prob_abs_diff']:.3g}" for s in steps)
                print(f"| {tp} / {rollout_tp} | {mode} | {worst:.3g} (steps: {per_step}) | {mean:.3g} | "
                      f"{low:.7g} / {high:.7g} | {norms} | {wall:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
