"""Megatron-LM core_v0.16.1's ``train_rl.py --rl-use-sequence-packing`` on 2 CPU ranks: the dense
Qwen3-shaped model of tests/test_train_rl.py, trainer TP 2 / rollout TP 1, micro-batch 1 (upstream's
rule with packing); prints how the bins were packed and upstream's own train-vs-rollout mismatch per
step (issue 49; the figures in results/tp_invariant_long_context.md).

    python tools/train_rl_packing.py --mode tp_invariant --seq-length 128 --iters 2
    python tools/train_rl_packing.py --mode native --iters 1

``--seq-length`` is the bin size (and the rollouts' length): at 64 every bin holds one sequence of
the synthetic countdown task, at 128 some hold two.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from megapatch.testing.ranks import megatron_lm_runs as mlm
from megapatch.testing.scenarios import train_rl

MODES = {"tp_invariant": {"MEGAPATCH_TP_INVARIANT": "1", "MEGAPATCH_LOGITS_DTYPE": "fp32"},
         "native": {"MEGAPATCH_LOGITS_DTYPE": "native"}}  # megapatch on with upstream's numerics: the report only


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="tp_invariant")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="train-rl-packing-"))
    checkout = mlm.pinned_checkout(root / "megatron-lm")
    length = str(args.seq_length)
    job, steps = train_rl.run(checkout, root, nproc=2, tp=2, rollout_tp=1, iters=args.iters, timeout=900,
                              megapatch_env=MODES[args.mode], name=args.mode, micro_batch=1,
                              hidden=512, ffn=2048, moe_ffn=2048,  # tests/test_train_rl.py's WIDTHS
                              extra=("--rl-use-sequence-packing", "--seq-length", length,
                                     "--max-position-embeddings", length, "--inference-max-seq-length", length))
    for line in job.log.splitlines():
        if "Packing distribution" in line or "Packing efficiency" in line:
            print(line.split("] ", 1)[-1])
    for step, stats in enumerate(steps, 1):
        print(f"step {step}: max |p_train - p_inf| {stats['max_inf_train_prob_abs_diff']:.3g}, p_old/p_inf "
              f"{stats['min_piold_to_inf_prob']:.6g} .. {stats['max_piold_to_inf_prob']:.6g}")
    if job.returncode != 0:
        print(f"exit {job.returncode}:\n{job.tail()}")
    return job.returncode


if __name__ == "__main__":
    raise SystemExit(main())
