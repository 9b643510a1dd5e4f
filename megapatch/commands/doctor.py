"""``megapatch doctor`` and ``megapatch status``: what this environment would do, and whether it can.

One survey (a JSON-able dict) feeds both commands. It never raises: every probe, check or
version lookup that fails becomes a row (or a line) carrying the reason, because the case
doctor exists for is an upstream that megapatch cannot patch.

Doctor never enables megapatch itself. It imports the upstream modules the startup hook
watches, so a job's activation from ``MEGAPATCH_*`` happens here exactly as it would in the
job (an error it raises is reported, not shown as a traceback), then disables it again and
checks every patch against the original upstream.

Exit codes: 0 everything requested can apply; 1 a requested patch cannot apply, activation
from the environment fails or never happens, or (``doctor -- <Megatron-LM flags>``) the flags'
job would be refused or stop before its first step; 2 an invalid ``MEGAPATCH_*`` value.

The survey, its preflight of a Megatron-LM command line and the exit code are here; the text
views are in ``megapatch.commands.doctor_text``, and what stops a Megatron-LM job upstream, before
any megapatch check, in ``megapatch.commands.upstream_stops``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional

from megapatch.core.version import __version__
from megapatch.core import engine, options, report, state, upstream_versions
from megapatch.commands.doctor_text import render_doctor
from megapatch.commands.upstream_stops import (
    _stop_lines, _upstream_stop_causes, client_stops, job_imports, launch_of, split_script)

OK, CANNOT_APPLY, INVALID_ENVIRONMENT = 0, 1, 2
# the modules whose import activates megapatch from the environment (see _bootstrap)
ACTIVATING_MODULES = ("megatron.core", "transformer_engine.pytorch")
_LONGEST_VALUE = 200  # a variable's value is echoed up to this many characters
_LONGEST_ERROR = 2000


def _guard(what: str, func: Callable, default: Any = None):
    """``(value, None)`` or ``(default, "what: error")``: a probe never escapes as a traceback."""
    try:
        return func(), None
    except Exception as exc:  # noqa: BLE001 -- the report must name any failure
        return default, f"{what} raised {type(exc).__name__}: {_short(str(exc), _LONGEST_ERROR)}"


def _short(text: str, limit: int = _LONGEST_VALUE) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _findable(module: str) -> bool:
    """Whether ``module`` can be found; True when looking raises, so that the import (guarded)
    reports the real error instead of a misleading "not installed"."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
    except Exception:  # noqa: BLE001 -- a broken import hook: let the guarded import say so
        return True


def _unknown_variables() -> dict:
    return dict(options.unknown_env_variables())


def _environment() -> dict:
    found = {k: _short(v) for k, v in sorted(os.environ.items()) if k.startswith(options.ENV_PREFIX)}
    unknown, error = _guard("looking for misspelled variables", _unknown_variables, {})
    return {"variables": found, "unknown": unknown, "problems": [error] if error else []}


def _import_failure(module: str) -> Optional[str]:
    """Why ``module`` cannot be imported here, where the cause is not the module itself: a package it
    imports is missing (``megatron.rl.rl_utils`` without ``tensorboard``), or upstream's own import
    fails. None where it imports, or where the module itself (or its package) does not exist: that
    is the patch's incompatibility, which ``engine.check`` reports."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if missing and (missing == module or module.startswith(missing + ".")):
            return None
        return _short(str(exc), _LONGEST_ERROR)
    return None


def _kill_switch() -> bool:
    return options.disabled()


def _activate_like_a_job(survey: dict, settings: options.Settings) -> None:
    """Import what a job imports; record what megapatch's startup hook did, then switch it off."""
    activation = survey["activation"]
    was_enabled = engine.is_enabled()
    imported_before = "megatron.core" in sys.modules
    errors = []
    with warnings.catch_warnings(record=True) as caught, report.muted():
        warnings.simplefilter("always")
        for module in ACTIVATING_MODULES:
            if not _findable(module.split(".")[0]):
                continue
            _, error = _guard(f"import {module}", lambda m=module: __import__(m))
            if error:
                errors.append(error)
    survey["upstream_warnings"] = len(caught)
    if engine.is_enabled() and not was_enabled:
        snapshot, error = _guard("megapatch.status()", engine.status)
        if snapshot is not None:
            activation["patches"] = {p.name: p.state for p in snapshot.patches}
        _guard("megapatch.disable()", engine.disable)
        if error:
            errors.append(error)
    requested = bool(settings.requested())
    if errors:
        activation.update(state="failed", detail="; ".join(errors))
    elif survey["disabled"]:
        activation.update(state="disabled", detail=f"{options.DISABLE_ENV} is set: nothing is enabled")
    elif not requested:
        activation.update(state="not-requested", detail="no MEGAPATCH_* option asks for a change")
    elif not _findable("megatron"):
        activation.update(state="no-megatron", detail="megatron is not importable here")
    elif "patches" in activation:
        activation.update(state="enabled", detail="the startup hook enabled megapatch when megatron.core was imported")
    elif was_enabled or imported_before:
        activation.update(state="not-observed", detail=(
            "megapatch was enabled, or megatron.core imported, before this report: activation from "
            "the environment could not be observed"))
    else:
        activation.update(state="not-run", detail=(
            "MEGAPATCH_* variables are set but importing megatron.core did not enable megapatch: the "
            "startup hook (megapatch-startup.pth) did not run in this interpreter (e.g. a pip --target "
            "install on PYTHONPATH). Launch with megapatch-run, or call megapatch.enable() in the script"))


