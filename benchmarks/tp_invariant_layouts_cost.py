"""Step time of tp_invariant's layout-independent training (issue 37 item 7) through Megatron-LM's
own ``pretrain_gpt.py`` on CPU gloo ranks, in one run: native, the mode as it was before issue 37
(``--before DIR``: a megapatch checkout of that commit, e.g. ``git worktree add DIR 3b23c9c``, put
first on the ranks' PYTHONPATH; its DP sum was DDP's, bit-identical across TP only at DP 1 and 2)
and the whole mode, at the same layout, interleaved and repeated; Megatron-LM's own "elapsed time
per iteration" after the first iterations (start-up), median over iterations and repeats. Every
rank starts as a fresh interpreter (``start="spawn"``), so each mode imports its own megapatch.
The Llama flags of ``megapatch.testing.scenarios.layouts``, plain and distributed optimizer.
(The mode refuses ``MEGAPATCH_SKIP_PATCHES`` of its own patches, so "the mode without its DP sum"
is that older commit.)

    python benchmarks/tp_invariant_layouts_cost.py --before DIR [--megatron-lm DIR] [--dp 3] [--tp 1]
                                                   [--mbs 1] [--iters 8] [--repeat 2]

``--before`` may be any earlier megapatch commit without the per-sequence gradient terms
(``tp_invariant.micro_batch``): 3b23c9c (before issue 37) prices the whole layout work, f012f8b (the
exact DP sum, before the per-sequence terms) prices the micro-batch-size work at ``--mbs`` > 1.

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

BEFORE = "tp_invariant at --before"
MODES = {"native": {}, BEFORE: {"MEGAPATCH_TP_INVARIANT": "1"}, "tp_invariant": {"MEGAPATCH_TP_INVARIANT": "1"}}
_ELAPSED = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")
WARMUP = 2  # iterations left out: the first steps build buffers and compile nothing else


def _step_ms(checkout: Path, layout: layouts.Layout, env, iters: int, extra, pythonpath=None) -> list:
    flags = layouts.flags(layout, iters, global_batch=12, extra=["--log-interval", "1", *extra])
    run = mlm.launch(checkout, flags, nproc=layout.nproc, megapatch_env=env, timeout=900, start="spawn",
                     extra_env={"PYTHONPATH": str(pythonpath)} if pythonpath else None)
    if run.returncode != 0:
        raise SystemExit(f"{env}: exited {run.returncode}\n{run.tail()}")
    # which megapatch ran: only the current one has the per-sequence gradient terms
    active = run.active_patches
    if ("tp_invariant.micro_batch" in active) != (env.get("MEGAPATCH_TP_INVARIANT") == "1" and not pythonpath):
        raise SystemExit(f"{env} (PYTHONPATH {pythonpath}): unexpected patches active: {active!r}")
    return [float(ms) for it, ms in _ELAPSED.findall(run.log) if int(it) > WARMUP]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (default: the pinned core_v0.16.1 tarball)")
    parser.add_argument("--before", type=Path, required=True, help="an earlier megapatch checkout (3b23c9c: before issue 37; f012f8b: before the per-sequence terms)")
    parser.add_argument("--dp", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--mbs", type=int, default=1, help="micro-batch size (global batch 12)")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    layout = layouts.Layout(tp=args.tp, dp=args.dp, mbs=args.mbs)
    with tempfile.TemporaryDirectory() as tmp:
        checkout = args.megatron_lm or mlm.pinned_checkout(Path(tmp) / "src")
        print(f"| optimizer | mode | step ms (median, iterations {WARMUP + 1}-{args.iters}, {args.repeat} runs) "
              f"| / native | / --before |")
        print("|---|---|---|---|---|")
        for optimizer, extra in (("plain", ()), ("distributed", ("--use-distributed-optimizer",))):
            found = {mode: [] for mode in MODES}
            for _ in range(args.repeat):  # interleaved, so a slow moment of the machine hits every mode
                for mode, env in MODES.items():
                    found[mode] += _step_ms(checkout, layout, env, args.iters, extra,
                                            args.before if mode == BEFORE else None)
            median = {mode: statistics.median(ms) for mode, ms in found.items()}
            for mode in MODES:
                print(f"| {optimizer} | {mode} | {median[mode]:.1f} | {median[mode] / median['native']:.2f}x "
                      f"| {median[mode] / median[BEFORE]:.2f}x |", flush=True)
    print(f"layout TP {args.tp} x DP {args.dp}, Llama flags (hidden 64, 4 layers), global batch 12, mbs {args.mbs}; "
          f"'{BEFORE}': {args.before}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
