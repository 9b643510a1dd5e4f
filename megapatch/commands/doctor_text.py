"""The text views of ``megapatch doctor`` and ``megapatch status``: the survey
(``megapatch.commands.doctor.survey``) rendered as lines and tables."""

from __future__ import annotations

from typing import List

from megapatch.commands.upstream_stops import LAUNCHES
from megapatch.core import options
from megapatch.core.report import _table

def _versions_lines(result: dict) -> List[str]:
    return _table(("package", "version"), [(k, v or "absent") for k, v in result["versions"].items()])


def _settings_lines(result: dict) -> List[str]:
    if result["settings"] is None:
        return [f"ERROR: {result['error']}"]
    def text(value):
        if isinstance(value, (tuple, list)):
            return ",".join(map(str, value)) or "none"
        return str(value)

    return _table(("option", "value", "from"),
                  [(k, text(v), result["sources"].get(k, "")) for k, v in result["settings"].items()])


def _supported_text(row: dict) -> str:
    supported = row["supported"]
    if not supported:
        return ""
    if isinstance(supported, dict):
        return "supported: " + ", ".join(f"{k} {v}" for k, v in supported.items())
    return f"supported: {row['package'] or ''} {supported}".replace("  ", " ")


def render_doctor(result: dict) -> str:
    lines = [f"megapatch {result['megapatch']} doctor", ""]
    lines += _versions_lines(result)
    for package, stack in result.get("stacks", {}).items():
        if stack["version"] is None:
            continue
        lines.append(f"{package} {stack['version']} (megapatch was run under {stack['tested']})"
                     + (f"; WARNING: {stack['warning']}" if stack["warning"] else ""))
    lines.append("")
    env = result["environment"]
    lines.append("environment: " + (", ".join(f"{k}={v}" for k, v in env["variables"].items())
                                    or "no MEGAPATCH_* variable set"))
    for name, close in env["unknown"].items():
        lines.append(f"WARNING: {name} is not a megapatch variable and is ignored"
                     + (f" (did you mean {close}?)" if close else ""))
    lines.append("")
    lines += _settings_lines(result)
    if result["disabled"]:
        lines.append(f"{options.DISABLE_ENV} is set: nothing would be enabled")
    activation = result["activation"]
    lines.append("")
    lines.append(f"activation: {activation['state']}: {activation['detail']}")
    if activation.get("patches"):
        lines.append("  after import: " + ", ".join(f"{k} {v}" for k, v in activation["patches"].items()
                                                    if v != "inactive"))
    rows = []
    for r in result["patches"]:
        requested = "?" if r["requested"] is None else ("opted-out" if r["opted_out"] and r["requested"]
                                                        else "yes" if r["requested"] else "no")
        detail = "; ".join(r["problems"]) if r["problems"] else f"{r['targets']} targets checked"
        if r["backend"] and r["requested"]:
            detail += f"; backend: {r['backend']}"
        supported = _supported_text(r)
        if supported:
            detail += f"; {supported}"
        for line in r.get("untested", ()):
            detail += f"; untested: {line}"
        rows.append((r["name"], requested, r["upstream"], detail))
    lines.append("")
    lines += _table(("patch", "requested", "upstream", "detail"), rows)
    lines += _flags_lines(result)
    for problem in result["problems"]:
        lines.append(f"ERROR: {problem}")
    if result["upstream_warnings"]:
        lines.append("")
        lines.append(f"({result['upstream_warnings']} upstream warnings raised while importing were hidden)")
    lines.append("")
    lines.append(f"result: {result['result']['message']}")
    return "\n".join(lines)


def _flags_lines(result: dict) -> List[str]:
    flags = result["flags"]
    if flags is None:
        return []
    lines = ["", "Megatron-LM flags: " + (" ".join(flags["argv"]) or "(none)")]
    launch = result.get("launch") or {"name": "here", "from": "default"}
    lines.append(f"  launch: {launch['name']} ({launch['from']}): {LAUNCHES.get(launch['name'], '')}")
    if flags["config"]:
        lines.append("  model and optimizer they build: " + ", ".join(f"{k}={v}" for k, v in flags["config"].items()))
    for reason in flags.get("stops", ()):
        lines.append(f"  STOPS FIRST, upstream: {reason}")
    if flags.get("stops") and flags["config"]:
        lines.append("  megapatch's own checks, run all the same:")
    for name, reason in flags["refusals"].items():
        lines.append(f"  REFUSED by {name}: {reason}")
    if flags["config"] and not flags["refusals"]:
        lines.append("  no requested patch refuses them")
    for name, note in flags.get("notes", {}).items():
        lines.append(f"  NOTE from {name} (the job logs it too): {note}")
    return lines


def _coverage_lines(result: dict) -> List[str]:
    """What each patch that would install covers and refuses (its backend line: for the MoE patches
    the paths covered and the configurations refused at construction)."""
    found = [(r["name"], r["backend"]) for r in result["patches"] if r["would_install"] and r["backend"]]
    if not found:
        return []
    return ["", "what the patches that would install cover:"] + [f"  {name}: {text}" for name, text in found]


def render_status(result: dict) -> str:
    lines = [f"megapatch {result['megapatch']}: what this environment would do",
             "versions: " + ", ".join(f"{k} {v or 'absent'}" for k, v in result["versions"].items()), ""]
    lines += _settings_lines(result)
    if result["disabled"]:
        lines.append(f"{options.DISABLE_ENV} is set: nothing would be enabled")
    lines.append("")
    rows = []
    for r in result["patches"]:
        requested = "?" if r["requested"] is None else ("yes" if r["requested"] else "no")
        rows.append((r["name"], requested, "yes" if r["opted_out"] else "no", r["upstream"],
                     "yes" if r["would_install"] else "no", r["why"]))
    lines += _table(("patch", "requested", "opted-out", "upstream", "would install", "why"), rows)
    lines += _coverage_lines(result)
    activation = result["activation"]
    if activation["state"] in ("failed", "not-run"):
        lines += ["", f"activation: {activation['state']}: {activation['detail']}"]
    lines += _flags_lines(result)
    lines += ["", f"result: {result['result']['message']}"]
    return "\n".join(lines)

