"""An MoE model at other micro-batch sizes (issue 37): Megatron-LM's ``pretrain_gpt.py`` on CPU gloo
ranks, the Llama flags of ``megapatch.testing.scenarios.layouts`` plus its Qwen3-MoE-shaped layer
(``layouts.MOE``: 8 experts top-2, alltoall, QK RMSNorm, aux and z losses), sequence parallelism at
TP > 1 (expert TP = TP), global batch 12, 3 clipped Adam steps, a fresh run per layout (TP x DP,
micro-batch size), under ``tp_invariant`` and natively. Prints the printed losses, the
full-precision grad norms (the test probe's record) and how many of the final torch_dist
checkpoint's tensors differ from the first layout's (TP 1 x DP 1, mbs 1; with ``--ep``, EP 2 at DP 2,
mbs 1: Megatron-LM initialises the experts per EP rank, so EP 2 starts from another model).

    python benchmarks/tp_invariant_moe_micro_batch.py [--megatron-lm DIR] [--ep]
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
#: run with --expert-model-parallel-size 2 (the experts split over the two DP ranks; --ep), compared with
#: the first: Megatron-LM initialises experts per EP rank, so EP 2 starts from another model than EP 1
EP_LAYOUTS = {"tp_invariant": (L(dp=2, mbs=1), L(dp=2, mbs=2), L(dp=2, mbs=3), L(tp=2, dp=2, mbs=2)),
              "native": (L(dp=2, mbs=1), L(dp=2, mbs=2))}
EP = ("--expert-model-parallel-size", "2")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (default: the pinned core_v0.16.1 tarball)")
    parser.add_argument("--ep", action="store_true",
                        help="the expert-parallel rows only: EP 2 at DP 2, mbs 1, 2 (and 3, and TP 2 at mbs 2), "
                             "against EP 2 mbs 1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkout = args.megatron_lm or mlm.pinned_checkout(Path(tmp) / "src")
        moe = (*layouts.MOE, "--sequence-parallel")
        for mode, env in MODES.items():
            def train(layout, ep=False):
                return layouts.train(checkout, Path(tmp) / mode / ("ep" if ep else "plain"), layout, env, probe=PROBE,
                                     iters=3, extra=(*moe, *(EP if ep else ())), label=mode, timeout=900)

            ep = args.ep
            runs = {layout: train(layout, ep) for layout in (EP_LAYOUTS if ep else LAYOUTS)[mode]}
            first = next(iter(runs))
            base = runs[first].tensors()
            for layout, run in runs.items():
                differ = len(tp_resume.differences(base, run.tensors())) if layout != first else 0
                print(f"{mode} TP {layout.tp} x DP {layout.dp}{' x EP 2' if ep else ''}, mbs {layout.mbs}: losses "
                      f"{[run.losses[i] for i in sorted(run.losses)]}, norms {run.exact_norms}, "
                      f"{differ} of {len(base)} tensors differ from the first row's", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
