"""Reading call arguments inside wrapt wrappers without binding a full signature each call."""

from __future__ import annotations

from typing import Any, Tuple

_MISSING = object()


def argument(args: tuple, kwargs: dict, index: int, name: str, default: Any = _MISSING) -> Any:
    """The argument passed at position ``index`` or as keyword ``name``."""
    if len(args) > index:
        return args[index]
    if name in kwargs:
        return kwargs[name]
    if default is _MISSING:
        raise TypeError(f"missing argument {name!r}")
    return default


def with_argument(args: tuple, kwargs: dict, index: int, name: str, value: Any) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` with the argument at position ``index`` (or keyword ``name``) set to ``value``,
    passed the way the caller passed it; the caller's tuple and dict are left as they were."""
    if len(args) > index:
        return (*args[:index], value, *args[index + 1:]), kwargs
    return args, {**kwargs, name: value}
