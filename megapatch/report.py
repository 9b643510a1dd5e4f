"""The structured report behind ``megapatch.status()`` and ``megapatch doctor``."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple


@dataclasses.dataclass(frozen=True)
class PatchReport:
    name: str
    option: Optional[str]
    summary: str
    state: str  # active | pending-import | inactive | skipped | incompatible
    targets: Tuple[str, ...] = ()
    aliases: Tuple[str, ...] = ()
    reason: Optional[str] = None
    backend: Optional[str] = None


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
        lines += _table(("option", "value", "from"),
                        [(k, str(v), self.sources.get(k, "")) for k, v in self.settings.items()])
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
