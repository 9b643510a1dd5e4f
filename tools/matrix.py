"""What the version matrix needs beyond nox: the cells, the upstream source of the Megatron-LM main
cell, reading `megapatch doctor`/`megapatch lock`/junit output, and the generated table.

`noxfile.py` (repo top level) does the environment work: one reused virtualenv per cell
(`nox -s "cell(mcore-0.16.1)"`, all cells: `nox -s cell`), built from a per-Python wheelhouse,
megapatch installed as a wheel, then `megapatch doctor`, `megapatch lock` and pytest, each cell's
results written to results/matrix/<cell>.json; `nox -s report` writes docs/versions.md's table.
This module imports nothing outside the standard library, so the tests (and `.ci/run`, which reads
`PY312`) use it without nox.

Kept out of the noxfile, because nox has no equivalent:
  - interpreters installed by pyenv but not selected (its shims exit 127 and nox's discovery
    rejects them): `find_python` gives nox an absolute path;
  - megatron-core from a pinned source tarball (Megatron-LM main), with a reason when it is absent;
  - the verdicts of `megapatch doctor`, the lock differences (additions vs changed fingerprints)
    and per-module junit counts, written as JSON;
  - the supported-versions table generated from those JSON files (`write_report`).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path


def find_python(ver: str) -> str:
    """First interpreter that really runs (a pyenv shim for a non-selected version exits 127)."""
    roots = {Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser(), Path("~/.pyenv").expanduser()}
    pyenv = sorted((str(p) for r in roots for p in (r / "versions").glob(f"{ver}.*/bin/python{ver}")), reverse=True)
    cands = [os.environ.get(f"MATRIX_PY{ver.replace('.', '')}"), f"python{ver}", *pyenv]
    for c in filter(None, cands):
        try:
            if subprocess.run([c, "-c", "pass"], capture_output=True).returncode == 0:
                return shutil.which(c) or c
        except OSError:  # not on PATH / not executable
            continue
    return f"python{ver}"


PY311 = find_python("3.11")
PY312 = find_python("3.12")
TORCH = os.environ.get("MATRIX_TORCH", "2.13.0")
MAIN_COMMIT = os.environ.get("MATRIX_MAIN_COMMIT", "d98e8a64ddf34856e74b24714e3bedb2f5a39553")
# The per-patch subset each cell runs by default: every multi-rank test of each patch. The -k
# expression applies to every file listed ("invariant", "option", "lock", "inference", "fp8",
# "align" select whole modules by their names). docs/versions.md and CI (.ci/run) use exactly this.
SUBSET = ["tests/test_options.py", "tests/test_surface_lock.py", "tests/test_tp_reduce_megatron_core.py",
          "-k", "oracle or row_parallel or disabled or integer or cross_entropy or inference "
                "or align or fp8 or option or lock or refused or marked or invariant",
          "tests/test_logits.py", "tests/test_logits_fp32_inference.py",
          "tests/test_logits_fp32_dynamic_inference.py",
          "tests/test_fp8_align_transposes.py", "tests/test_tp_invariant.py"]
COMMON = ["wrapt>=2.0", "packaging>=24.2", "pytest>=8", "pytest-timeout>=2.2"]
BUILD = ["hatchling>=1.18", "editables", "setuptools>=80", "pybind11"]


@dataclass
class Cell:
    id: str
    python: str           # interpreter (absolute path where found)
    pytag: str            # "3.11" / "3.12" (wheelhouse key)
    mcore: str            # "0.16.1" or "git:<commit>"
    numpy: str = "numpy"
    extra: list = field(default_factory=list)
    note: str = ""

    def requirements(self) -> list:
        """Everything but megatron-core, installed from the wheelhouse."""
        return [f"torch=={TORCH}", self.numpy, *COMMON, *BUILD, *self.extra]

    def key(self) -> str:
        """What the cell's environment is made of: a reused environment must match it."""
        return json.dumps([self.python, self.mcore, self.requirements()])


