"""Installed versions of the packages megapatch reports on and checks against."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Dict, Optional

# distribution names tried, in order, for each package we report
_DISTRIBUTIONS = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core", "megatron_core"),
    "transformer-engine": ("transformer-engine", "transformer_engine", "transformer-engine-cu12",
                           "transformer-engine-cu13"),
    "wrapt": ("wrapt",),
}
# module attribute used when no distribution metadata exists (e.g. a source checkout on PYTHONPATH)
_MODULE_FALLBACK = {
    "megatron-core": ("megatron.core.package_info", "__version__"),
    "transformer-engine": ("transformer_engine", "__version__"),
}


def version_of(package: str) -> Optional[str]:
    """Version string of ``package`` or None when it is not installed. Never imports torch."""
    for dist in _DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    fallback = _MODULE_FALLBACK.get(package)
    if fallback and fallback[0].split(".")[0] in sys.modules:
        module = sys.modules.get(fallback[0])
        if module is not None:
            return getattr(module, fallback[1], None)
    return None


def installed_versions() -> Dict[str, Optional[str]]:
    found = {"python": platform.python_version()}
    found.update({name: version_of(name) for name in _DISTRIBUTIONS})
    return found


def describe_versions() -> str:
    """One line for error messages: 'torch 2.13.0, megatron-core 0.16.1, transformer-engine absent'."""
    return ", ".join(f"{name} {ver or 'absent'}" for name, ver in installed_versions().items())