def _patch_row(patch, settings: Optional[options.Settings], strict: bool, disabled: bool) -> dict:
    row = {"name": patch.name, "option": patch.option, "summary": patch.summary, "hook": patch.hook,
           "package": patch.package, "supported": None,
           "requested": None, "opted_out": False, "upstream": "n/a", "problems": [],
           "targets": len(patch.targets), "backend": None, "would_install": False, "why": "",
           "untested": []}
    row["supported"] = upstream_versions.supported_range(patch) or None
    row["untested"], error = _guard(f"{patch.name} version range", lambda: list(upstream_versions.outside_range(patch)), [])
    if error:
        row["problems"].append(error)
    if settings is not None:
        row["requested"], error = _guard(f"{patch.name}.applies", lambda: bool(patch.applies(settings)), False)
        if error:
            row["problems"].append(error)
        row["opted_out"] = bool(patch.left_out(settings.skip_patches))
    top = patch.hook.split(".")[0]
    needs = patch.package_module  # megatron-core's TE wrappers need TE itself
    if not _findable(top) or not _findable(needs):
        row["problems"].append(f"{needs if _findable(top) else top} is not installed")
    elif not _findable(patch.hook_package):  # megatron.rl: a Megatron-LM checkout's, not megatron-core's
        row["absent"] = patch.hook_package
    elif (failure := _import_failure(patch.hook)) is not None:  # a client's module lacking its packages here
        row["unimportable"] = failure
        row["problems"].append(f"cannot import {patch.hook} here ({row['unimportable']}): only a job that "
                               f"imports it needs it")
    else:
        problems, error = _guard(f"checking {patch.name}", lambda: engine.check(patch), [])
        row["problems"] += problems + ([error] if error else [])
        row["upstream"] = "INCOMPATIBLE" if problems else ("ERROR" if error else "compatible")
        if row["upstream"] == "compatible" and patch.backend is not None:
            row["backend"], error = _guard(f"{patch.name} backend probe", patch.backend)
            if error:
                row["upstream"], row["problems"] = "ERROR", [error]
    if settings is None:
        row["why"] = "settings are invalid"
    elif disabled:
        row["why"] = f"{options.DISABLE_ENV} is set"
    elif not row["requested"]:
        row["why"] = "not requested"
    elif row["opted_out"]:
        row["why"] = "opted out (MEGAPATCH_SKIP_PATCHES)"
    elif row["upstream"] == "compatible":
        row["would_install"] = True
        row["why"] = f"installs when {patch.hook} is imported"
    elif row.get("absent"):
        row["why"] = f"{row['absent']} is not importable here: installs when a job imports {patch.hook}"
    elif row.get("unimportable"):
        row["why"] = (f"{patch.hook} cannot be imported here ({row['unimportable']}): the patch applies only to "
                      f"a job that imports it, and such a job stops at that import, upstream; a job that does "
                      f"not import it runs without it")
    elif row["upstream"] == "n/a":
        row["why"] = "upstream package not installed: nothing to patch"
    else:
        row["why"] = ("strict: the job stops with this error" if strict
                      else "strict=False: skipped with a warning, upstream behaviour kept")
    return row