def cells() -> list[Cell]:
    out = []
    for v in ["0.12.3", "0.13.1", "0.14.0", "0.15.3"]:
        out.append(Cell(f"mcore-{v}", PY311, "3.11", v, numpy="numpy<2"))
    out.append(Cell("mcore-0.16.1", PY311, "3.11", "0.16.1"))
    for v in ["0.17.1", "0.18.2", "0.19.2"]:
        out.append(Cell(f"mcore-{v}", PY312, "3.12", v))
    out.append(Cell("main", PY312, "3.12", f"git:{MAIN_COMMIT}",
                    note="Megatron-LM main (incl. #6252 FP32 logits), from the pinned tarball"))
    return out




def main_tarball(project: Path, commit: str):
    """The pinned Megatron-LM source tarball for ``commit``, if one is at hand."""
    named = os.environ.get("MEGATRON_LM_TARBALL")
    if named:
        return Path(named)
    shared = Path(project).resolve().parent / "shared" / "megatron-lm"
    found = sorted(shared.glob(f"Megatron-LM-main-{commit[:8]}*.tar.gz"))
    return found[0] if found else None


def mcore_source(cell: Cell, project: Path, tmp: Path) -> str:
    """A pip requirement for the cell's megatron-core: a pin, or the unpacked main tarball."""
    if not cell.mcore.startswith("git:"):
        return f"megatron-core=={cell.mcore}"
    commit = cell.mcore[4:]
    tarball = main_tarball(project, commit)
    if tarball is None or not tarball.exists():
        raise SkipCell(f"no Megatron-LM-main-{commit[:8]}.tar.gz in ../shared/megatron-lm and "
                       f"MEGATRON_LM_TARBALL={os.environ.get('MEGATRON_LM_TARBALL')!s} does not name one: "
                       f"the Megatron-LM main cell needs the source of commit {commit}")
    src = Path(tmp) / "mlm"
    src.mkdir()
    with tarfile.open(tarball) as tf:  # one top directory (Megatron-LM/) holding pyproject.toml, megatron/
        for member in tf.getmembers():
            member.name = member.name.partition("/")[2]
            if member.name:
                tf.extract(member, src, filter="data")
    if not (src / "pyproject.toml").exists() or not (src / "megatron" / "core").is_dir():
        raise SkipCell(f"{tarball} holds no Megatron-LM source tree (pyproject.toml, megatron/core)")
    return str(src)


def lock_changes(text: str) -> list[str]:
    """The differences in `megapatch lock`'s output that change a recorded fingerprint (as opposed
    to a symbol the lock lacks or no longer needs): these need a human, never `--update`."""
    return [line for line in text.splitlines() if line.rstrip().endswith("changed")]




def parse_doctor(text: str) -> dict:
    """{patch: verdict} from `megapatch doctor`'s table (compatible / INCOMPATIBLE / n/a)."""
    verdicts, in_table = {}, False
    for line in text.splitlines():
        if line.startswith("patch ") and "upstream" in line:
            in_table = True
            continue
        if in_table:
            if not line.strip() or line.startswith("result:"):
                break
            if line.startswith("-"):
                continue
            parts = line.split()
            if len(parts) >= 3:
                verdicts[parts[0]] = {"verdict": parts[2],
                                      "detail": line.split(parts[2], 1)[1].strip()}
    return verdicts


def junit_counts(path: Path) -> dict:
    """{test file: {passed, failed, skipped, skip_reasons: {reason: n}}} from a junit XML report."""
    import xml.etree.ElementTree as ET

    counts: dict = {}
    if not path.exists():
        return counts
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")[-1] or "?"
        entry = counts.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
        if case.find("failure") is not None or case.find("error") is not None:
            entry["failed"] += 1
        elif case.find("skipped") is not None:
            entry["skipped"] += 1
            reason = case.find("skipped").get("message", "").removeprefix("Skipped: ").strip()
            reasons = entry.setdefault("skip_reasons", {})
            reasons[reason] = reasons.get(reason, 0) + 1
        else:
            entry["passed"] += 1
    return counts


