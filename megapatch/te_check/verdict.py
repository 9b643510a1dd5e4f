"""The TE wiring verdict for the installed Transformer Engine, computed once per installation.

The static check (``megapatch.te_check.wiring``: ``ast`` over ~220 TE source files, seconds of CPU)
gives the same answer for the same TE sources and the same megapatch, so its result is kept in
``$XDG_CACHE_HOME/megapatch/te-wiring/`` (default ``~/.cache/megapatch/te-wiring/``), keyed by the
TE version, the size and modification time of every TE ``pytorch`` source file (a reinstalled or
edited TE gets a new key) and the hash of megapatch's own checker and TE patch. Every rank of
every later job reads one small file instead of re-parsing TE; the checker is imported only on a
miss. An unwritable cache directory means no cache (the check runs each time), never an error.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from typing import Optional, Tuple

log = logging.getLogger("megapatch")

PKG = ("transformer_engine", "pytorch")
_CHECKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wiring.py")
# the modules the checker is split into (``wiring`` imports them): an edit of any of them is an edit
# of the checker, so they are hashed into the key with it
_CHECKER_PARTS = tuple(os.path.join(os.path.dirname(_CHECKER), name)
                       for name in ("sources.py", "definitions.py", "call_sites.py"))


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megapatch", "te-wiring")


def installed_root() -> Optional[str]:
    """The directory holding the ``transformer_engine`` package import would load, or None."""
    found = importlib.util.find_spec("transformer_engine")
    if found is None or not found.submodule_search_locations:
        return None
    return os.path.dirname(list(found.submodule_search_locations)[0])


def installation_key(root: str, spec) -> str:
    """sha256 over TE's version, its ``pytorch`` sources' (path, size, mtime) and megapatch's side
    (the checker and the patch module ``spec`` whose wiring it checks): equal keys, equal verdicts."""
    from megapatch.core.upstream_versions import version_of

    digest = hashlib.sha256()
    digest.update(f"te {version_of('transformer-engine')}\n".encode())
    for path in (_CHECKER, *_CHECKER_PARTS, spec.__file__):
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    top = os.path.join(root, *PKG)
    for folder, dirs, files in os.walk(top):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                st = os.stat(path)
                digest.update(f"{os.path.relpath(path, top)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def verdict(root: str, spec, use_cache: bool = True) -> Tuple[Tuple[str, ...], str]:
    """``(problems, where the verdict came from)``: ``"cache <file>"``, ``"checked"`` (and
    stored), or ``"checked (not cached: <why>)"``."""
    key = installation_key(root, spec)
    path = os.path.join(cache_dir(), f"{key}.json")
    if use_cache:
        try:
            with open(path) as f:
                stored = json.load(f)
            if stored.get("key") == key:
                return tuple(stored["problems"]), f"cache {path}"
        except (OSError, ValueError, KeyError):
            pass
    from megapatch.te_check import wiring  # the static checker: only on a cache miss
    from megapatch.te_check.sources import Sources

    problems = tuple(wiring.check(Sources.tree(root, label=f"installed TE at {root}"), spec))
    if not use_cache:
        return problems, "checked"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "te_root": root, "problems": list(problems)}, f, indent=1)
        os.replace(tmp, path)  # atomic: concurrent ranks each write a whole file
    except OSError as exc:
        return problems, f"checked (not cached: {exc})"
    return problems, "checked"


@functools.lru_cache(maxsize=None)
def _problems(root: str, spec) -> Tuple[str, ...]:
    problems, origin = verdict(root, spec)
    log.debug("megapatch: TE wiring verdict for %s from %s", root, origin)
    return problems


def installed_problem(spec) -> Optional[str]:
    """None when the installed TE's sources are wired as the patch module ``spec`` relies on (or
    when no sources are installed: then only the run-time self-checks guard the patch), else the
    reason."""
    root = installed_root()
    if root is None or not os.path.exists(os.path.join(root, *PKG, "module", "linear.py")):
        log.warning("megapatch: Transformer Engine's Python sources are not installed; the TE "
                    "wiring check was skipped")
        return None
    problems = _problems(root, spec)
    if not problems:
        return None
    shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
    return f"the installed Transformer Engine is not wired as megapatch relies on: {shown}"
