"""The structured report behind ``megapatch.status()`` and ``megapatch doctor``, and the lines
megapatch writes to a job's log.

Job-log lines go through ``logging`` (logger ``"megapatch"``) on rank 0 only: the activation line
once per activation (settings, sources, counts), the patches line once the patches pending then are
installed (which are active), and once-per-job lines (a requested patch passing through or skipped). Rank 0
is ``torch.distributed``'s rank 0 when it is initialised, else ``RANK``, else 0. Launchers such as
Megatron-LM's may never configure logging for this logger: while no handler is configured on its
chain, megapatch attaches a minimal stderr handler to the ``"megapatch"`` logger only (never the
root logger) and removes it again once the application configures its own handlers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

from megapatch.core import options

log = logging.getLogger("megapatch")
_said: set = set()
_said_lock = threading.Lock()
_handler: Optional[logging.Handler] = None
_level_set_here = False


@dataclasses.dataclass(frozen=True)
class PatchReport:
    name: str
    option: Optional[str]
    summary: str
    state: str  # active | pending-import | inactive | skipped | incompatible | opted-out
    targets: Tuple[str, ...] = ()
    aliases: Tuple[str, ...] = ()
    reason: Optional[str] = None
    backend: Optional[str] = None
    supports: Dict[str, str] = dataclasses.field(default_factory=dict)  # package -> tested versions


@dataclasses.dataclass(frozen=True)
class Status:
    enabled: bool
    settings: Dict[str, object]
    sources: Dict[str, str]
    versions: Dict[str, Optional[str]]
    patches: Tuple[PatchReport, ...]

    @property
    def active(self) -> List[str]:
        return [p.name for p in self.patches if p.state == "active"]

    def patch(self, name: str) -> PatchReport:
        for report in self.patches:
            if report.name == name:
                return report
        raise KeyError(name)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        lines = [f"megapatch {'enabled' if self.enabled else 'disabled'}"]
        lines.append("versions: " + ", ".join(f"{k} {v or 'absent'}" for k, v in self.versions.items()))
        lines.append("")
        def text(name, value):
            option = options.OPTIONS_BY_NAME.get(name)
            return option.text(value) if option is not None else str(value)

        lines += _table(("option", "value", "from"),
                        [(k, text(k, v), self.sources.get(k, "")) for k, v in self.settings.items()])
        lines.append("")
        rows = []
        for p in self.patches:
            detail = p.reason or ""
            if p.backend:
                detail = f"backend: {p.backend}" + (f"; {detail}" if detail else "")
            rows.append((p.name, p.state, str(len(p.targets)), detail))
        lines += _table(("patch", "state", "wrapped", "detail"), rows)
        wrapped = [(p.name, t) for p in self.patches for t in p.targets]
        wrapped += [(p.name, f"{a} (alias)") for p in self.patches for a in p.aliases]
        if wrapped:
            lines.append("")
            lines += _table(("patch", "upstream target wrapped"), wrapped)
        return "\n".join(lines)


def _table(header, rows) -> List[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row).rstrip() for row in rows]
    return out


def _job_view(ask: str, variable: str, default: int) -> int:
    """torch.distributed's answer (``ask``: get_rank / get_world_size) if it is initialised (without
    importing torch), else the launcher's variable, else ``default``."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return getattr(dist, ask)()
    except Exception:  # noqa: BLE001 -- a half-initialised backend: fall back to the launcher's view
        pass
    try:
        return int(os.environ.get(variable, str(default)))
    except ValueError:
        return default


def job_rank() -> int:
    """This process's rank in the job: torch.distributed's if initialised, else ``RANK``, else 0."""
    return _job_view("get_rank", "RANK", 0)


def job_size() -> int:
    """How many ranks the job has: torch.distributed's world size if initialised, else
    ``WORLD_SIZE`` (set by torchrun and most launchers), else 1."""
    return _job_view("get_world_size", "WORLD_SIZE", 1)