def patch_modules(project: Path) -> dict:
    """``{patch family: test modules}`` read from the tree, nothing imported: each family package of
    ``patches/`` is a column, proved by ``tests/test_<family>*.py``."""
    found = {}
    for path in sorted(p for p in (project / "patches").iterdir() if p.is_dir() and not p.name.startswith("_")
                       and (p / "__init__.py").exists()):
        found[path.name] = tuple(sorted(t.stem for t in (project / "tests").glob(f"test_{path.name}*.py")))
    return found


def module_of(patch: str, modules) -> str:
    """The column of a patch: its family, ``<family>`` of ``<family>.<what>`` (tests/test_architecture.py)."""
    return patch.partition(".")[0]


BEGIN, END = "<!-- supported-versions:begin -->", "<!-- supported-versions:end -->"


def _upstream(r: dict) -> str:
    return r["mcore"] if not str(r["mcore"]).startswith("git:") else f"Megatron-LM main {r['mcore'][4:12]}"


def write_report(results: Path, readme: Path) -> int:
    rows = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    rows = [r for r in rows if "cell" in r]
    if not rows:
        print(f"no results in {results}")
        return 1
    project = readme.resolve().parent.parent
    modules = patch_modules(project)
    columns = list(modules)
    lines = [BEGIN, "",
             f"Generated by `nox -s report` from `{results.name}/*.json` "
             f"(`nox -s \"cell(<cell>)\"` on CPU); each cell: upstream surface verdict "
             f"from `megapatch doctor` for the patches of each family of `patches/` (`?` = not recorded "
             f"then), then the tests of `tests/test_<family>*.py` passed/failed (`-` = not run).", "",
             "| upstream | python | date | " + " | ".join(columns) + " | tests run |",
             "|---" * (len(columns) + 4) + "|"]
    for r in rows:
        cells = []
        tests = r.get("tests", {})
        for column in columns:
            found = {name: v.get("verdict", "?") for name, v in r.get("patches", {}).items()
                     if module_of(name, modules) == column}
            verdicts = sorted(set(found.values()))
            verdict = ("?" if not verdicts else verdicts[0] if len(verdicts) == 1
                       else "; ".join(f"{n}: {v}" for n, v in sorted(found.items())))
            counts = [tests.get(m) for m in modules[column]]
            counts = [c for c in counts if c]
            if counts:
                passed = sum(c["passed"] for c in counts)
                failed = sum(c["failed"] for c in counts)
                skipped = sum(c["skipped"] for c in counts)
                verdict += (f", {passed} passed" + (f", {skipped} skipped" if skipped else "")
                            + (f", **{failed} failed**" if failed else ""))
            cells.append(verdict)
        upstream = _upstream(r)
        status = r.get("status", "?")
        summary = r.get("summary", r.get("reason", ""))
        lines.append(f"| {upstream} | {r.get('python')} | {r.get('date', '')} | " + " | ".join(cells)
                     + f" | {status}: {summary} |")
    ran: dict = {}
    for r in rows:
        args = tuple(r.get("pytest_args") or ())
        ran.setdefault(args, []).append(r)
    for args, group in ran.items():
        names = ", ".join(f"{_upstream(r)} ({r.get('date', '?')})" for r in group)
        which = "`nox -s cell`, i.e. " if list(args) == SUBSET else ""
        shown = " ".join(f'"{a}"' if " " in a else a for a in args) or "(the whole suite)"
        lines += ["", f"{names} ran {which}`pytest {shown}`."]
    skips: dict = {}
    for r in rows:
        for name, c in sorted(r.get("tests", {}).items()):
            for reason, n in sorted(c.get("skip_reasons", {}).items()):
                skips.setdefault((name, reason), []).append(f"{_upstream(r)} ({n})")
    if skips:
        lines += ["", "Skipped tests, with the reason each gives (cell, number of tests):", ""]
        lines += [f"- `{name}` on {', '.join(where)}: {reason}" for (name, reason), where in sorted(skips.items())]
    lines += ["", END]
    text = readme.read_text()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + "\n".join(lines) + text[text.index(END) + len(END):]
    else:
        text += "\n" + "\n".join(lines) + "\n"
    readme.write_text(text)
    print(f"wrote the supported-versions table ({len(rows)} cells) into {readme}")
    return 0


