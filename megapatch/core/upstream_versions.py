"""Versions of the packages megapatch patches, as the running process sees them, and the ranges
each patch supports.

A version is read from the module actually in use: the imported module when it is imported
(a Megatron-LM checkout on ``PYTHONPATH`` says ``megatron.core.package_info.__version__``; an NGC
torch says ``torch.__version__``), else from the file that ``import`` would load (found on
``sys.path`` without importing it), and only then from distribution metadata, which can describe
a different copy (a megatron-core wheel shadowed by a checkout). Never imports torch or megatron.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from typing import Dict, List, Optional, Tuple

log = logging.getLogger("megapatch")

# distribution names tried, in order, for each package we report
_DISTRIBUTIONS = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core", "megatron_core"),
    "transformer-engine": ("transformer-engine", "transformer_engine", "transformer-engine-cu12",
                           "transformer-engine-cu13"),
    "wrapt": ("wrapt",),
}
# (module holding the version, its attribute, file under the top-level package defining it)
_MODULES = {
    "torch": ("torch", "__version__", "version.py"),
    "megatron-core": ("megatron.core.package_info", "__version__", "core/package_info.py"),
    "transformer-engine": ("transformer_engine", "__version__", None),
    "wrapt": ("wrapt", "__version__", None),
    # (no file: Bridge's package_info.py runs `git rev-parse` when executed)
    "megatron-bridge": ("megatron.bridge.package_info", "__version__", None),
}
# a module imported means its version module is loaded (or cheap to load: plain constants)
_IMPORTED_WHEN = {"megatron-core": "megatron.core", "megatron-bridge": "megatron.bridge"}

#: Stacks that drive megatron-core but that megapatch does not patch, with the versions megapatch
#: was run under (docs/stack.md section 6): package -> (the module whose import triggers the check,
#: the tested specifier). Outside it megapatch warns once; it never refuses, since nothing of the
#: stack's own code is wrapped (the megatron-core patches check their surfaces as always).
STACKS_TESTED = {"megatron-bridge": ("megatron.bridge", ">=0.6.2,<0.6.3")}


def version_info(package: str) -> Tuple[Optional[str], Optional[str]]:
    """``(version, where it was read)``, or ``(None, None)`` when the package is absent."""
    module_name, attr, file = _MODULES.get(package, (package.replace("-", "_"), "__version__", None))
    if _IMPORTED_WHEN.get(package, module_name) in sys.modules:
        try:
            module = sys.modules.get(module_name) or __import__(module_name, fromlist=["_"])
            value = getattr(module, attr, None)
        except Exception:  # noqa: BLE001 -- a broken version module: fall through to metadata
            value = None
        if value is not None:
            return str(value), f"imported {module_name}"
    if file is not None:
        found = _version_from_file(module_name.split(".")[0], file, attr)
        if found is not None:
            return found
    return _version_from_metadata(package)


def version_of(package: str) -> Optional[str]:
    """Version string of ``package`` or None when it is not installed."""
    return version_info(package)[0]


def installed_versions() -> Dict[str, Optional[str]]:
    found = {"python": platform.python_version()}
    found.update({name: version_of(name) for name in _DISTRIBUTIONS})
    return found


def describe_versions() -> str:
    """One line for error messages: 'torch 2.13.0, megatron-core 0.16.1, transformer-engine absent'."""
    return ", ".join(f"{name} {ver or 'absent'}" for name, ver in installed_versions().items())


def _version_from_file(top: str, relative: str, attr: str) -> Optional[Tuple[str, str]]:
    """Execute the version file ``import`` would load (plain constants), without importing."""
    from importlib.machinery import PathFinder

    try:
        spec = PathFinder.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = os.path.join(location, relative)
        if not os.path.isfile(path):
            continue
        namespace = {"__name__": f"_megapatch_version_of_{top}", "__file__": path}
        try:
            with open(path, encoding="utf-8") as f:
                exec(compile(f.read(), path, "exec"), namespace)  # noqa: S102 -- upstream constants
        except Exception:  # noqa: BLE001 -- not plain constants: use metadata instead
            return None
        value = namespace.get(attr)
        return (str(value), f"file {path}") if value is not None else None
    return None


def _version_from_metadata(package: str) -> Tuple[Optional[str], Optional[str]]:
    import importlib.metadata

    for dist in _DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(dist), f"distribution {dist}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


# -- supported ranges (declared on each patch: Patch.supports) -----------------------------------

def supported_range(patch) -> Dict[str, str]:
    """``{package: specifier}`` the patch is supported on (tested), e.g. ``{"megatron-core":
    ">=0.13,<0.21"}``; empty when it declares none."""
    return dict(getattr(patch, "supports", None) or {})


def in_range(version: str, specifier: str) -> bool:
    """Whether ``version`` satisfies ``specifier``; a pre-release or local build of a version in
    range counts (``2.8.0a0+nv25.5`` satisfies ``>=2.4``)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return SpecifierSet(specifier).contains(parsed, prereleases=True)


def outside_range(patch) -> List[str]:
    """One line per installed package outside the patch's supported range (absent ones: none)."""
    found = []
    for package, specifier in supported_range(patch).items():
        version = version_of(package)
        if version is not None and not in_range(version, specifier):
            found.append(f"{package} {version} is outside {patch.name}'s supported range {specifier}")
    return found


_warned: set = set()


def untested_stack(package: str) -> Optional[str]:
    """The warning for ``package`` of :data:`STACKS_TESTED` when its installed version is outside
    the tested range, else None (also when it is absent)."""
    version = version_of(package)
    _module, specifier = STACKS_TESTED[package]
    if version is None or in_range(version, specifier):
        return None
    return (f"{package} {version} is outside the versions megapatch was run under ({specifier}); "
            f"megapatch patches the megatron-core it drives as usual, check the job log's "
            f"'megapatch enabled' line and docs/stack.md for what was tried")


def warn_if_untested_stack(package: str) -> bool:
    """One warning per process and version (:func:`untested_stack`); True when it warned."""
    line = untested_stack(package)
    if line is None or line in _warned:
        return False
    _warned.add(line)
    log.warning("megapatch: %s", line)
    return True


def warn_if_unsupported(patch) -> None:
    """Warn once per process and version when a patch installs on an untested version. A version
    alone never refuses: the patch's upstream-surface check decides whether it can apply."""
    for line in outside_range(patch):
        if line in _warned:
            continue
        _warned.add(line)
        log.warning("megapatch: %s (untested there; the upstream surface it wraps checked out)", line)
