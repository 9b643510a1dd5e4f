"""An MoE model at another data-parallel size (issue 37): Megatron-LM's ``pretrain_gpt.py`` on CPU
gloo ranks, the Llama flags of ``megapatch.testing.scenarios.layouts`` plus a Qwen3-MoE-shaped layer
(8 experts top-2, alltoall dispatcher, QK RMSNorm, aux and z losses), TP 1, the same global batch of
12 single-sequence micro-batches at DP 1, 2, 3 and 4 with EP 1, and at DP 2 and 4 with EP 2 (a
fresh run each: PP 1, one initial model), 3 clipped Adam steps, under ``tp_invariant`` and natively
(native: EP 1 at DP 1, 2, 4). Prints the printed losses, the full-precision grad norms (the test
probe's record) and how many of the final torch_dist checkpoint's tensors differ from DP 1's.

    python benchmarks/tp_invariant_moe_data_parallel.py [--megatron-lm DIR]
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
MOE = layouts.MOE
MODES = {"tp_invariant": {"MEGAPATCH_TP_INVARIANT": "1"}, "native": {}}
LAYOUTS = {"tp_invariant": ((1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2)), "native": ((1, 1), (2, 1), (4, 1))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (default: the pinned core_v0.16.1 tarball)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkout = args.megatron_lm or mlm.pinned_checkout(Path(tmp) / "src")
        for mode, env in MODES.items():
            runs = {(dp, ep): layouts.train(checkout, Path(tmp) / mode, layouts.Layout(dp=dp), env, probe=PROBE,
                                            iters=3, extra=(*MOE, "--expert-model-parallel-size", str(ep)),
                                            label=f"{mode}-ep{ep}", timeout=900)
                    for dp, ep in LAYOUTS[mode]}
            base = runs[1, 1].tensors()
            for (dp, ep), run in runs.items():
                differ = len(tp_resume.differences(base, run.tensors())) if (dp, ep) != (1, 1) else 0
                print(f"{mode} DP {dp} EP {ep}: losses {[run.losses[i] for i in sorted(run.losses)]}, "
                      f"norms {run.exact_norms}, {differ} of {len(base)} tensors differ from DP 1 EP 1", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
