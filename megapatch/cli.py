"""Command line: ``megapatch doctor`` and ``megapatch demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="megapatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, per-patch upstream compatibility, what the environment enables")
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
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