def survey(flags: Optional[List[str]] = None, launch: Optional[str] = None) -> dict:
    """Everything doctor and status report, as plain data (the ``--json`` document). ``flags``: a
    Megatron-LM command line, optionally starting with the job's script (``train_rl.py ...``); each
    requested patch's preflight check then says whether the job it starts would be refused
    (``result["flags"]``). ``launch``: how the job is launched (``upstream_stops.LAUNCHES``; default
    ``MEGAPATCH_LAUNCH``, else ``here``)."""
    result: Dict[str, Any] = {"megapatch": __version__, "versions": {}, "stacks": {},
                              "environment": {"variables": {}, "unknown": {}, "problems": []},
                              "settings": None, "sources": {}, "error": None, "disabled": False,
                              "activation": {"state": "unknown", "detail": ""},
                              "upstream_warnings": 0, "patches": [], "problems": [],
                              "launch": {"name": "here", "from": "default"},
                              "flags": None if flags is None else {"argv": list(flags), "script": None,
                                                                   "config": {}, "stops": [], "stop_causes": [],
                                                                   "refusals": {}, "notes": {}}}
    try:
        name, origin = launch_of(launch)
        result["launch"] = {"name": name, "from": origin}
    except ValueError as exc:
        result["problems"].append(str(exc))
    _, error = _guard("doctor", lambda: _survey(result))
    if error:  # a defect of doctor itself: still report what was gathered
        result["problems"].append(error)
        result["result"] = {"code": CANNOT_APPLY, "message": "doctor could not check everything (exit 1)"}
    return result


def _survey(result: dict) -> None:
    result["versions"], error = _guard("version lookup", upstream_versions.installed_versions, {})
    if error:
        result["problems"].append(error)
    result["stacks"], error = _guard("stack version lookup", _stacks, {})
    if error:
        result["problems"].append(error)
    environment, error = _guard("reading the environment", _environment)
    if error:
        result["problems"].append(error)
    else:
        result["environment"] = environment
        result["problems"] += environment["problems"]
    settings = None
    try:
        settings, sources = engine.resolve({})  # skip_patches names checked too
        result["settings"] = {o.name: getattr(settings, o.name) for o in options.OPTIONS}
        result["sources"] = dict(sources)
        result["disabled"] = _kill_switch()
    except options.OptionError as exc:
        result["error"] = _short(str(exc), _LONGEST_ERROR)
        settings = None
    except Exception as exc:  # noqa: BLE001 -- not the user's value: a missing module (torch), a defect
        result["problems"].append(f"resolving the settings raised {type(exc).__name__}: "
                                  f"{_short(str(exc), _LONGEST_ERROR)}")
        result["activation"].update(state="not-run", detail="the settings could not be resolved")
        settings = None
    if settings is not None:
        _activate_like_a_job(result, settings)
    elif result["error"] is not None:
        result["activation"].update(state="refused", detail="the environment holds an invalid value")
    patches, error = _guard("discovering patches", engine.patches, ())
    if error:
        result["problems"].append(error)
    strict = settings.strict if settings is not None else True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for patch in patches:
            row, error = _guard(f"reporting {getattr(patch, 'name', patch)}",
                                lambda p=patch: _patch_row(p, settings, strict, result["disabled"]))
            if error:
                row = {"name": getattr(patch, "name", str(patch)), "option": None, "summary": "",
                       "package": None, "supported": None, "requested": None, "opted_out": False,
                       "upstream": "ERROR", "problems": [error], "targets": 0, "backend": None,
                       "would_install": False, "why": error, "untested": []}
            result["patches"].append(row)
    result["upstream_warnings"] += len(caught)
    if settings is not None:
        _name_who_serves(result["patches"], settings)
    if result["flags"] is not None:
        _preflight(result, {getattr(p, "name", None): p for p in patches}, settings)
    code, message = _verdict(result, strict)
    result["result"] = {"code": code, "message": message}


def _name_who_serves(rows: List[dict], settings: options.Settings) -> None:
    """A patch the option's value does not use, while the option asks for a change: "not
    requested" would read as "not covered" (``tp_reduce.moe`` at ``fp32-accumulate``, whose sums the
    collectives of ``tp_reduce.megatron_core`` carry); say which value it serves and which patches
    serve this one."""
    requested = settings.requested()
    for row in rows:
        option = row.get("option")
        if row.get("requested") is not False or option not in requested or row["why"] != "not requested":
            continue
        value = options.OPTIONS_BY_NAME[option].text(requested[option])
        serving = [r["name"] for r in rows if r.get("option") == option and r.get("requested")]
        row["why"] = (f"not used at {option}={value} (it serves another value of {option}); {option}={value} "
                      f"is served by {', '.join(serving) or 'no patch'}")


