"""Step time of tp_invariant's layout-independent training (issue 37 item 7) through Megatron-LM's
own ``pretrain_gpt.py`` on CPU gloo ranks, in one run: native, the mode without its data-parallel
changes (``MEGAPATCH_SKIP_PATCHES=tp_invariant.data_parallel,tp_invariant.loss_scale``: the mode as
it was before issue 37, bit-identical across TP only at DP 1 and 2) and the whole mode, at the
same layout, each repeated; Megatron-LM's own "elapsed time per iteration" after the first
iterations (start-up), median over iterations and repeats. The Llama flags of
``megapatch.testing.scenarios.layouts``, plain and distributed optimizer.

    python benchmarks/tp_invariant_layouts_cost.py [--megatron-lm DIR] [--dp 3] [--tp 1] [--iters 8]
                                                   [--repeat 2]

Ratios, not absolute times, are the figure: CPU ranks share two cores here.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megapatch.testing.ranks import megatron_lm_runs as mlm  # noqa: E402
from megapatch.testing.scenarios import layouts  # noqa: E402

MODES = {
    "native": {},
    "mode without the DP sum": {"MEGAPATCH_TP_INVARIANT": "1",
                                "MEGAPATCH_SKIP_PATCHES": "tp_invariant.data_parallel,tp_invariant.loss_scale"},
    "tp_invariant": {"MEGAPATCH_TP_INVARIANT": "1"},
}
_ELAPSED = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")
WARMUP = 2  # iterations left out: the first steps build buffers and compile nothing else


def _step_ms(checkout: Path, layout: layouts.Layout, env, iters: int, extra) -> list:
    flags = layouts.flags(layout, iters, global_batch=12, extra=["--log-interval", "1", *extra])
    run = mlm.launch(checkout, flags, nproc=layout.nproc, megapatch_env=env, timeout=900)
    if run.returncode != 0:
        raise SystemExit(f"{env}: exited {run.returncode}\n{run.tail()}")
    return [float(ms) for it, ms in _ELAPSED.findall(run.log) if int(it) > WARMUP]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (default: the pinned core_v0.16.1 tarball)")
    parser.add_argument("--dp", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    layout = layouts.Layout(tp=args.tp, dp=args.dp)
    with tempfile.TemporaryDirectory() as tmp:
        checkout = args.megatron_lm or mlm.unpack(
            REPO.parent / "shared" / "megatron-lm" / mlm.TARBALLS["core_v0.16.1"], Path(tmp) / "src")
        print(f"| optimizer | mode | step ms (median, iterations {WARMUP + 1}-{args.iters}, {args.repeat} runs) "
              f"| / native | / mode without the DP sum |")
        print("|---|---|---|---|---|")
        for optimizer, extra in (("plain", ()), ("distributed", ("--use-distributed-optimizer",))):
            found = {mode: [] for mode in MODES}
            for _ in range(args.repeat):  # interleaved, so a slow moment of the machine hits every mode
                for mode, env in MODES.items():
                    found[mode] += _step_ms(checkout, layout, env, args.iters, extra)
            median = {mode: statistics.median(ms) for mode, ms in found.items()}
            for mode in MODES:
                print(f"| {optimizer} | {mode} | {median[mode]:.1f} | {median[mode] / median['native']:.2f}x "
                      f"| {median[mode] / median['mode without the DP sum']:.2f}x |", flush=True)
    print(f"layout TP {args.tp} x DP {args.dp}, Llama flags (hidden 64, 4 layers), global batch 12, mbs 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
