"""Command line: ``megapatch doctor | status | demo | lock``."""

from __future__ import annotations

import argparse
import json
import sys

EXIT_CODES = """\
exit codes:
  0  OK: everything requested can apply (doctor, status), the demo ran, the lock matches
  1  a requested patch cannot apply, or activation from MEGAPATCH_* fails or never happens
     (doctor, status); the installed upstream differs from the patch-surface lock (lock);
     a demo rank failed
  2  usage error (bad command line), or an invalid MEGAPATCH_* value (doctor, status)
"""


def build_parser() -> argparse.ArgumentParser:
    from megapatch.core.version import __version__
    from megapatch.commands.demo import add_arguments as add_demo_arguments

    parser = argparse.ArgumentParser(
        prog="megapatch", description="Numerics fixes for Megatron-core and Transformer Engine, without a fork.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"megapatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    doctor = sub.add_parser("doctor", help="versions, every patch's upstream compatibility, what the "
                            "environment enables, whether activation works (exit 1 if not)",
                            epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    _launch_argument(doctor)
    doctor.add_argument("flags", nargs=argparse.REMAINDER, metavar="-- [SCRIPT.py] FLAGS",
                        help="a Megatron-LM command line (after --), optionally its script first: what the "
                             "requested options would refuse in the job it starts, before it is submitted")
    status = sub.add_parser("status", help="what the current environment would do: settings and their "
                            "sources, per-patch requested / opted-out / compatible / would install",
                            epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    status.add_argument("--json", action="store_true", help="print the report as JSON (same document as doctor --json)")
    _launch_argument(status)
    status.add_argument("flags", nargs=argparse.REMAINDER, metavar="-- [SCRIPT.py] FLAGS",
                        help="a Megatron-LM command line (after --), as for doctor")
    lock = sub.add_parser("lock", help="compare the installed upstream with the patch-surface lock")
    lock.add_argument("--update", action="store_true", help="record the installed upstream (after review)")
    lock.add_argument("--lock-dir", default=None, help="where the lock lives (default: inside the package)")
    demo = sub.add_parser("demo", help="TP-invariance comparison of native vs FP32 reductions on the embedded tiny GPT")
    add_demo_arguments(demo)
    return parser


def _launch_argument(parser) -> None:
    parser.add_argument("--launch", choices=("here", "cuda", "cpu", "cpu-te"), default=None,
                        help="how the job is launched, for what answers upstream's CUDA checks: here (this "
                             "machine, the default), cuda (GPUs), cpu (megapatch.testing.ranks.cpu_launch), "
                             "cpu-te (cpu_launch --te: its TE runtime answers the compute capability); "
                             "default: $MEGAPATCH_LAUNCH, which cpu_launch sets in its ranks")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("doctor", "status"):
        try:
            from megapatch.commands.doctor import survey
            from megapatch.commands.doctor_text import render_doctor, render_status
        except ImportError as exc:  # megapatch's own requirement (wrapt, packaging) is missing
            message = (f"megapatch {args.command} cannot run: {exc} (megapatch needs wrapt and packaging: "
                       f"pip install megapatch, or pip install wrapt packaging)")
            print(json.dumps({"result": {"code": 1, "message": message}}, indent=1) if args.json else message)
            return 1

        flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
        if flags and not args.flags[:1] == ["--"]:
            parser.error(f"unexpected arguments {' '.join(flags)!r}: put a Megatron-LM command line after --")
        result = survey(flags if args.flags else None, launch=args.launch)
        if args.json:
            print(json.dumps(result, indent=1, default=str))
        else:
            print(render_doctor(result) if args.command == "doctor" else render_status(result))
        return result["result"]["code"]
    if args.command == "lock":
        from megapatch.commands import lock as surface_lock

        if args.lock_dir:
            surface_lock.LOCK_DIR = args.lock_dir
        if args.update:
            for path in surface_lock.update():
                print(f"wrote {path}")
            return 0
        differences, missing = surface_lock.compare()
        for line in missing + differences:
            print(line)
        if not differences and not missing:
            print("the installed upstream matches the patch-surface lock")
        return 1 if differences or missing else 0
    from megapatch.commands.demo import run_demo  # the only command left: argparse takes no other

    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