def _configured_elsewhere() -> bool:
    logger: Optional[logging.Logger] = log
    while logger is not None:
        if any(h is not _handler for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def ensure_visible() -> None:
    """Make INFO lines of the ``"megapatch"`` logger reach stderr when nothing else would."""
    global _handler, _level_set_here
    if _configured_elsewhere():
        if _handler is not None:
            log.removeHandler(_handler)
            _handler = None
            if _level_set_here:
                log.setLevel(logging.NOTSET)
                _level_set_here = False
        return
    if _handler is None:
        _handler = logging.StreamHandler()  # sys.stderr
        _handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(_handler)
    if log.level == logging.NOTSET and log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
        _level_set_here = True


_muted = 0


@contextlib.contextmanager
def muted() -> Iterator[None]:
    """No job-log lines in this block: ``megapatch doctor`` / ``status`` import megatron as a job
    would, and the activation that triggers must not read as if the command switched anything on."""
    global _muted
    _muted += 1
    try:
        yield
    finally:
        _muted -= 1


def job_line(level: str, message: str) -> bool:
    """Log ``message`` on rank 0 only. Returns whether this process logged it."""
    if _muted or job_rank() != 0:
        return False
    ensure_visible()
    getattr(log, level)(message)
    return True


def once(key: str, level: str, message: str) -> bool:
    """``job_line`` the first time ``key`` is seen in this process (once per job on rank 0)."""
    with _said_lock:
        if key in _said:
            return False
        _said.add(key)
    return job_line(level, message)


_ORDER = ("active", "pending-import", "opted-out", "skipped", "incompatible")


def activation_line(status: "Status") -> str:
    """One short line: every setting with its source, how many patches are in each state, versions.
    Which patches: the patches line (``patches_line``) and ``megapatch.status()``."""
    settings = ", ".join(
        f"{o.name}={o.text(status.settings[o.name])} ({status.sources.get(o.name, 'default')})"
        for o in options.OPTIONS if o.name in status.settings)
    counts: Dict[str, int] = {}
    for p in status.patches:
        if p.state != "inactive":
            counts[p.state] = counts.get(p.state, 0) + 1
    patches = ", ".join(f"{counts[state]} {state}" for state in _ORDER if state in counts)
    versions = ", ".join(f"{k} {v}" for k, v in status.versions.items() if v)
    return f"megapatch enabled: {settings} | patches: {patches or 'none requested'} | {versions}"


def _requested_count(status: "Status") -> str:
    requested = [p for p in status.patches if p.state != "inactive"]
    return f"{len(status.active)} of {len(requested)} requested patches active"


def patches_line(status: "Status") -> str:
    """Which patches are active, once the pending ones are installed (names only; the reasons and
    backends are in ``megapatch.status()``): ``megapatch installed: patches active: a, b; pending-import:
    c (until m is imported); opted-out: d | 2 of 4 requested patches active``."""
    groups: Dict[str, List[str]] = {}
    for p in status.patches:
        if p.state != "inactive":
            text = p.name
            if p.state == "pending-import" and p.reason:  # "installs when <modules> is imported"
                text += f" ({p.reason.replace('installs when ', 'until ')})"
            groups.setdefault(p.state, []).append(text)
    said = [f"patches active: {', '.join(groups.pop('active', [])) or 'none'}"]
    said += [f"{state}: {', '.join(groups[state])}" for state in _ORDER if state in groups]
    return f"megapatch installed: {'; '.join(said)} | {_requested_count(status)}"


def installed_later_line(status: "Status", names: List[str], module: str) -> str:
    """A patch installed after the patches line was said (its module imported late)."""
    return f"megapatch installed later: {', '.join(names)} ({module} imported) | {_requested_count(status)}"


def warn_unknown_env_variables(environ: Optional[Mapping[str, str]] = None,
                               known: Optional[Tuple[str, ...]] = None) -> List[Tuple[str, Optional[str]]]:
    """Log (once per job, on rank 0) each ``MEGAPATCH_*`` variable megapatch does not read, with
    the closest valid name. Returns what ``options.unknown_env_variables`` found."""
    found = options.unknown_env_variables(environ, known)
    for name, close in found:
        hint = f"; did you mean {close}?" if close else f"; known: {', '.join(options.known_env_variables())}"
        once(f"unknown-env:{name}", "warning",
                    f"megapatch: {name} is not a megapatch variable and is ignored{hint}")
    return found
