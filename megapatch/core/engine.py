"""Lifecycle: enable, reconfigure, disable, report. Knows patches only as discovered records."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import sys
import threading
import warnings
from typing import Any, Dict, List, Optional

import wrapt

from megapatch.core import (cross_rank, options, patches_line, rank_errors, wrappers, report, state, surface,
                            upstream_versions)
from megapatch.core.errors import OptionError, OptionUnavailableError, UpstreamSurfaceError
from megapatch.core.registry import Patch, discover
from megapatch.core.report import PatchReport, Status
from megapatch.core.upstream_versions import installed_versions, supported_range, warn_if_unsupported

log = logging.getLogger("megapatch")

_lock = threading.RLock()
_enabled = False
_explicit: Dict[str, Any] = {}  # enable() arguments in force: kept until changed or disable()
_patches: Optional[tuple] = None
_installed: Dict[str, List[wrappers.Installed]] = {}
_skipped: Dict[str, str] = {}  # strict=False: the patch could not apply, upstream behaviour kept
_failed: Dict[str, str] = {}  # strict: installing at import raised (the import failed)
_hooked: set = set()
_loaded: set = set()  # hooked modules whose import has finished (their post-import hook fired)
_announcing: Dict[str, List[wrappers.Installed]] = {}  # kill switch: the publish-only patches


def patches() -> tuple:
    global _patches
    if _patches is None:
        _patches = discover()
    return _patches


def enable(**arguments: Any) -> Status:
    """Switch megapatch on, or reconfigure it. Keywords: the options of ``megapatch.core.options``
    (``tp_reduce_dtype``, ``logits_dtype``, ...; ``None`` means "not given").

    Each option comes from, in order: this call's argument; the argument given to an earlier
    ``enable()`` (a reconfiguration changes only what it passes: ``enable(logits_dtype="fp32")``
    after ``enable(tp_reduce_dtype="fp32")`` keeps FP32 reductions; pass a value, e.g.
    ``"native"``, to change it, or call ``disable()`` to forget earlier arguments); the
    environment (``MEGAPATCH_*``); the default (native behaviour, strict=True).

    ``skip_patches`` (or ``MEGAPATCH_SKIP_PATCHES``) names patches, as in ``status()``, to leave
    out on purpose; the others serving the same option still apply.

    All or nothing: when a value is invalid, a requested patch cannot apply in strict mode, or
    installing fails, the error is raised and nothing changes (settings, sources, installed
    wrappers). With ``strict=False`` a patch that cannot apply is skipped and logged instead.
    """
    global _explicit
    unknown = [name for name in arguments if name not in options.OPTIONS_BY_NAME]
    if unknown:
        raise TypeError(f"enable() got an unexpected keyword argument {unknown[0]!r}; "
                        f"megapatch options: {', '.join(options.OPTIONS_BY_NAME)}")
    passed = {name: value for name, value in arguments.items() if value is not None}
    with _lock:
        if options.disabled():  # raises on a spelling that is neither true nor false
            warnings.warn(f"megapatch: {options.DISABLE_ENV} is set; enable() does nothing", stacklevel=2)
            disable()
            announce_kill_switch()
            return status()
        _stop_announcing()
        arguments = {**_explicit, **passed}
        settings, sources = resolve(arguments)
        report.warn_unknown_env_variables()
        wanted = [p for p in patches() if _wanted(p, settings)]
        if settings.strict:
            # check everything already importable before touching anything
            for patch in wanted:
                if patch.name not in _installed and patch.hook in sys.modules:
                    reasons = _incompatibilities(patch)
                    if reasons:
                        raise _surface_error(patch, reasons)
        before = (_enabled, state.current(), state.sources(), dict(_installed), dict(_skipped), dict(_failed))
        try:
            _apply(settings, sources, wanted)
        except BaseException:
            _rollback(before)
            raise
        _explicit = arguments
        rank_errors.install()  # a refusal on every rank reads as one line each
        _watch_stacks()
        if not before[0] or settings != before[1]:
            cross_rank.reconfigured(settings)
            current = status()
            patches_line.activated(current, status)
            return current
        return status()


enable.__signature__ = inspect.Signature(
    [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Any)
     for o in options.OPTIONS], return_annotation=Status)


def disable() -> Status:
    """Restore every original (aliases included); wrappers still referenced elsewhere pass
    through. Post-import hooks stay registered (wrapt cannot remove them) but do nothing.
    Earlier ``enable()`` arguments are forgotten."""
    global _enabled, _explicit
    with _lock:
        _stop_announcing()
        patches_line.reset()
        for patch in reversed(patches()):
            if patch.name in _installed:
                _uninstall(patch)
        _skipped.clear()
        _failed.clear()
        was_enabled = _enabled
        state.set_current(options.NATIVE)
        _explicit = {}
        _enabled = False
        rank_errors.uninstall()
        if was_enabled:
            cross_rank.reconfigured(options.NATIVE)
        return status()


def announce_kill_switch() -> None:
    """The kill switch met a request (``MEGAPATCH_*`` variables or an ``enable()`` call): install
    nothing that changes upstream behaviour, only the patches marked ``announces`` (they publish
    this rank's settings, the kill switch included), so that a peer asking for a change fails in
    seconds naming the kill switch instead of waiting out its check timeout."""
    with _lock:
        for patch in patches():
            if patch.announces and patch.hook not in _announce_hooked:
                _announce_hooked.add(patch.hook)
                wrapt.register_post_import_hook(_announce_on_import, patch.hook)


_announce_hooked: set = set()


def _announce_on_import(module) -> None:
    with _lock:
        if _enabled or not options.disabled():
            return
        for patch in patches():
            if patch.announces and patch.hook == module.__name__ and patch.name not in _announcing:
                if _incompatibilities(patch):  # upstream moved: the peers' timeout message still says why
                    continue
                _announcing[patch.name] = [wrappers.install(t, patch.name) for t in patch.targets
                                           if not t.optional or surface.present(t)]


def _stop_announcing() -> None:
    for name in list(_announcing):
        for item in reversed(_announcing.pop(name)):
            wrappers.uninstall(item)


def is_enabled() -> bool:
    return _enabled


def status() -> Status:
    settings = state.current()
    reports = []
    for patch in patches():
        reports.append(dataclasses.replace(_report(patch, settings), supports=supported_range(patch)))
    values = {o.name: getattr(settings, o.name) for o in options.OPTIONS}
    sources = state.sources()
    return Status(_enabled, values, sources, installed_versions(), tuple(reports))


def resolve(arguments: Optional[dict] = None, environ=None):
    """``options.resolve`` plus what needs the patch records: ``skip_patches`` must name real
    patches. ``megapatch doctor`` and ``enable()`` refuse the same values."""
    settings, sources = options.resolve(arguments or {}, environ)
    names = [p.name for p in patches()]
    unknown = [n for n in settings.skip_patches if n not in names]
    if unknown:
        origin = "skip_patches" if sources["skip_patches"] == "enable()" else options.SKIP_PATCHES_ENV
        hints = [f"{n} (did you mean {close[0]}?)" if close else n
                 for n in unknown for close in [difflib.get_close_matches(n, names, n=1)]]
        raise OptionError(f"{origin}={options.shown(','.join(settings.skip_patches))} names unknown "
                          f"megapatch patch(es): {', '.join(hints)}; valid patch names: {', '.join(names)}")
    _refuse_unavailable(settings, sources)
    return settings, sources


def check(patch: Patch) -> List[str]:
    """Incompatibilities of ``patch`` with the installed upstream, importing its hook module."""
    try:
        __import__(patch.hook)
    except ImportError as exc:
        return [f"cannot import {patch.hook}: {exc}"]
    return _incompatibilities(patch)


# -- internals ---------------------------------------------------------------------------------

def _wanted(patch: Patch, settings) -> bool:
    return patch.applies(settings) and not patch.left_out(settings.skip_patches)


def _pending() -> bool:
    """Whether a requested patch waits for its modules (not installed, skipped or failed)."""
    settings = state.current()
    done = set(_installed) | set(_skipped) | set(_failed)
    return any(_wanted(p, settings) and p.name not in done for p in patches())


def _refuse_unavailable(settings, sources) -> None:
    """A requested value that no discovered patch serves is refused (an option whose patch is not
    built), and so is one whose every serving patch is opted out: never run upstream numerics
    silently where a change was asked for (a patch that builds on an opted-out one is left out
    too). Patches opted out beside others that still serve the option are fine."""
    by_name = {p.name: p for p in patches()}
    for name, value in settings.requested().items():
        alone = options.Settings(**{name: value})
        serving = [p.name for p in patches() if p.option == name and p.applies(alone)]
        env = options.OPTIONS_BY_NAME[name].env
        if not serving:
            raise OptionUnavailableError(
                f"megapatch option {name}={value!r} (from {options.origin(name, value, sources[name])}) "
                f"is not available yet: no patch in this megapatch version implements it")
        needed = [p.name for p in patches() if p.option == name and p.guarantee and p.applies(alone)
                  and p.name in settings.skip_patches]
        if needed:
            raise OptionError(
                f"megapatch option {name}={value!r} (from {options.origin(name, value, sources[name])}) "
                f"needs every one of its patches, but {', '.join(needed)} is opted out (skip_patches from "
                f"{sources.get('skip_patches')}): without it the guarantee does not hold. Remove it from "
                f"skip_patches, or turn {name} off")
        if all(by_name[p].left_out(settings.skip_patches) for p in serving):
            through = "".join(f"; {p} builds on {', '.join(by_name[p].left_out(settings.skip_patches))}"
                              for p in serving if p not in settings.skip_patches)
            raise OptionError(
                f"megapatch option {name}={value!r} ({sources.get(name)}) asks for a change, but every "
                f"patch serving it is opted out ({', '.join(p for p in serving if p in settings.skip_patches)} "
                f"in skip_patches, {sources.get('skip_patches')}{through}): keep at least one, or set {env} "
                f"to native")


def _apply(settings, sources, wanted) -> None:
    global _enabled
    state.set_current(settings, sources)
    _enabled = True
    for patch in patches():
        if patch not in wanted:
            continue
        _skipped.pop(patch.name, None)
        _failed.pop(patch.name, None)
        if _imported(patch):
            # the hooks fired once already and will not fire again: install now
            if patch.name not in _installed:
                _install(patch, settings.strict)
        else:
            for module in patch.modules:  # each fires at once when imported; the last one installs
                _register_hook(module)
    for patch in reversed(patches()):
        if patch not in wanted:
            _skipped.pop(patch.name, None)
            _failed.pop(patch.name, None)
            if patch.name in _installed:
                _uninstall(patch)


def _rollback(before) -> None:
    """Put back what ``_apply`` changed: wrappers, settings, sources, per-patch records."""
    global _enabled
    enabled, settings, sources, installed, skipped, failed = before
    for name in [n for n in _installed if installed.get(n) is not _installed[n]]:
        for item in reversed(_installed.pop(name)):
            try:
                wrappers.uninstall(item)
            except Exception:  # noqa: BLE001 -- keep restoring the rest
                log.exception("megapatch: restoring %s failed", item.target.path)
    for name, items in installed.items():
        if name not in _installed:
            try:
                _installed[name] = [wrappers.install(i.target, name) for i in items]
            except Exception:  # noqa: BLE001
                log.exception("megapatch: reinstalling %s failed", name)
    state.set_current(settings, sources)
    _enabled = enabled
    _skipped.clear()
    _skipped.update(skipped)
    _failed.clear()
    _failed.update(failed)


_stacks_hooked: set = set()


def _watch_stacks() -> None:
    """Once per process: when a stack of ``upstream_versions.STACKS_TESTED`` (Megatron-Bridge) is
    imported (or already is), warn if its version is outside the tested range."""
    for package, (module_name, _specifier) in upstream_versions.STACKS_TESTED.items():
        if package in _stacks_hooked:
            continue
        _stacks_hooked.add(package)
        wrapt.register_post_import_hook(
            lambda _module, package=package: upstream_versions.warn_if_untested_stack(package), module_name)


def _register_hook(module_name: str) -> None:
    if module_name in _hooked:
        return
    _hooked.add(module_name)
    # fires at once when the module is already imported, else right after it is
    wrapt.register_post_import_hook(_on_import, module_name)


def _ready(module_name: str) -> bool:
    """Whether ``module_name`` has finished importing (its hook fired) and is still imported."""
    return module_name in _loaded and module_name in sys.modules


def _imported(patch: Patch) -> bool:
    """Whether every module ``patch`` needs has finished importing."""
    return all(_ready(name) for name in patch.modules)


def _on_import(module) -> None:
    """Install the patches this module's import makes possible: those it is one of the modules of,
    once all of them are imported. Under strict=False this never raises (a failure skips the
    patch); under strict=True the import fails with the reason."""
    with _lock:
        _loaded.add(module.__name__)
        if not _enabled:
            return
        settings = state.current()
        installed = []
        for patch in patches():
            if (module.__name__ not in patch.modules or not _wanted(patch, settings)
                    or patch.name in _installed or not _imported(patch)):
                continue
            try:
                _install(patch, settings.strict)
            except Exception as exc:
                if settings.strict:
                    _failed[patch.name] = str(exc)
                    raise
                _skip(patch, f"{type(exc).__name__}: {exc}")
            if patch.name in _installed:
                installed.append(patch.name)
        if installed:
            patches_line.installed(installed, module.__name__, status, _pending)


def _install(patch: Patch, strict: bool) -> None:
    reasons = _incompatibilities(patch)
    done: List[wrappers.Installed] = []
    if not reasons:
        try:
            for target in patch.targets:
                if target.optional and not surface.present(target):
                    continue
                done.append(wrappers.install(target, patch.name))
        except Exception as exc:  # noqa: BLE001 -- e.g. a foreign wrapper megapatch cannot handle
            for item in reversed(done):
                wrappers.uninstall(item)
            reasons = [f"installing the wrapper on {target.path} failed: {type(exc).__name__}: {exc}"]
    if reasons:
        error = _surface_error(patch, reasons)
        if strict:
            raise error
        _skip(patch, "; ".join(reasons), error)
        return
    _installed[patch.name] = done
    warn_if_unsupported(patch)
    log.debug("megapatch: %s installed (%d targets)", patch.name, len(done))


def _skip(patch: Patch, reason: str, error: Optional[Exception] = None) -> None:
    _skipped[patch.name] = reason
    report.once(f"skipped:{patch.name}:{reason}", "warning",
                f"{error or reason} (strict=False: patch {patch.name} skipped, upstream behaviour kept)")


def _uninstall(patch: Patch) -> None:
    for item in reversed(_installed.pop(patch.name)):
        wrappers.uninstall(item)


def _incompatibilities(patch: Patch) -> List[str]:
    reasons: List[str] = []
    for target in patch.targets:
        try:
            reasons += surface.problems(target)
        except Exception as exc:  # noqa: BLE001 -- an upstream object the check cannot read
            reasons.append(f"checking {target.path} raised {type(exc).__name__}: {exc}")
    if not reasons and patch.probe is not None:
        try:
            reason = patch.probe()
        except Exception as exc:  # noqa: BLE001 -- e.g. an upstream __init__ that is not a function
            reason = f"the upstream check of {patch.name} raised {type(exc).__name__}: {exc}"
        if reason:
            reasons.append(reason)
    return reasons


def _surface_error(patch: Patch, reasons: List[str]) -> UpstreamSurfaceError:
    return UpstreamSurfaceError(
        f"megapatch patch {patch.name!r} ({patch.summary}) cannot apply: " + "; ".join(reasons),
        hint=f"Set strict=False (MEGAPATCH_STRICT=0) to run without this patch, opt out of it "
             f"(MEGAPATCH_SKIP_PATCHES={patch.name}), or use a supported upstream version (see "
             f"`megapatch doctor`).")


def _report(patch: Patch, settings) -> PatchReport:
    if patch.name in _installed:
        items = _installed[patch.name]
        try:
            backend = patch.backend() if patch.backend else None
        except Exception as exc:  # noqa: BLE001 -- status() must always answer
            backend = f"unknown ({type(exc).__name__}: {exc})"
        return PatchReport(
            patch.name, patch.option, patch.summary, "active",
            targets=tuple(i.target.path for i in items),
            aliases=tuple(f"{m.__name__}.{n}" for i in items for m, n in i.aliases),
            backend=backend)
    if patch.name in _failed:
        return PatchReport(patch.name, patch.option, patch.summary, "incompatible", reason=_failed[patch.name])
    if patch.name in _skipped:
        return PatchReport(patch.name, patch.option, patch.summary, "skipped", reason=_skipped[patch.name])
    left_out = patch.left_out(settings.skip_patches)
    if _enabled and patch.applies(settings) and left_out:
        builds_on = "" if patch.name in left_out else f"builds on {', '.join(left_out)}, "
        return PatchReport(patch.name, patch.option, patch.summary, "opted-out",
                           reason=f"{builds_on}left out on purpose: skip_patches from {state.sources()['skip_patches']}")
    if _enabled and patch.applies(settings):
        waiting = [name for name in patch.modules if not _ready(name)]
        if not waiting or patch.hook in waiting:  # the hook's import brings the rest, as a rule
            waiting = [patch.hook]
        return PatchReport(patch.name, patch.option, patch.summary, "pending-import",
                           reason=f"installs when {' and '.join(waiting)} {'is' if len(waiting) == 1 else 'are'} imported")
    reason = "megapatch is disabled" if not _enabled else f"not requested ({patch.option} is native)"
    return PatchReport(patch.name, patch.option, patch.summary, "inactive", reason=reason)
