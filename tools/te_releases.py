"""The Transformer Engine releases megapatch claims, and their source-only wheels: the list
(``tools/te_wiring_versions.json``, version -> sha256), a download cache and ``pip download``.

Used by ``tools/te_wiring_check.py``, ``tests/test_tp_reduce_transformer_engine_wiring.py`` and
``benchmarks/startup_cost.py``; never by a training job (the runtime checks the installed TE with
``megapatch.te_check``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import subprocess
import sys
from typing import Dict, Optional

DIST = "transformer-engine"
CACHE_ENV = "MPDEV_TE_SRC_CACHE"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "megapatch", "te-src")
VERSIONS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "te_wiring_versions.json")


def claimed_versions(path: str = VERSIONS_FILE) -> Dict[str, str]:
    """``{version: sha256 of transformer_engine-<version>-py3-none-any.whl}``."""
    with open(path) as f:
        return dict(json.load(f)["versions"])


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or DEFAULT_CACHE


def wheel_name(version: str) -> str:
    return f"transformer_engine-{version}-py3-none-any.whl"


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(version: str, dest: str, timeout: float = 120) -> str:
    """``pip download`` the source-only wheel of one release into ``dest``; its path."""
    os.makedirs(dest, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", dest, f"{DIST}=={version}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    path = os.path.join(dest, wheel_name(version))
    if result.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()[-800:]}")
    return path


def ensure_wheels(versions: Dict[str, str], dest: Optional[str] = None, fetch: bool = True,
                  jobs: int = 8) -> Dict[str, str]:
    """``{version: wheel path}``, downloading what the cache lacks (in parallel) when ``fetch``;
    every wheel's sha256 must be the claimed one. Raises RuntimeError naming what failed."""
    dest = dest or cache_dir()
    paths = {v: os.path.join(dest, wheel_name(v)) for v in versions}
    if fetch:  # a partial or stale download is fetched again
        for version, path in paths.items():
            if os.path.exists(path) and sha256(path) != versions[version]:
                os.remove(path)
    missing = [v for v, p in paths.items() if not os.path.exists(p)]
    if missing and not fetch:
        raise RuntimeError(f"no cached wheel for TE {', '.join(missing)} in {dest} "
                           f"(run tools/te_wiring_check.py --download)")
    errors = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(download, v, dest): v for v in missing}
        for future in concurrent.futures.as_completed(futures):
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 -- reported all together below
                errors.append(f"TE {futures[future]}: {exc}")
    if errors:
        raise RuntimeError("downloading Transformer Engine source wheels failed:\n  " + "\n  ".join(errors))
    for version, path in paths.items():
        found = sha256(path)
        if found != versions[version]:
            raise RuntimeError(f"{path}: sha256 {found}, expected {versions[version]} "
                               f"(tools/te_wiring_versions.json)")
    return paths
