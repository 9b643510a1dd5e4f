"""The patch-surface lock: a recorded fingerprint (signature + source hash) of every upstream
symbol megapatch wraps or relies on, per package version, kept in ``megapatch/commands/surface_lock/`` (it ships with the package).

    megapatch lock            # compare the installed upstream with the lock; exit 1 with a diff
    megapatch lock --update   # (after review) record the installed upstream's fingerprints

A changed fingerprint does not mean a patch is wrong; it means a human must read the upstream
change before the lock is refreshed.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

from megapatch.core import engine, surface
from megapatch.core.registry import Target
from megapatch.core.upstream_versions import version_of

LOCK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "surface_lock")
# megatron.rl ships in Megatron-LM's checkout, not in the megatron-core wheel the locks are taken from:
# its targets are checked where a job imports them (the surface check at install), not locked. Likewise
# megatron-core's Transformer Engine wrappers: without TE they are stand-ins built on a mock, so they are
# checked where TE is installed (at install, and in CI's te stage), with TE's own targets -- as is every
# target of a patch that needs TE (``package="transformer-engine"``: megatron-core's TEGroupedMLP too)
_PACKAGE_OF_MODULE = (("megatron.rl", "megatron-lm"),
                      ("megatron.core.extensions.transformer_engine", "transformer-engine"),
                      ("megatron", "megatron-core"), ("transformer_engine", "transformer-engine"),
                      ("torch", "torch"))


def _package(module: str) -> str:
    for prefix, package in _PACKAGE_OF_MODULE:
        if module == prefix or module.startswith(prefix + "."):
            return package
    return "other"


def _symbols() -> List[Tuple[str, str, Target]]:
    """Every (patch name, package locked under, target) megapatch touches, watched symbols included."""
    found = []
    for patch in engine.patches():
        targets = list(patch.targets)
        for watched in patch.watches:
            module, attr = watched.split(":")
            targets.append(Target(module, attr, wrapper=None, kind="any"))
        for target in targets:
            package = "transformer-engine" if patch.package == "transformer-engine" else _package(target.module)
            found.append((patch.name, package, target))
    return found


def current(packages=("megatron-core", "torch")) -> Dict[str, Dict[str, dict]]:
    """``{package: {symbol path: fingerprint}}`` of the installed versions."""
    result: Dict[str, Dict[str, dict]] = {}
    for patch_name, package, target in _symbols():
        if package not in packages or version_of(package) is None:
            continue
        entry = surface.fingerprint(target)
        entry["patches"] = sorted(set(result.get(package, {}).get(target.path, {}).get("patches", [])) | {patch_name})
        result.setdefault(package, {})[target.path] = entry
    return result


def lock_path(package: str, version: str) -> str:
    return os.path.join(LOCK_DIR, package, f"{version}.json")


def compare(packages=("megatron-core", "torch")) -> Tuple[List[str], List[str]]:
    """``(differences, missing locks)`` between the installed upstream and the recorded lock."""
    differences, missing = [], []
    for package, symbols in current(packages).items():
        version = version_of(package)
        path = lock_path(package, version)
        if not os.path.exists(path):
            missing.append(f"no lock for {package} {version} ({path}); record it with `megapatch lock --update`")
            continue
        with open(path) as fh:
            recorded = json.load(fh)["symbols"]
        for symbol in sorted(set(recorded) | set(symbols)):
            old, new = recorded.get(symbol), symbols.get(symbol)
            if old is None:
                differences.append(f"{package} {version}: {symbol}: not in the lock (a new target?)")
            elif new is None:
                differences.append(f"{package} {version}: {symbol}: in the lock but no patch uses it now")
            else:
                for key in ("present", "signature", "source_sha256"):
                    if old.get(key) != new.get(key):
                        differences.append(f"{package} {version}: {symbol}: {key} changed\n"
                                           f"    locked:    {old.get(key)}\n    installed: {new.get(key)}")
    return differences, missing


def update(packages=("megatron-core", "torch")) -> List[str]:
    written = []
    for package, symbols in current(packages).items():
        path = lock_path(package, version_of(package))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            json.dump({"package": package, "version": version_of(package), "symbols": symbols},
                      fh, indent=1, sort_keys=True)
            fh.write("\n")
        written.append(path)
    return written
