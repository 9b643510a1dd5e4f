"""tp_invariant at other layouts (issue 37): the tables of results/tp_invariant_layouts.md, from
Megatron-LM's own ``pretrain_gpt.py`` on CPU gloo ranks through ``megapatch.testing.scenarios.layouts``
(the Llama flags there: SwiGLU, RMSNorm, RoPE, 8 heads in 4 KV groups, 4 layers, hidden 64, BF16,
``--clip-grad 0.05``, Adam). Each table prints the printed losses, the full-precision grad norms (the
test probe's record, hex) and how many tensors of the final torch_dist checkpoint (parameters, FP32
main parameters, Adam moments) differ from the table's reference run; a cell equal to the
reference row's says "the same".

``--table`` chooses (default: all five, in this order):

* ``fresh``: "Fresh runs, 3 iterations" -- global batch 12 of single-sequence micro-batches,
  ``layouts.train`` at TP x DP 1 x 1, 2 x 3, 2 x 2, 1 x 4, 1 x 3 under tp_invariant and 1 x 1, 1 x 3
  natively (PP 1 everywhere: one initial model), then ``layouts.tp_resume.differences``.
* ``resume``: "Resumed at another layout" -- ``layouts.experiment``: 3 iterations at 1 x 1 x 1
  saving at iteration 1, resumed to iteration 3 at TP x DP x PP 1 x 1 x 1, 2 x 3 x 1, 1 x 2 x 2,
  2 x 2 x 2; then with ``--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable`` at
  1 x 1 x 1, 2 x 3 x 1, 1 x 2 x 2.
* ``mbs``: "Micro-batch size", the global-batch-24 resume table -- ``layouts.experiment(...,
  global_batch=24)`` resumed at (TP x DP x PP, mbs) (1x1x1, 4), (2x3x1, 1), (1x4x1, 2), (2x2x2, 1),
  (4x2x1, 2), (1x2x2, 2), plain optimizer, then again with the distributed optimizer.
* ``native-mbs``: the native-vs-mode table at global batch 24 -- fresh runs of 3 iterations at
  TP x DP 1 x 1 mbs 1, 1 x 1 mbs 4, 1 x 4 mbs 2, natively and under tp_invariant.
* ``tied``: "Tied embeddings" -- the Llama flags without ``--untie-embeddings-and-output-weights``,
  one step, global batch 12, fresh runs at 1 x 1 mbs 1, 1 x 1 mbs 2, 1 x 2 mbs 1, 1 x 3 mbs 4; then
  across pipeline depths: resumed from one checkpoint at 1 x 1 x 2 mbs 1 and 1 x 2 x 2 mbs 2, plain
  and distributed optimizer, against never stopping. The
  results' "per-sequence terms only" column is the mode before the tied rule (3787681's parent,
  baa6ae2): not reproduced here (this script runs the checkout it is in).

The micro-batch table at global batch 12 against f012f8b is not reproduced either (an older commit).

    python benchmarks/tp_invariant_layouts.py [--table {fresh,resume,mbs,native-mbs,tied,all} ...]
                                              [--megatron-lm DIR] [--timeout 1800]

Up to 8 CPU ranks a job; wall time printed per table (2026-12-04, 2 cores shared with other jobs:
fresh 132 s, resume 219 s, mbs 497 s, native-mbs 92 s, tied 56 s).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megapatch.testing.ranks import megatron_lm_runs as mlm  # noqa: E402
from megapatch.testing.scenarios import layouts  # noqa: E402

PROBE = str(REPO / "tests" / "scripts" / "megatron_lm_probe.py")
MODES = {"tp_invariant": {"MEGAPATCH_TP_INVARIANT": "1"}, "native": {}}
DISTOPT = ("--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable")
TIED = tuple(a for a in layouts.LLAMA if a != "--untie-embeddings-and-output-weights")
L = layouts.Layout
TABLES = ("fresh", "resume", "mbs", "native-mbs", "tied")


def _losses(run, iterations=None) -> str:
    return ", ".join(f"{float(run.losses[i]):.6f}" for i in sorted(run.losses) if iterations is None or i in iterations)


def _norms(run) -> str:
    return ", ".join(run.exact_norms)


def _same(value: str, reference: str) -> str:
    return "the same" if value == reference else value


def _differ(reference, run) -> str:
    return f"{len(layouts.tp_resume.differences(reference, run.tensors()))} of {len(reference)}"


def _micro_batches(layout: L, global_batch: int) -> int:
    return global_batch // (layout.dp * layout.mbs)


def _txd(layout: L) -> str:
    return f"{layout.tp} x {layout.dp}"


def _txdxp(layout: L) -> str:
    return f"{layout.tp} x {layout.dp} x {layout.pp}"


def fresh(checkout: Path, work: Path, timeout: float) -> None:
    print("| layout (TP x DP, mbs 1) | micro-batches a rank | losses printed | full-precision grad norms "
          "| tensors differing from the mode's 1 x 1 |")
    print("|---|---|---|---|---|")
    grid = {"tp_invariant": (L(), L(tp=2, dp=3), L(tp=2, dp=2), L(dp=4), L(dp=3)), "native": (L(), L(dp=3))}
    for mode, env in MODES.items():
        reference = None
        for layout in grid[mode]:
            run = layouts.train(checkout, work / mode, layout, env, probe=PROBE, iters=3, label=mode, timeout=timeout)
            name = f"{'native ' if mode == 'native' else ''}{_txd(layout)}"
            if reference is None:
                reference, tensors = run, run.tensors()
                print(f"| {name} | {_micro_batches(layout, 12)} | {_losses(run)} | {_norms(run)} | -- |", flush=True)
                continue
            first = next((i + 1 for i, (a, b) in enumerate(zip(run.exact_norms, reference.exact_norms)) if a != b), None)
            print(f"| {name} | {_micro_batches(layout, 12)} | {_same(_losses(run), _losses(reference))} "
                  f"| {_same(_norms(run), _norms(reference))} | {_differ(tensors, run)}"
                  f"{f' (grad norms differ from step {first})' if first else ''} |", flush=True)


def _resume_rows(checkout: Path, work: Path, grid, global_batch: int, timeout: float):
    """``{optimizer: (uninterrupted run, {layout: resumed run})}`` from one ``layouts.experiment`` each."""
    found = {}
    for optimizer, extra in grid:
        runs = layouts.experiment(checkout, work / optimizer, MODES["tp_invariant"], grid[optimizer, extra],
                                  probe=PROBE, global_batch=global_batch, extra=extra, label=optimizer,
                                  timeout=timeout)
        found[optimizer] = (runs.pop("full"), {run.layout: run for run in runs.values()})
    return found


def _resume_table(found, layouts_, global_batch: int, mbs_column: bool) -> None:
    """One row a layout: its plain resume's printed losses and grad norms of iterations 2-3 against the
    plain uninterrupted run's (the same where equal), tensors differing from each optimizer's own
    uninterrupted run."""
    plain_full, plain = found["plain"]
    full_tensors = {optimizer: full.tensors() for optimizer, (full, _) in found.items()}
    head = "(TP x DP x PP, mbs)" if mbs_column else "(TP x DP x PP)"
    print(f"| resumed at {head} | ranks | micro-batches a rank | printed losses, iterations 2-3 "
          f"| full-precision grad norms, iterations 2-3 | tensors differing from the uninterrupted run, "
          f"{' / '.join(found)} |")
    print("|---|---|---|---|---|---|")
    expected_losses = None
    for layout in layouts_:
        losses = norms = None
        cells = []
        for optimizer, (_, resumed) in found.items():
            run = resumed.get(layout)
            if run is None:
                cells.append("--")
                continue
            cells.append(_differ(full_tensors[optimizer], run).split(" of ")[0])
            if optimizer == "plain":
                losses, norms = _losses(run), _norms(run)
        of = f" of {len(full_tensors['plain'])}"
        full_norms = ", ".join(plain_full.exact_norms[1:])
        name = f"{_txdxp(layout)}{f', mbs {layout.mbs}' if mbs_column else ''}"
        if expected_losses is None:
            # the uninterrupted run prints the mean of iterations 1-2 at 2: the first resume is the reference
            expected_losses, shown_losses = losses, losses
            shown_norms = f"{norms}{' (= uninterrupted)' if norms == full_norms else ''}"
        else:
            shown_losses, shown_norms = _same(losses, expected_losses), _same(norms, full_norms)
        print(f"| {name} | {layout.nproc} | {_micro_batches(layout, global_batch)} | {shown_losses} "
              f"| {shown_norms} | {' / '.join(cells)}{of} |", flush=True)
    print()
    for optimizer, (full, resumed) in found.items():
        print(f"uninterrupted ({optimizer} optimizer, TP x DP x PP 1 x 1 x 1, mbs 1): printed losses {_losses(full)}, "
              f"grad norms {_norms(full)}", flush=True)
        for layout, run in resumed.items():  # what the table's plain columns do not show
            if (_losses(run), _norms(run)) != (expected_losses, ", ".join(full.exact_norms[1:])):
                print(f"  {optimizer}, resumed at {_txdxp(layout)} mbs {layout.mbs}: printed losses {_losses(run)}, "
                      f"grad norms {_norms(run)}")
    if len(found) == 2:  # the optimizer states are saved under other names: the model's tensors
        model = {k: v for k, v in full_tensors["plain"].items() if not k.startswith("optimizer.")}
        other = {k: v for k, v in full_tensors["distributed"].items() if k in model}
        print(f"plain vs distributed uninterrupted runs: {len(layouts.tp_resume.differences(model, other))} of "
              f"{len(model)} model tensors differ", flush=True)
    print(f"a resume's first iteration printed: {expected_losses.split(', ')[0]}; the uninterrupted run's iteration 2: "
          f"{_losses(plain_full, {2})} (upstream's log averages a fresh run's iterations 1-2)", flush=True)


def resume(checkout: Path, work: Path, timeout: float) -> None:
    plain = (L(), L(tp=2, dp=3), L(dp=2, pp=2), L(tp=2, dp=2, pp=2))
    grid = {("plain", ()): plain, ("distributed", DISTOPT): plain[:3]}
    _resume_table(_resume_rows(checkout, work, grid, 12, timeout), plain, 12, mbs_column=False)


def mbs(checkout: Path, work: Path, timeout: float) -> None:
    rows = (L(mbs=4), L(tp=2, dp=3), L(dp=4, mbs=2), L(tp=2, dp=2, pp=2), L(tp=4, dp=2, mbs=2), L(dp=2, pp=2, mbs=2))
    grid = {("plain", ()): rows, ("distributed", DISTOPT): rows}
    _resume_table(_resume_rows(checkout, work, grid, 24, timeout), rows, 24, mbs_column=True)


def native_mbs(checkout: Path, work: Path, timeout: float) -> None:
    grid = (L(), L(mbs=4), L(dp=4, mbs=2))
    found = {mode: [layouts.train(checkout, work / mode, layout, env, probe=PROBE, iters=3, global_batch=24,
                                  label=mode, timeout=timeout) for layout in grid]
             for mode, env in (("native", MODES["native"]), ("tp_invariant", MODES["tp_invariant"]))}
    print("| layout (TP x DP, mbs) | native: printed losses | native: full-precision grad norms "
          "| native: tensors differing from 1 x 1 mbs 1 | tp_invariant: printed losses | tp_invariant: grad norms "
          "| tp_invariant: tensors differing |")
    print("|---|---|---|---|---|---|---|")
    tensors = {mode: runs[0].tensors() for mode, runs in found.items()}
    for index, layout in enumerate(grid):
        cells = []
        for mode, runs in found.items():
            run, reference = runs[index], runs[0]
            if index == 0:
                cells += [_losses(run), _norms(run), "--"]
            else:
                cells += [_same(_losses(run), _losses(reference)), _same(_norms(run), _norms(reference)),
                          _differ(tensors[mode], run)]
        print(f"| {_txd(layout)}, mbs {layout.mbs} | {' | '.join(cells)} |", flush=True)


def tied(checkout: Path, work: Path, timeout: float) -> None:
    grid = (L(), L(mbs=2), L(dp=2), L(dp=3, mbs=4))
    runs = [layouts.train(checkout, work, layout, MODES["tp_invariant"], probe=PROBE, iters=1, label="tied",
                          llama=TIED, timeout=timeout) for layout in grid]
    reference = runs[0].tensors()
    assert "embedding.word_embeddings.weight" in reference and "output_layer.weight" not in reference
    print("| layout (TP x DP, mbs) | printed loss | grad norm, with the tied rule | tensors differing from 1 x 1 mbs 1 |")
    print("|---|---|---|---|")
    for run in runs:
        first = run is runs[0]
        print(f"| {_txd(run.layout)}, mbs {run.layout.mbs} | {_losses(run) if first else _same(_losses(run), _losses(runs[0]))} "
              f"| {_norms(run) if first else _same(_norms(run), _norms(runs[0]))} "
              f"| {'--' if first else _differ(reference, run)} |", flush=True)
    print("\nAcross pipeline depths (Megatron-LM seeds each stage's weights differently: resumed from one "
          "checkpoint saved at 1 x 1 x 1 after one step, the second step compared with never stopping):\n")
    print("| optimizer | resumed at (TP x DP x PP, mbs) | grad norm, step 2 | tensors differing from the uninterrupted run |")
    print("|---|---|---|---|")
    for optimizer, extra in (("plain", ()), ("distributed", DISTOPT)):
        runs = layouts.experiment(checkout, work / f"pp-{optimizer}", MODES["tp_invariant"],
                                  [L(pp=2), L(dp=2, pp=2, mbs=2)], probe=PROBE, save_at=1, iters=2, extra=extra,
                                  label="tied", timeout=timeout, llama=TIED)
        full = runs.pop("full")
        reference = full.tensors()
        print(f"| {optimizer} | never stopping (1 x 1 x 1, mbs 1) | {full.exact_norms[1]} | -- |")
        for run in runs.values():
            print(f"| {optimizer} | {_txdxp(run.layout)}, mbs {run.layout.mbs} "
                  f"| {_same(run.exact_norms[0], full.exact_norms[1])} | {_differ(reference, run)} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", nargs="+", choices=(*TABLES, "all"), default=["all"],
                        help="which table(s) of results/tp_invariant_layouts.md (default: all)")
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (default: the pinned core_v0.16.1 tarball)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a job may run (8 ranks on 2 cores are slow)")
    args = parser.parse_args()
    chosen = TABLES if "all" in args.table else [t for t in TABLES if t in args.table]
    run = {"fresh": fresh, "resume": resume, "mbs": mbs, "native-mbs": native_mbs, "tied": tied}
    with tempfile.TemporaryDirectory() as tmp:
        checkout = args.megatron_lm or mlm.pinned_checkout(Path(tmp) / "src")
        for table in chosen:
            start = time.monotonic()
            print(f"\n### --table {table}\n", flush=True)
            run[table](checkout, Path(tmp) / table, args.timeout)
            print(f"\n--table {table}: wall time {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
