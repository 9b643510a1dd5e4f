"""Installing and removing wrapt wrappers, ``from``-import aliases included.

Every wrapper is a ``MegapatchWrapper``: it carries an on/off switch (a wrapper still referenced
somewhere after its patch was removed passes straight through), runs the cross-rank agreement
check on the first patched call after a reconfiguration, and pickles and copies like the function
it wraps (by reference), as stock functions do.
"""

from __future__ import annotations

import dataclasses
import importlib
import operator
import sys
import types
from typing import Any, Callable, Iterable, List, Optional, Tuple

import wrapt

from megapatch.core import cross_rank
from megapatch.core.registry import Target
from megapatch.core.surface import ABSENT, resolve

# Packages never scanned when aliases are bound at install: they cannot hold copies of upstream
# functions (module names match exactly or as a prefix followed by a dot).
_SKIP_ALIAS_SCAN = ("torch", "numpy", "wrapt", "encodings", "importlib", "collections")
_MAX_CHAIN = 64


_first_call: List[Callable[[], None]] = []  # run at the next call of any switched-on wrapper


def on_first_call(callback: Callable[[], None]) -> None:
    """Run ``callback`` once, at the next call of any switched-on megapatch wrapper (the engine's
    patches line: in a job, the first patched call comes when its model is set up)."""
    if callback not in _first_call:
        _first_call.append(callback)


def _run_first_call() -> None:
    while _first_call:
        try:
            callback = _first_call.pop(0)
        except IndexError:  # another thread ran it
            return
        try:
            callback()
        except Exception:  # noqa: BLE001 -- a report line never breaks the patched call
            pass


class _Switch:
    __slots__ = ("on",)

    def __init__(self):
        self.on = True


class _ModuleByName:
    """Pickles as ``importlib.import_module(name)``: unpickling needs no megapatch."""

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return importlib.import_module, (self.name,)


def _by_reference(func: Any):
    """The reduce value of a function pickled by reference (module + qualified name)."""
    func = getattr(func, "__func__", func)  # staticmethod / classmethod objects
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname:
        raise TypeError(f"cannot pickle {func!r}: not reachable by module and qualified name")
    return operator.attrgetter(qualname), (_ModuleByName(module),)


class MegapatchBoundWrapper(wrapt.BoundFunctionWrapper):
    """A wrapped method bound to an instance: pickles and copies like a bound method."""

    def _instance(self):
        bound = getattr(self, "__self__", None)  # accessed on the class: no instance
        return None if bound is None or isinstance(bound, type) else bound

    def __reduce_ex__(self, protocol):
        instance = self._instance()
        if instance is None:
            return _by_reference(self.__wrapped__)
        return getattr, (instance, self.__name__)

    def __reduce__(self):
        return self.__reduce_ex__(2)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        import copy

        instance = self._instance()
        if instance is None:
            return self
        return getattr(copy.deepcopy(instance, memo), self.__name__)


class MegapatchWrapper(wrapt.FunctionWrapper):
    """megapatch's wrapper around one upstream attribute."""

    __bound_function_wrapper__ = MegapatchBoundWrapper

    def __init__(self, wrapped: Any, wrapper: Any, patch_name: str):
        switch = _Switch()

        def guarded(inner, instance, args, kwargs):
            if not switch.on:
                return inner(*args, **kwargs)
            if cross_rank.pending:
                cross_rank.check_first_call()
            if _first_call:
                _run_first_call()
            return wrapper(inner, instance, args, kwargs)

        super().__init__(wrapped, guarded)
        self._self_megapatch = patch_name
        self._self_switch = switch

    # a function pickles by reference and copy/deepcopy return it unchanged: so does its wrapper
    def __reduce_ex__(self, protocol):
        return _by_reference(self.__wrapped__)

    def __reduce__(self):
        return self.__reduce_ex__(2)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


