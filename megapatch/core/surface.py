"""Resolving upstream targets and checking the surface a patch relies on.

A check looks at what is really there (attribute kind and parameter names), not at version
strings, so a backport or a pre-release is judged by its code.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import sys
import types
from typing import Any, List, Optional, Tuple

from megapatch.core.registry import Target

ABSENT = object()


def resolve(target: Target, import_module: bool = False) -> Tuple[Any, str, Any]:
    """Return ``(owner, name, raw)`` for ``target``; raw is the attribute as stored on its owner
    (a staticmethod stays a staticmethod). Raises LookupError with the missing dotted path."""
    module = sys.modules.get(target.module)
    if module is None:
        if not import_module:
            raise LookupError(f"module {target.module} is not imported")
        module = importlib.import_module(target.module)
    owner, parts = module, target.attr.split(".")
    walked = target.module
    for part in parts[:-1]:
        walked = f"{walked}.{part}"
        if not hasattr(owner, part):
            raise LookupError(f"{walked} does not exist")
        owner = getattr(owner, part)
    name = parts[-1]
    try:
        raw = inspect.getattr_static(owner, name)
    except AttributeError:
        raise LookupError(f"{target.path} does not exist") from None
    return owner, name, raw


def present(target: Target) -> bool:
    try:
        resolve(target)
    except LookupError:
        return False
    return True


def _kind_of(owner: Any, raw: Any) -> str:
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if isinstance(raw, (classmethod, types.ClassMethodDescriptorType)):
        return "classmethod"  # torch >= 2.14 defines Function.apply in C: a classmethod_descriptor
    if inspect.isclass(owner):
        return "method" if callable(raw) else "attribute"
    return "function" if callable(raw) else "attribute"


def callable_of(raw: Any) -> Any:
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def parameter_names(raw: Any) -> Optional[Tuple[str, ...]]:
    try:
        return tuple(inspect.signature(callable_of(raw)).parameters)
    except (TypeError, ValueError):
        return None


def problems(target: Target, import_module: bool = False) -> List[str]:
    """What is wrong with ``target`` on the installed upstream; empty when it is as expected."""
    try:
        owner, _name, raw = resolve(target, import_module=import_module)
    except LookupError as exc:
        return [] if target.optional else [str(exc)]
    except ImportError as exc:
        return [f"cannot import {target.module}: {exc}"]
    found: List[str] = []
    kind = _kind_of(owner, raw) if target.kind != "any" else "any"
    if getattr(raw, "_self_megapatch", None) is not None:
        kind = target.kind  # our own wrapper stands there (already installed): its kind is ours
    if kind != target.kind:
        found.append(f"{target.path} is a {kind}, expected a {target.kind}")
    if target.params is not None:
        names = parameter_names(raw)
        expected = target.params
        if names is None or names[: len(expected)] != expected:
            shown = "(" + ", ".join(names) + ")" if names is not None else "no signature"
            found.append(f"{target.path} takes {shown}, expected it to start with "
                         f"({', '.join(expected)})")
    return found


def fingerprint(target: Target) -> dict:
    """Signature and source hash of a target, for the patch-surface lock."""
    try:
        _owner, _name, raw = resolve(target, import_module=True)
    except (LookupError, ImportError) as exc:
        return {"present": False, "error": str(exc)}
    func = inspect.unwrap(callable_of(raw))
    try:
        signature = str(inspect.signature(func))
    except (TypeError, ValueError):
        signature = None
    try:
        source = inspect.getsource(func)
        digest = hashlib.sha256(inspect.cleandoc(source).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        digest = None
    return {"present": True, "signature": signature, "source_sha256": digest}
