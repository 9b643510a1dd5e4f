"""An MoE model at other micro-batch sizes (issue 37): Megatron-LM's ``pretrain_gpt.py`` on CPU gloo
ranks, the Llama flags of ``megapatch.testing.scenarios.layouts`` plus its Qwen3-MoE-shaped layer
(``layouts.MOE``: 8 experts top-2, alltoall, QK RMSNorm, aux and z losses), sequence parallelism at
TP > 1 (expert TP = TP), global batch 12, 3 clipped Adam steps, a fresh run per layout (TP x DP,
micro-batch size), under ``tp_invariant`` and natively. Prints the printed losses, the
full-precision grad norms (the test probe's record) and how many of the final torch_dist
checkpoint's tensors differ from TP 1 x DP 1, mbs 1.

    python benchmarks/tp_invariant_moe_micro_batch.py [--megatron-lm DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megapatch.testing.ranks import megatron_lm_runs as mlm  # noqa: E402
from megapatch.testing.scenarios import layouts, tp_resume  # noqa: E402

PROBE = str(REPO / "tests" / "scripts" / "megatron_lm_probe.py")
MODES = {"tp_invariant": {"MEGAPATCH_TP_INVARIANT": "1"}, "native": {}}
L = layouts.Layout
LAYOUTS = {"tp_invariant": (L(), L(mbs=2), L(mbs=4), L(dp=2, mbs=2), L(dp=3, mbs=2), L(tp=2, dp=2, mbs=2)),
           "native": (L(), L(mbs=4), L(dp=2, mbs=2))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (default: the pinned core_v0.16.1 tarball)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkout = args.megatron_lm or mlm.pinned_checkout(Path(tmp) / "src")
        for mode, env in MODES.items():
            runs = {layout: layouts.train(checkout, Path(tmp) / mode, layout, env, probe=PROBE, iters=3,
                                          extra=(*layouts.MOE, "--sequence-parallel"), label=mode, timeout=900)
                    for layout in LAYOUTS[mode]}
            base = runs[L()].tensors()
            for layout, run in runs.items():
                differ = len(tp_resume.differences(base, run.tensors())) if layout != L() else 0
                print(f"{mode} TP {layout.tp} x DP {layout.dp}, mbs {layout.mbs}: losses "
                      f"{[run.losses[i] for i in sorted(run.losses)]}, norms {run.exact_norms}, "
                      f"{differ} of {len(base)} tensors differ from TP 1 x DP 1 mbs 1", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