def _stacks() -> dict:
    """The stacks megapatch runs under without patching them (Megatron-Bridge): version, the
    versions it was run with, and the warning a job would log (a warning only, never a refusal)."""
    return {package: {"version": upstream_versions.version_of(package), "tested": specifier,
                      "warning": upstream_versions.untested_stack(package)}
            for package, (_module, specifier) in upstream_versions.STACKS_TESTED.items()}



@contextlib.contextmanager
def _settings_of_the_job(settings: options.Settings, sources: dict):
    """The job's settings as the current ones while the preflight checks run: they read the
    options (``tp_invariant_width``) and name their sources as the job's refusals would."""
    before = state.current(), state.sources()
    state.set_current(settings, sources)
    try:
        yield
    finally:
        state.set_current(*before)


def _preflight(result: dict, patches: dict, settings: Optional[options.Settings]) -> None:
    """What stops the flags' job upstream, then what each requested patch's construction-time
    checks would say of the flags' model (patches opted out of are not run: they refuse nothing)."""
    from megapatch.commands.megatron_lm_flags import config_from_flags

    flags = result["flags"]
    script, argv = split_script(flags["argv"])
    flags["script"] = script
    config, error = _guard("reading the Megatron-LM flags", lambda: config_from_flags(argv))
    if error:
        result["problems"].append(error)
        return
    flags["config"] = dict(vars(config))
    causes = _client_stops(result, script, argv) + _upstream_stop_causes(config, result["launch"]["name"])
    flags["stops"] = _stop_lines(causes)
    flags["stop_causes"] = [cause for cause, _ in causes]
    if settings is None or result["disabled"]:
        return
    with _settings_of_the_job(settings, result["sources"]):
        for row in result["patches"]:
            patch = patches.get(row["name"])
            if patch is None or not row["requested"] or row["opted_out"]:
                continue
            reason, error = None, None
            if patch.preflight is not None:
                reason, error = _guard(f"{patch.name} preflight", lambda p=patch: p.preflight(config))
            if reason or error:
                origin = result["sources"].get(patch.option, "")
                flags["refusals"][patch.name] = f"{patch.option}: {reason or error} ({patch.option} from {origin})"
            if patch.notes is not None and not (reason or error):
                note, error = _guard(f"{patch.name} notes", lambda p=patch: p.notes(config))
                if note or error:
                    flags["notes"][patch.name] = note or error


def _client_stops(result: dict, script: Optional[str], argv: List[str]) -> List[tuple]:
    """The stops of the modules this job imports that cannot be imported here (``upstream_stops``)."""
    rows = [row for row in result["patches"] if row.get("unimportable")]
    imports, error = _guard(f"reading the imports of {script}", lambda: job_imports(script, argv), {}) if rows else ({}, None)
    if error:
        result["problems"].append(error)
    return client_stops(rows, imports)


def _verdict(result: dict, strict: bool):
    if result["error"] is not None:
        return INVALID_ENVIRONMENT, "an invalid MEGAPATCH_* value (exit 2)"
    refusals = (result["flags"] or {}).get("refusals")
    if (result["flags"] or {}).get("stops"):
        cause = "; ".join(result["flags"]["stop_causes"])
        also = (f"; megapatch would then refuse it too ({', '.join(refusals)})" if refusals
                else "; megapatch's own checks refuse nothing more")
        return CANNOT_APPLY, (f"with these Megatron-LM flags the job would stop before its first step: "
                              f"{cause}{also} (exit 1)")
    if refusals:
        return CANNOT_APPLY, (f"with these Megatron-LM flags the job would be refused before its first "
                              f"step by {', '.join(refusals)} (exit 1)")
    failing = [r["name"] for r in result["patches"]
               if r["requested"] and not r["opted_out"] and not result["disabled"]
               and r["upstream"] in ("INCOMPATIBLE", "ERROR")]
    if failing:
        how = "the job would stop" if strict else "the job would run them unpatched"
        return CANNOT_APPLY, f"requested patch(es) cannot apply: {', '.join(failing)}; {how} (exit 1)"
    if result["settings"] is None and result["problems"]:
        return CANNOT_APPLY, f"{result['problems'][0]} (exit 1)"
    state = result["activation"]["state"]
    if state in ("failed", "not-run"):
        return CANNOT_APPLY, f"activation from the environment {'fails' if state == 'failed' else 'never happens'} (exit 1)"
    if result["problems"]:
        return CANNOT_APPLY, "doctor could not check everything (exit 1)"
    return OK, "OK"



def diagnose():
    """``(exit code, doctor text)``."""
    result = survey()
    return result["result"]["code"], render_doctor(result)
