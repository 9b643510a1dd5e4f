"""``megapatch doctor``: what is installed, what each patch needs, what the environment asks."""

from __future__ import annotations

import importlib.util
import os
from typing import List, Tuple

from . import __version__, engine, options
from .errors import OptionError
from .report import _table
from .versions import installed_versions


def diagnose() -> Tuple[int, str]:
    """Return ``(exit code, report text)``: 0 when everything requested can apply, 1 when a
    requested patch cannot, 2 when the environment holds an invalid value."""
    lines: List[str] = [f"megapatch {__version__} doctor", ""]
    lines += _table(("package", "version"), [(k, v or "absent") for k, v in installed_versions().items()])
    lines.append("")
    set_vars = [(o.env, os.environ[o.env]) for o in options.OPTIONS if o.env in os.environ]
    if options.env_disabled():
        set_vars.append((options.DISABLE_ENV, os.environ[options.DISABLE_ENV]))
    lines.append("environment: " + (", ".join(f"{k}={v}" for k, v in set_vars) or "no MEGAPATCH_* variable set"))
    try:
        settings, _sources = options.resolve({})
    except OptionError as exc:
        lines.append(f"ERROR: {exc}")
        return 2, "\n".join(lines)
    if options.env_disabled():
        lines.append(f"{options.DISABLE_ENV} is set: nothing would be enabled")
    code, rows = 0, []
    for patch in engine.patches():
        wanted = patch.applies(settings) and not options.env_disabled()
        package = patch.hook.split(".")[0]
        if importlib.util.find_spec(package) is None:
            rows.append((patch.name, "yes" if wanted else "no", "n/a", f"{package} is not installed"))
            continue
        problems = engine.check(patch)
        if problems:
            verdict = "INCOMPATIBLE"
            if wanted:
                code = 1
        else:
            verdict = "compatible"
        detail = "; ".join(problems) if problems else f"{len(patch.targets)} targets checked"
        if not problems and patch.backend is not None and wanted:
            detail += f"; backend: {patch.backend()}"
        rows.append((patch.name, "yes" if wanted else "no", verdict, detail))
    lines.append("")
    lines += _table(("patch", "requested", "upstream", "detail"), rows)
    lines.append("")
    lines.append("result: " + ("OK" if code == 0 else "a requested patch cannot apply (exit 1)"))
    return code, "\n".join(lines)
