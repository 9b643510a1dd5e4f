"""How far a tiny Qwen3-MoE-shaped megatron-core model drifts, and how many expert choices change,
when only the TP or EP size changes, per megapatch mode, on CPU.

    python benchmarks/moe_tp_drift.py [--dispatcher alltoall|allgather] [--shared-experts]

The model and the rank function: ``megapatch.testing.scenarios.moe_tiny`` (2 layers, hidden 64,
8 heads in 2 KV groups, QK RMSNorm, 8 experts top-2 with SwiGLU FFN 32, RoPE, vocab 128, BF16,
expert TP = TP, sequence parallelism at TP > 1; the same full weights at every layout). Batch 2 x 32
tokens. Per mode and (TP, EP) layout, against the same mode at TP=1, EP=1: KL(p_TP1 || p_layout)
averaged over tokens, the share of (token, layer) pairs whose top-k expert set differs, and against
an FP32 run of the same (BF16) weights: the relative L2 error of the logits and the share of
(token, layer) pairs routed differently from it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2))
MODES = ("native", "fp32-accumulate", "fp32", "fp32+logits")


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def changed_choices(routing, reference) -> float:
    """Share of (token, layer) pairs whose top-k expert set differs from the reference's."""
    changed = sum(int((a != b).any(-1).sum()) for a, b in zip(routing, reference))
    return changed / sum(r.shape[0] for r in reference)


def relative_l2(a: torch.Tensor, reference: torch.Tensor) -> float:
    return ((a.double() - reference.double()).norm() / reference.double().norm()).item()


def main(argv=None) -> None:
    from megapatch.testing import run_ranks
    from megapatch.testing.scenarios import moe_tiny

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    parser.add_argument("--shared-experts", action="store_true", help="a shared expert of FFN 48 per layer")
    args = parser.parse_args(argv)
    overrides = {"moe_shared_expert_intermediate_size": 48} if args.shared_experts else {}
    reference = run_ranks(moe_tiny.fp32_reference, world_size=1, tp=1,
                          kwargs=dict(dispatcher=args.dispatcher, config_overrides=overrides))[0]
    runs = {(tp, ep): run_ranks(moe_tiny.moe_forward, world_size=tp * ep, tp=tp, timeout=600,
                                args=(MODES, args.dispatcher, ep), kwargs=dict(config_overrides=overrides))[0]
            for tp, ep in LAYOUTS}
    print(f"Tiny Qwen3-MoE, {args.dispatcher} dispatcher{', shared experts' if overrides else ''}; "
          f"`python benchmarks/moe_tp_drift.py --dispatcher {args.dispatcher}"
          f"{' --shared-experts' if overrides else ''}`\n")
    print("| mode | TP x EP | KL(TP1‖layout) | expert choices changed vs TP1 | rel. L2 vs FP32 run | "
          "expert choices differing from FP32 run | logits dtype |")
    print("|---|---|---|---|---|---|---|")
    for mode in MODES:
        base = runs[(1, 1)][mode]
        for (tp, ep), run in runs.items():
            r = run[mode]
            print(f"| {mode} | {tp} x {ep} | {kl(base['logits'], r['logits']):.2e} | "
                  f"{changed_choices(r['routing'], base['routing']):.2%} | "
                  f"{relative_l2(r['logits'], reference['logits']):.4f} | "
                  f"{changed_choices(r['routing'], reference['routing']):.2%} | {r['dtype'].split('.')[-1]} |")


if __name__ == "__main__":
    main()
