"""Per-iteration losses printed by Megatron-LM's own ``pretrain_gpt.py`` at TP=1 and TP=2, under
``native``, ``fp32`` and ``fp32-accumulate`` TP reductions, each run switched only by
``MEGAPATCH_TP_REDUCE_DTYPE`` (CPU ranks, gloo, ``torchrun -m megapatch.testing.ranks.cpu_launch``).
Writes a markdown table with the exact commands.

    python benchmarks/megatron_lm_losses.py                       # pinned core_v0.16.1 tarball
    python benchmarks/megatron_lm_losses.py --revision main-d98e8a64 --out results/megatron_lm_losses_main.md
    python benchmarks/megatron_lm_losses.py --checkout /path/to/Megatron-LM

Same seed, same mock data, same initial weights (``--use-cpu-initialization`` builds the full
master weights and splits them) in every run; no dropout. Megatron-LM prints ``lm loss`` with 7
significant digits, so differences below ~5e-7 relative do not show.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megapatch.testing.ranks import megatron_lm_runs as mlm  # noqa: E402

# vocab 511 (+1 NullTokenizer EOD) pads to 512 rows at TP=1 and TP=2 alike: the same initial model
# a small learning rate: with lr 3e-3 the runs decorrelate within ~10 steps (training amplifies
# any difference) and the per-iteration gap stops measuring the reductions
MODEL = dict(layers=2, hidden=512, heads=8, seq=128, vocab=511, micro_batch=2, global_batch=4,
             lr=1e-5)
RUNS = [  # (column, TP, sequence parallel, MEGAPATCH_TP_REDUCE_DTYPE or None)
    ("TP1 native", 1, False, None),
    ("TP2 native", 2, False, None),
    ("TP2 fp32", 2, False, "fp32"),
    ("TP2 fp32-accumulate", 2, False, "fp32-accumulate"),
]
# TP2 + --sequence-parallel is not run: megatron-core's local layer spec refuses sequence
# parallelism with torch's LayerNorm (WrappedTorchNorm), and Apex / TE norms need CUDA.


def _shell(run: mlm.Run, env: dict) -> str:
    prefix = " ".join(f"{k}={v}" for k, v in sorted(env.items()))
    args = run.command[1:]  # drop the interpreter path: `python -m torch.distributed.run` == torchrun
    args = ["torchrun", *args[3:]] if args[:2] == ["-m", "torch.distributed.run"] else args
    return (prefix + " " if prefix else "") + "CUDA_DEVICE_MAX_CONNECTIONS=1 " + shlex.join(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--revision", default="core_v0.16.1", choices=sorted(mlm.TARBALLS))
    parser.add_argument("--tarballs", default=os.environ.get(
        "MEGATRON_LM_TARBALLS", str(REPO.parent / "shared" / "megatron-lm")))
    parser.add_argument("--checkout", default=os.environ.get(mlm.USER_CHECKOUT_ENV),
                        help="an existing Megatron-LM checkout (default: unpack --revision)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "results" / "megatron_lm_losses.md"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="megatron-lm-losses-") as tmp:
        if args.checkout:
            checkout, source = Path(args.checkout), f"checkout {args.checkout}"
        else:
            reason = mlm.python_too_old(args.revision)
            if reason:
                raise SystemExit(reason)
            tarball = Path(args.tarballs) / mlm.TARBALLS[args.revision]
            checkout, source = mlm.unpack(tarball, Path(tmp)), f"Megatron-LM {args.revision} ({tarball.name})"
        losses, commands = {}, {}
        for column, tp, sp, mode in RUNS:
            env = {"MEGAPATCH_TP_REDUCE_DTYPE": mode} if mode else {}
            flags = mlm.tiny_gpt_flags(tp=tp, sequence_parallel=sp, iters=args.iters, **MODEL)
            run = mlm.launch(checkout, flags, nproc=tp, megapatch_env=env, timeout=1800)
            if run.returncode != 0 or len(run.losses) != args.iters:
                raise SystemExit(f"{column} failed ({run.returncode}):\n{run.tail()}")
            if mode and f"tp_reduce_dtype={mode} (env MEGAPATCH_TP_REDUCE_DTYPE)" not in run.log:
                raise SystemExit(f"{column}: the job log does not show megapatch enabled:\n{run.tail()}")
            losses[column], commands[column] = run.losses, _shell(run, env)
            print(f"{column}: {run.seconds:.0f} s", flush=True)

    columns = [c for c, *_ in RUNS]
    reference = losses["TP1 native"]
    if abs(float(losses["TP2 native"][1]) - float(reference[1])) > 1e-3:
        raise SystemExit("TP=1 and TP=2 did not start from the same model (padded vocab?)")
    lines = [
        "# Megatron-LM `pretrain_gpt.py` losses: TP=1 vs TP=2, native vs megapatch TP reductions",
        "",
        f"Produced by `{shlex.join(['python', 'benchmarks/megatron_lm_losses.py', *sys.argv[1:]])}`",
        f"on CPU ranks (gloo), {source}, Python {sys.version.split()[0]}. Tiny GPT: "
        + ", ".join(f"{k} {v}" for k, v in MODEL.items()) + f", BF16, {args.iters} iterations, "
        "seed 1234, mock data, no dropout. `lm loss` as Megatron-LM prints it (7 significant digits).",
        "",
        "| iteration | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for i in range(1, args.iters + 1):
        lines.append(f"| {i} | " + " | ".join(losses[c][i] for c in columns) + " |")
    stats = {c: mlm.mean_abs_difference(losses[c], reference) for c in columns}
    lines.append("| **mean abs(loss - TP1 native)** | " + " | ".join(f"{stats[c]:.3e}" for c in columns) + " |")
    lines.append("| **max abs(loss - TP1 native)** | " + " | ".join(
        f"{max(abs(float(losses[c][i]) - float(reference[i])) for i in reference):.3e}" for c in columns) + " |")
    lines.append("| **iterations printing TP1's loss** | " + " | ".join(
        f"{sum(losses[c][i] == reference[i] for i in reference)}/{args.iters}" for c in columns) + " |")
    lines += ["", "Commands (run from the checkout root; `megatron` is the checkout's):", ""]
    lines += [f"* {c}: `{commands[c]}`" for c in columns]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
