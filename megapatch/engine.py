"""Lifecycle: enable, reconfigure, disable, report. Knows patches only as discovered records."""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from typing import Any, Dict, List, Optional

import wrapt

from . import consistency, options, patching, state, surface
from .errors import OptionUnavailableError, UpstreamSurfaceError
from .registry import Patch, discover
from .report import PatchReport, Status
from .versions import describe_versions, installed_versions

log = logging.getLogger("megapatch")

_lock = threading.RLock()
_enabled = False
_sources: Dict[str, str] = {}
_patches: Optional[tuple] = None
_installed: Dict[str, List[patching.Installed]] = {}
_skipped: Dict[str, str] = {}
_hooked: set = set()


def patches() -> tuple:
    global _patches
    if _patches is None:
        _patches = discover()
    return _patches


def enable(tp_reduce_dtype: Any = None, logits_dtype: Any = None,
           align_fp8_transposes: Any = None, strict: Any = None) -> Status:
    """Switch megapatch on, or reconfigure it. Arguments left as None come from the environment
    (``MEGAPATCH_*``), then from the defaults (native behaviour, strict=True).

    Nothing changes when a value is invalid or a requested patch cannot apply in strict mode:
    the error is raised first.
    """
    global _enabled, _sources
    with _lock:
        if options.env_disabled():
            warnings.warn(f"megapatch: {options.DISABLE_ENV} is set; enable() does nothing", stacklevel=2)
            disable()
            return status()
        settings, sources = options.resolve(dict(
            tp_reduce_dtype=tp_reduce_dtype, logits_dtype=logits_dtype,
            align_fp8_transposes=align_fp8_transposes, strict=strict))
        _refuse_unavailable(settings)
        wanted = [p for p in patches() if p.applies(settings)]
        if settings.strict:
            # check everything already importable before touching anything
            for patch in wanted:
                if patch.name not in _installed and patch.hook in sys.modules:
                    reasons = _incompatibilities(patch)
                    if reasons:
                        raise _surface_error(patch, reasons)
        changed = not _enabled or settings != state.current()
        state.set_current(settings)
        _sources = sources
        _enabled = True
        for patch in patches():
            if patch in wanted:
                _skipped.pop(patch.name, None)
                if patch.hook in _hooked and patch.hook in sys.modules:
                    # the hook fired once already and will not fire again: install now
                    if patch.name not in _installed:
                        _install(patch, settings.strict)
                else:
                    _register_hook(patch.hook)
            elif patch.name in _installed:
                _uninstall(patch)
        if changed:
            consistency.reconfigured(settings)
        return status()


def disable() -> Status:
    """Restore every original (aliases included); wrappers still referenced elsewhere pass
    through. Post-import hooks stay registered (wrapt cannot remove them) but do nothing."""
    global _enabled, _sources
    with _lock:
        for patch in reversed(patches()):
            if patch.name in _installed:
                _uninstall(patch)
        _skipped.clear()
        was_enabled = _enabled
        state.set_current(options.NATIVE)
        _sources = {}
        _enabled = False
        if was_enabled:
            consistency.reconfigured(options.NATIVE)
        return status()


def is_enabled() -> bool:
    return _enabled


def status() -> Status:
    settings = state.current()
    reports = []
    for patch in patches():
        reports.append(_report(patch, settings))
    values = {o.name: getattr(settings, o.name) for o in options.OPTIONS}
    sources = {o.name: _sources.get(o.name, "default") for o in options.OPTIONS}
    return Status(_enabled, values, sources, installed_versions(), tuple(reports))


def check(patch: Patch) -> List[str]:
    """Incompatibilities of ``patch`` with the installed upstream, importing its hook module."""
    try:
        __import__(patch.hook)
    except ImportError as exc:
        return [f"cannot import {patch.hook}: {exc}"]
    return _incompatibilities(patch)


# -- internals ---------------------------------------------------------------------------------

def _refuse_unavailable(settings) -> None:
    """A value no discovered patch serves is refused, e.g. an option whose patch is not built."""
    for name, value in settings.requested().items():
        alone = options.Settings(**{name: value})
        if not any(p.option == name and p.applies(alone) for p in patches()):
            env = options.OPTIONS_BY_NAME[name].env
            raise OptionUnavailableError(
                f"megapatch option {name}={value!r} (env {env}) is not available yet: no patch in "
                f"this megapatch version implements it")


def _register_hook(module_name: str) -> None:
    if module_name in _hooked:
        return
    _hooked.add(module_name)
    # fires at once when the module is already imported, else right after it is
    wrapt.register_post_import_hook(_on_import, module_name)


def _on_import(module) -> None:
    with _lock:
        if not _enabled:
            return
        settings = state.current()
        for patch in patches():
            if patch.hook == module.__name__ and patch.applies(settings) and patch.name not in _installed:
                _install(patch, settings.strict)


def _install(patch: Patch, strict: bool) -> None:
    reasons = _incompatibilities(patch)
    if reasons:
        error = _surface_error(patch, reasons)
        if strict:
            raise error
        _skipped[patch.name] = "; ".join(reasons)
        log.warning("%s (strict=False: patch skipped, upstream behaviour kept)", error)
        warnings.warn(str(error), RuntimeWarning, stacklevel=2)
        return
    done: List[patching.Installed] = []
    try:
        for target in patch.targets:
            if target.optional and not surface.present(target):
                continue
            done.append(patching.install(target, patch.name))
    except Exception:
        for item in reversed(done):
            patching.uninstall(item)
        raise
    _installed[patch.name] = done
    log.info("megapatch: %s installed (%d targets)", patch.name, len(done))


def _uninstall(patch: Patch) -> None:
    for item in reversed(_installed.pop(patch.name)):
        patching.uninstall(item)


def _incompatibilities(patch: Patch) -> List[str]:
    reasons = [problem for target in patch.targets for problem in surface.problems(target)]
    if not reasons and patch.probe is not None:
        reason = patch.probe()
        if reason:
            reasons.append(reason)
    return reasons


def _surface_error(patch: Patch, reasons: List[str]) -> UpstreamSurfaceError:
    return UpstreamSurfaceError(
        f"megapatch patch {patch.name!r} ({patch.summary}) cannot apply: " + "; ".join(reasons)
        + f". Installed: {describe_versions()}. Set strict=False (MEGAPATCH_STRICT=0) to run "
        f"without this patch, or use a supported upstream version (see `megapatch doctor`).")


def _report(patch: Patch, settings) -> PatchReport:
    backend = None
    if patch.name in _installed:
        items = _installed[patch.name]
        backend = patch.backend() if patch.backend else None
        return PatchReport(
            patch.name, patch.option, patch.summary, "active",
            targets=tuple(i.target.path for i in items),
            aliases=tuple(f"{m.__name__}.{n}" for i in items for m, n in i.aliases),
            backend=backend)
    if patch.name in _skipped:
        return PatchReport(patch.name, patch.option, patch.summary, "skipped", reason=_skipped[patch.name])
    if _enabled and patch.applies(settings):
        return PatchReport(patch.name, patch.option, patch.summary, "pending-import",
                           reason=f"installs when {patch.hook} is imported")
    reason = "megapatch is disabled" if not _enabled else f"not requested ({patch.option} is native)"
    return PatchReport(patch.name, patch.option, patch.summary, "inactive", reason=reason)
