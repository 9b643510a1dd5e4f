#!/usr/bin/env python3
"""Check, statically, that every claimed Transformer Engine release is wired as megapatch's TE
patch (patches/tp_reduce/transformer_engine.py) relies on.

For each release in tools/te_wiring_versions.json it reads the Python sources of
``transformer_engine-<version>-py3-none-any.whl`` (~1 MB, sources only; no TE install, no GPU)
with ``ast`` and runs ``megapatch.te_check.wiring.check`` (see that module for what is checked).

    python tools/te_wiring_check.py --download            # fetch missing wheels, check all
    python tools/te_wiring_check.py --versions 2.20.2     # one release, from the cache
    python tools/te_wiring_check.py --tree /path/to/site-packages   # an installed TE too

Wheels are cached in ~/.cache/megapatch/te-src (or $MPDEV_TE_SRC_CACHE, or --cache-dir) and
fetched with ``python -m pip download --no-deps --only-binary=:all: transformer-engine==<v>``;
each wheel's sha256 must match versions.json. Exit status: 0 all clean, 1 wiring problems,
2 wheels missing or failing to download.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import te_releases  # noqa: E402 -- beside this file
from megapatch.patches.tp_reduce import transformer_engine as spec  # noqa: E402
from megapatch.te_check import wiring  # noqa: E402
from megapatch.te_check.sources import Sources  # noqa: E402


def _check_wheel(args):
    version, path = args
    return version, wiring.check(Sources.wheel(path, label=version), spec)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--download", action="store_true", help="download wheels missing from the cache")
    parser.add_argument("--cache-dir", default=None, help=f"wheel cache (default {te_releases.cache_dir()})")
    parser.add_argument("--versions", nargs="*", help="only these releases (default: all claimed)")
    parser.add_argument("--tree", action="append", default=[],
                        help="also check an installed tree (a folder holding transformer_engine/)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)

    claimed = te_releases.claimed_versions()
    wanted = args.versions or list(claimed)
    unknown = [v for v in wanted if v not in claimed]
    if unknown:
        print(f"not claimed in {te_releases.VERSIONS_FILE}: {', '.join(unknown)}", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        paths = te_releases.ensure_wheels({v: claimed[v] for v in wanted}, args.cache_dir, fetch=args.download)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fetched = time.monotonic() - start
    results = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for version, problems in pool.map(_check_wheel, paths.items()):
            results[version] = problems
    for root in args.tree:
        results[f"tree {root}"] = wiring.check(Sources.tree(root), spec)
    bad = 0
    for label, problems in results.items():
        print(f"TE {label}: " + ("wiring as megapatch relies on" if not problems else f"{len(problems)} problem(s)"))
        for problem in problems:
            print(f"    {problem}")
        bad += bool(problems)
    print(f"{len(results) - bad} clean, {bad} with problems "
          f"(wheels {fetched:.1f} s, total {time.monotonic() - start:.1f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
