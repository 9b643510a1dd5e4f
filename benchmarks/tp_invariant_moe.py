"""Bitwise TP invariance on a mixture-of-experts model: ``tp_invariant=True`` against native, on CPU.

    python benchmarks/tp_invariant_moe.py [--tp 1,2,4] [--steps 3]
    python benchmarks/tp_invariant_moe.py --dp 4 --tp 1,2 --ep 1,2,4 --variants alltoall   # EP 4
    python benchmarks/tp_invariant_moe.py --dp 1 --tp 1,8 --query-groups 8                 # TP 8

The model: ``megapatch.testing.scenarios.moe_tiny``'s Qwen3-MoE shape (2 layers, hidden 64, 8 heads in
4 KV groups, QK RMSNorm, 8 experts top-2 with SwiGLU FFN 32, RoPE, untied head, vocab 128, BF16,
aux loss 1e-2 and z loss 1e-3), the same weights at every layout (expert TP = TP, sequence
parallelism at TP > 1), data-parallel size 2 (world 2 x TP, each DP rank its own 2 x 32 tokens per
step, gradients reduced as megatron's DDP does); megatron-core's BF16 optimizer (AdamW, clipping at
0.05, below every step's norm). The alltoall dispatcher with a shared expert at EP 1 and 2, the
allgather dispatcher at EP 1. For each layout against TP 1 EP 1 of the same mode: the largest logit
difference at step 0, the (token, layer) expert choices that differ, per-token losses, gradients,
grad norms over the steps, and parameters and Adam moments after the last step that differ.
``--dp`` sets the data-parallel size (world DP x TP; an EP size needs EP x TP ranks), ``--ep`` the
alltoall dispatcher's EP sizes, ``--query-groups`` the KV groups (4; megatron-core needs a TP size
that divides them, so TP 8 needs 8), ``--variants`` which dispatchers run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LOSSES = dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, num_query_groups=4)
VARIANTS = {"alltoall + shared expert": ("alltoall", {**LOSSES, "moe_shared_expert_intermediate_size": 64}, (1, 2)),
            "allgather": ("allgather", LOSSES, (1,))}


def _job(ctx, tp, steps, variants, query_groups):
    from megapatch.testing.scenarios import moe_tiny

    out = {}
    for name, (dispatcher, overrides, eps) in variants.items():
        runs = moe_tiny.invariant_training(ctx, [(tp, ep) for ep in eps if ep * tp <= ctx.world_size], dispatcher,
                                           steps=steps, modes=("native", "tp_invariant"),
                                           config_overrides={**overrides, "num_query_groups": query_groups})
        out.update({(name, mode, t, e): run for (mode, t, e), run in (runs or {}).items()})
    return out if ctx.rank == 0 else None


def _changed(a: dict, b: dict) -> list:
    return [k for k in b if not torch.equal(a[k], b[k])]


def _differing(a: dict, b: dict) -> int:
    return len(_changed(a, b))


def main(argv=None):
    from megapatch.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--ep", default="1,2", help="the alltoall dispatcher's EP sizes (allgather: EP 1)")
    parser.add_argument("--query-groups", type=int, default=LOSSES["num_query_groups"])
    parser.add_argument("--variants", default=",".join(v.split()[0] for v in VARIANTS),
                        help="alltoall, allgather or both")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--list-changed", action="store_true", help="name the gradients that differ, per row")
    args = parser.parse_args(argv)
    tps = [int(t) for t in args.tp.split(",")]
    eps = tuple(int(e) for e in args.ep.split(","))
    variants = {name: (dispatcher, overrides, eps if dispatcher == "alltoall" else (1,))
                for name, (dispatcher, overrides, _) in VARIANTS.items() if dispatcher in args.variants.split(",")}
    runs = {}
    for tp in tps:
        runs.update(run_ranks(_job, world_size=args.dp * tp, args=(tp, args.steps, variants, args.query_groups),
                              timeout=3600)[0])
    print(f"DP {args.dp}, {args.query_groups} KV groups\n")
    print(f"| model | mode | TP | EP | max abs logit diff vs TP 1 EP 1 | expert choices changed | per-token losses changed | "
          f"gradients changed | grad norms equal ({args.steps + 1} steps) | parameters changed | Adam moments changed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (_, _, eps) in variants.items():
        for mode in ("native", "tp_invariant"):
            base = runs[(name, mode, tps[0], 1)]
            tokens = sum(r.shape[0] for r in base["routing"])
            for tp, ep in [(t, e) for t in tps for e in eps if (t, e) != (tps[0], 1) and (name, mode, t, e) in runs]:
                here = runs[(name, mode, tp, ep)]
                changed = sum(int((a != b).any(-1).sum()) for a, b in zip(here["routing"], base["routing"]))
                losses = int((here["losses"] != base["losses"]).sum())
                print(f"| {name} | {mode} | {tp} | {ep} | {(here['logits'] - base['logits']).abs().max().item():.3g} | "
                      f"{changed} / {tokens} | {losses} / {base['losses'].numel()} | "
                      f"{_differing(here['grads'], base['grads'])} / {len(base['grads'])} | "
                      f"{'yes' if here['norms'] == base['norms'] else 'no'} | "
                      f"{_differing(here['params'], base['params'])} / {len(base['params'])} | "
                      f"{_differing(here['adam'], base['adam'])} / {len(base['adam'])} |")
                if args.list_changed:
                    print(f"  changed gradients: {_changed(here['grads'], base['grads'])}")


if __name__ == "__main__":
    main()
