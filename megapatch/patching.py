"""Installing and removing wrapt wrappers, ``from``-import aliases included."""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any, Iterable, List, Tuple

import wrapt

from .registry import Target
from .surface import ABSENT, resolve

# Module prefixes never scanned for aliases: they cannot hold copies of upstream functions.
_SKIP_ALIAS_SCAN = ("torch", "numpy", "wrapt", "_", "encodings", "importlib", "collections")


@dataclasses.dataclass
class Installed:
    """A wrapper in place; everything needed to put the original back."""

    target: Target
    owner: Any
    name: str
    original: Any  # as stored in owner.__dict__, or ABSENT when inherited
    wrapper: Any
    aliases: List[Tuple[types.ModuleType, str]]


def is_megapatch_wrapper(obj: Any) -> bool:
    return getattr(obj, "_self_megapatch", None) is not None


def install(target: Target, patch_name: str) -> Installed:
    """Wrap ``target`` with its wrapper. The caller checked the surface first."""
    owner, name, raw = resolve(target)
    if is_megapatch_wrapper(raw):
        raise RuntimeError(f"{target.path} is already wrapped by megapatch ({raw._self_megapatch})")
    wrapper = wrapt.FunctionWrapper(raw, target.wrapper)
    wrapper._self_megapatch = patch_name
    original = owner.__dict__.get(name, ABSENT) if hasattr(owner, "__dict__") else raw
    setattr(owner, name, wrapper)
    aliases: List[Tuple[types.ModuleType, str]] = []
    if target.rebind_aliases and isinstance(owner, types.ModuleType):
        aliases = _rebind(raw, wrapper, skip=owner)
    return Installed(target, owner, name, original, wrapper, aliases)


def uninstall(installed: Installed) -> None:
    """Put the original back on its owner and in every module holding the wrapper."""
    current = installed.owner.__dict__.get(installed.name, ABSENT)
    if current is installed.wrapper:
        if installed.original is ABSENT:
            delattr(installed.owner, installed.name)
        else:
            setattr(installed.owner, installed.name, installed.original)
    # else: someone wrapped on top of ours; leave their wrapper (ours passes through when off)
    original = installed.wrapper.__wrapped__
    for module, name in installed.aliases:
        if module.__dict__.get(name) is installed.wrapper:
            setattr(module, name, original)
    if installed.target.rebind_aliases and isinstance(installed.owner, types.ModuleType):
        # modules imported after install copied the wrapper with `from ... import`
        _rebind(installed.wrapper, original, skip=installed.owner)


def _modules_to_scan(skip: types.ModuleType) -> Iterable[types.ModuleType]:
    for name, module in list(sys.modules.items()):
        if module is None or module is skip or not isinstance(module, types.ModuleType):
            continue
        if name.startswith(_SKIP_ALIAS_SCAN):
            continue
        yield module


def _rebind(old: Any, new: Any, skip: types.ModuleType) -> List[Tuple[types.ModuleType, str]]:
    rebound = []
    for module in _modules_to_scan(skip):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for name, value in list(namespace.items()):
            if value is old:
                setattr(module, name, new)
                rebound.append((module, name))
    return rebound
