"""Megatron-LM's ``pretrain_gpt.py`` with Transformer Engine layers on a Qwen3-MoE-shaped model, in
every mode, on CPU gloo ranks (issue 39 item 4).

The flags: the Llama flags of ``megapatch.testing.scenarios.layouts`` plus ``layouts.MOE`` (8 experts
top-2 with SwiGLU FFN 32, the alltoall dispatcher, QK RMSNorm, aux and z losses: the shape of
``examples/rl/model_configs/qwen3_30b_a3b_moe.sh`` scaled down), ``--transformer-impl
transformer_engine`` and ``--sequence-parallel`` (upstream requires it for MoE with TP; Megatron-LM
turns it off at TP 1): TE's ``TELayerNormColumnParallelLinear``, ``TERowParallelLinear``,
``TEDotProductAttention`` (its unfused backend: the CPU allows no flash or cuDNN attention) and
routed experts as TE linears in a ``SequentialMLP`` (``--grouped-gemm``: TE's grouped-GEMM experts,
``TEGroupedMLP``), through the CPU launcher's ``--te`` (the labelled TE runtime). Figures:
results/te_moe_megatron_lm.md. Per mode (native, ``fp32``, ``tp_invariant``): trained at TP 2 and saved at iteration 1,
then resumed at TP 1 and TP 4 to iteration 3 (against the uninterrupted TP 2 run), and the weights
alone resumed at TP 2 x EP 1 and at TP 2 x EP 2 x DP 2 (a fresh optimizer: Megatron-LM's optimizer
state does not reshard to another EP size; EP 2 against EP 1): the printed losses, the
full-precision grad norms (the test probe's record) and how many of
the final checkpoint's tensors (parameters, FP32 main parameters, Adam moments) differ, and by how much.

    python benchmarks/te_moe_megatron_lm.py [--megatron-lm DIR] [--modes native,fp32,tp_invariant] [--grouped-gemm]

Needs a venv with Transformer Engine (``../shared/te-cpu/install.sh``). Only ``tp_invariant``
promises bits; ``fp32`` makes layouts agree more closely (routing flips rarer, not impossible) and
does not bring BF16 nearer an FP32 reference than TP 1's own BF16 error.
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
TE = ("--transformer-impl", "transformer_engine", "--sequence-parallel")  # upstream: MoE at TP > 1 needs SP (off at TP 1)
MODES = {"native": {}, "fp32": {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}, "tp_invariant": {"MEGAPATCH_TP_INVARIANT": "1"}}
L = layouts.Layout


def _resumes(checkout, work, env, mode, te=TE):
    """The uninterrupted TP 2 run and its resumes, by label (``te``: the TE flags)."""
    common = dict(probe=PROBE, save_at=1, iters=3, global_batch=4, launcher=("--te",), timeout=900)
    runs = layouts.experiment(checkout, work, env, [L(tp=1), L(tp=4)], base=L(tp=2), label=f"{mode}",
                              extra=(*layouts.MOE, *te), **common)
    # EP: Megatron-LM's optimizer state does not reshard to another EP size ("Expected 2 entries in state
    # dict, but got 3"), and its CPU initialisation draws experts from an EP-dependent RNG stream; so both
    # EP sizes resume the weights alone (a fresh optimizer, the RNG state not loaded: no dropout draws)
    start = runs["full"].checkpoint.parent
    weights_only = ("--no-load-optim", "--no-load-rng")
    for ep, layout in ((1, L(tp=2)), (2, L(tp=2, dp=2))):
        found = layouts.experiment(checkout, work, env, [layout], start=start, label=f"{mode}-weights-ep{ep}",
                                   extra=(*layouts.MOE, *te, "--expert-model-parallel-size", str(ep), *weights_only),
                                   **common)
        runs[f"weights only, EP {ep}: {layout.label}"] = found[layout.label]
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (default: the pinned core_v0.16.1 tarball)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--grouped-gemm", action="store_true",
                        help="grouped-GEMM experts (--moe-grouped-gemm: TE's TEGroupedMLP) instead of sequential ones")
    args = parser.parse_args()
    te = (*TE, "--moe-grouped-gemm") if args.grouped_gemm else TE
    with tempfile.TemporaryDirectory() as tmp:
        checkout = args.megatron_lm or mlm.pinned_checkout(Path(tmp) / "src")
        for mode in args.modes.split(","):
            runs = _resumes(checkout, Path(tmp) / mode, MODES[mode], mode, te)
            full = runs.pop("full")
            print(f"{mode}: uninterrupted TP 2: losses {[full.losses[i] for i in sorted(full.losses)]}, "
                  f"norms {full.exact_norms}", flush=True)
            ep1 = next(run for label, run in runs.items() if label.startswith("weights only, EP 1"))
            for label, run in runs.items():
                # the resumes against the uninterrupted run; EP 2 against EP 1 (both weights only)
                against = ep1 if label.startswith("weights only, EP 2") else full
                if label.startswith("weights only, EP 1"):
                    continue
                differ = tp_resume.differences(against.tensors(), run.tensors())
                largest = max(differ.values(), default=0.0)
                print(f"{mode} {label}: losses {[run.losses[i] for i in sorted(run.losses)]}, norms "
                      f"{run.exact_norms} (against {against.exact_norms[-2:]}), "
                      f"{len(differ)} of {len(against.tensors())} "
                      f"tensors differ (largest {largest:.3g})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