@dataclasses.dataclass
class Installed:
    """A wrapper in place; everything needed to put the original back."""

    target: Target
    owner: Any
    name: str
    original: Any  # as stored in owner.__dict__, or ABSENT when inherited
    wrapper: Any
    aliases: List[Tuple[types.ModuleType, str]]
    adopted: bool = False  # our wrapper was still in place (under a third-party wrapper)


def find_megapatch_wrapper(obj: Any) -> Optional[MegapatchWrapper]:
    """Our wrapper in ``obj``'s ``__wrapped__`` chain (third-party wrappers stacked on top of it
    included), or None. ``type()`` is used because proxies forward ``isinstance``."""
    seen = 0
    while obj is not None and seen < _MAX_CHAIN:
        if isinstance(type(obj), type) and issubclass(type(obj), (MegapatchWrapper, MegapatchBoundWrapper)):
            return obj
        try:
            obj = getattr(obj, "__wrapped__", None)
        except Exception:  # noqa: BLE001 -- an exotic proxy: no chain to follow
            return None
        seen += 1
    return None


def is_megapatch_wrapper(obj: Any) -> bool:
    return find_megapatch_wrapper(obj) is not None


def install(target: Target, patch_name: str) -> Installed:
    """Wrap ``target`` with its wrapper. The caller checked the surface first."""
    owner, name, raw = resolve(target)
    ours = find_megapatch_wrapper(raw)
    if ours is not None:
        if ours._self_megapatch != patch_name:
            raise RuntimeError(f"{target.path} is already wrapped by megapatch patch {ours._self_megapatch!r}")
        # left in place by an earlier uninstall because someone wrapped on top of it: switch it on
        ours._self_switch.on = True
        return Installed(target, owner, name, ours.__wrapped__, ours, [], adopted=True)
    wrapper = MegapatchWrapper(raw, target.wrapper, patch_name)
    original = owner.__dict__.get(name, ABSENT) if hasattr(owner, "__dict__") else raw
    setattr(owner, name, wrapper)
    aliases: List[Tuple[types.ModuleType, str]] = []
    if target.rebind_aliases and isinstance(owner, types.ModuleType):
        aliases = _rebind(raw, wrapper, skip=owner)
    return Installed(target, owner, name, original, wrapper, aliases)


def uninstall(installed: Installed) -> None:
    """Put the original back on its owner and in every module holding the wrapper; a wrapper
    that cannot be taken out (someone wrapped on top of it) is switched off: it passes through."""
    wrapper = installed.wrapper
    wrapper._self_switch.on = False
    current = installed.owner.__dict__.get(installed.name, ABSENT)
    if current is wrapper:
        if installed.original is ABSENT:
            delattr(installed.owner, installed.name)
        else:
            setattr(installed.owner, installed.name, installed.original)
    original = wrapper.__wrapped__
    for module, name in installed.aliases:
        if module.__dict__.get(name) is wrapper:
            setattr(module, name, original)
    if isinstance(installed.owner, types.ModuleType):
        # modules that copied the wrapper with `from ... import` after install (also for targets
        # whose aliases are not bound at install, such as torch collectives, and in torch itself)
        _rebind(wrapper, original, skip=installed.owner, everywhere=True)


def _skipped(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in _SKIP_ALIAS_SCAN)


def _modules_to_scan(skip: types.ModuleType, everywhere: bool = False) -> Iterable[types.ModuleType]:
    for name, module in list(sys.modules.items()):
        if module is None or module is skip or not isinstance(module, types.ModuleType):
            continue
        if not everywhere and _skipped(name):
            continue
        yield module


def _rebind(old: Any, new: Any, skip: types.ModuleType,
            everywhere: bool = False) -> List[Tuple[types.ModuleType, str]]:
    rebound = []
    for module in _modules_to_scan(skip, everywhere):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for name, value in list(namespace.items()):
            if value is old:
                setattr(module, name, new)
                rebound.append((module, name))
    return rebound
