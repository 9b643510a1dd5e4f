"""Command line: ``megapatch doctor`` and ``megapatch demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megapatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, per-patch upstream compatibility, what the environment enables")
    lock = sub.add_parser("lock", help="compare the installed upstream with the patch-surface lock")
    lock.add_argument("--update", action="store_true", help="record the installed upstream (after review)")
    lock.add_argument("--lock-dir", default=None, help="where the lock lives (default: inside the package)")
    demo = sub.add_parser("demo", help="TP-invariance comparison of native vs FP32 reductions on the embedded tiny GPT")
    demo.add_argument("--tp", default="1,2,4,8", help="comma-separated TP sizes (default 1,2,4,8)")
    demo.add_argument("--modes", default="native,fp32-accumulate,fp32")
    demo.add_argument("--plot", default="tp_invariance.png", help="PNG path ('' for none)")
    demo.add_argument("--json", default="", help="write the table as JSON to this path")
    demo.add_argument("--quick", action="store_true", help="smaller model and fewer TP sizes (CI)")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from .doctor import diagnose

        code, text = diagnose()
        print(text)
        return code
    if args.command == "lock":
        from . import lock as surface_lock

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
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
