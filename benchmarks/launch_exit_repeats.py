"""Does a finished Megatron-LM job exit cleanly, every time? (issue 19 item 4)

Repeats ``megapatch-run --tp-reduce-dtype fp32 torchrun --nproc-per-node 2 -m
megapatch.testing.ranks.cpu_launch pretrain_gpt.py <tiny GPT flags>`` N times and counts the launches
whose exit code is not 0 and those where a rank printed ``terminate called without an active
exception`` (the SIGABRT seen after ``[after training is done]`` in 1 of 3 such launches).

``--entry finalising`` runs the same launcher but leaves the interpreter the normal way after the
script finished (what ``cpu_launch`` did before it exited without interpreter finalisation), to
show how often the abort happens without the fix on this machine.

    python benchmarks/launch_exit_repeats.py [--repeats 20] [--entry cpu_launch|finalising]
        [--revision core_v0.16.1|main-d98e8a64] [--out results/launch_exit.md]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megapatch.testing.ranks import megatron_lm_runs as mlm  # noqa: E402

ABORT = "terminate called without an active exception"
# the launcher as it was before the fix: the script finishes, then the interpreter finalises
FINALISING = ("import sys; from megapatch.testing.ranks import cpu_launch; "
              "cpu_launch._leave = lambda code: sys.exit(code) if code else None; "
              "cpu_launch.main(sys.argv[1:])")
ENTRIES = {
    "cpu_launch": ["-m", "megapatch.testing.ranks.cpu_launch"],
    "finalising": ["--no-python", sys.executable, "-c", FINALISING],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--entry", choices=sorted(ENTRIES), default="cpu_launch")
    p.add_argument("--revision", choices=sorted(mlm.TARBALLS), default="core_v0.16.1")
    p.add_argument("--tarballs", default=str(REPO.parent / "shared" / "megatron-lm"))
    p.add_argument("--out", default=None, help="append a markdown section to this file")
    args = p.parse_args(argv)
    too_old = mlm.python_too_old(args.revision)
    if too_old:
        p.error(too_old)
    checkout = mlm.unpack(Path(args.tarballs) / mlm.TARBALLS[args.revision], Path(tempfile.mkdtemp()))
    flags = mlm.tiny_gpt_flags(tp=2, iters=3, hidden=64, layers=2, vocab=255)
    # megapatch-run sets the variable and execs torchrun, as a user's launch line does
    entry = [*ENTRIES[args.entry], "pretrain_gpt.py", *flags]
    command = [sys.executable, "-m", "megapatch.commands.launcher", "--tp-reduce-dtype", "fp32", "--",
               sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *entry]
    codes, aborts, trained, seconds = collections.Counter(), 0, 0, []
    for i in range(args.repeats):
        run = mlm.launch_command(checkout, command, timeout=600)
        codes[run.returncode] += 1
        aborts += ABORT in run.log
        trained += sorted(run.losses) == [1, 2, 3]
        seconds.append(run.seconds)
        print(f"launch {i + 1}/{args.repeats}: exit {run.returncode}, trained {sorted(run.losses) == [1, 2, 3]}, "
              f"abort printed {ABORT in run.log}, {run.seconds:.0f} s", flush=True)
    shown = "torchrun " + " ".join(command[command.index("torch.distributed.run") + 1:]).replace(sys.executable, "python")
    text = (f"\n## {args.entry}, Megatron-LM {args.revision}, Python {sys.version.split()[0]} "
            f"({time.strftime('%Y-%m-%d')})\n\n"
            f"`python benchmarks/launch_exit_repeats.py --repeats {args.repeats} --entry {args.entry} "
            f"--revision {args.revision}`: {args.repeats} launches of `megapatch-run --tp-reduce-dtype fp32 "
            f"{shown}`\n\n"
            f"| launches | trained 3 iterations | exit codes | a rank printed `{ABORT}` | seconds per launch |\n"
            f"|---|---|---|---|---|\n"
            f"| {args.repeats} | {trained} | {', '.join(f'{c}: {n}' for c, n in sorted(codes.items()))} | "
            f"{aborts} | {min(seconds):.0f}-{max(seconds):.0f} |\n")
    print(text)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text)
    return 0 if args.entry == "finalising" or (codes == {0: args.repeats} and not aborts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
