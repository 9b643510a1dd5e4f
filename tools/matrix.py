#!/usr/bin/env python3
"""Run megapatch's CPU tests against every pinned upstream version, and generate README's
supported-versions table from what actually ran.

Phases (each idempotent, each can be run alone):
  prefetch  - fill per-Python wheelhouses with `pip download` (the only networked step;
              pip honours this machine's pip.conf: the torch cap and the local CPU torch wheel)
  build     - create/reuse one venv per cell OFFLINE from the wheelhouse (uv if present,
              hard-linked from uv's cache, else venv+pip)
  test      - install the project (non-editable wheel build, offline) into the cell venv, run
              `megapatch doctor` (per-patch surface verdict) and pytest; write results/<cell>.json
  lock      - record each cell's patch-surface lock into megapatch/commands/surface_lock/ (after review)
  report    - write the supported-versions table into docs/versions.md from results/*.json

Examples:
  python tools/matrix.py all                                  # every cell, full CPU suite
  python tools/matrix.py --part 1/3 all                       # a third of the cells (CI-sized)
  python tools/matrix.py --cells mcore-0.16.1,main test -- tests/test_options.py
  python tools/matrix.py report                               # docs/versions.md from results/matrix
  python tools/matrix.py --cells mcore-0.13.1,mcore-0.19.2 --subset all  # what CI runs

The Megatron-LM main cell installs megatron-core from the pinned source tarball
../shared/megatron-lm/Megatron-LM-main-<commit[:8]>.tar.gz (or MEGATRON_LM_TARBALL) when present,
else from a local git dir holding the commit (MEGATRON_LM_GITDIR).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

def _find_python(ver: str) -> str:
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


PY311 = _find_python("3.11")
PY312 = _find_python("3.12")
TORCH = os.environ.get("MATRIX_TORCH", "2.13.0")
MAIN_COMMIT = os.environ.get("MATRIX_MAIN_COMMIT", "d98e8a64ddf34856e74b24714e3bedb2f5a39553")
# The per-patch subset each cell runs by default (`--subset`): every multi-rank test of each patch,
# ~75-100 s a cell on 2 cores. docs/versions.md and CI (.ci/run) use exactly this list.
SUBSET = ["tests/test_options.py", "tests/test_surface_lock.py", "tests/test_tp_reduce_megatron_core.py",
          "-k", "oracle or row_parallel or disabled or integer or cross_entropy or inference "
                "or align or fp8 or option or lock or refused or marked",
          "tests/test_logits.py", "tests/test_logits_fp32_inference.py",
          "tests/test_logits_fp32_dynamic_inference.py",
          "tests/test_fp8_align_transposes.py"]
COMMON = ["wrapt>=2.0", "packaging>=24.2", "pytest>=8", "pytest-timeout>=2.2"]
BUILD = ["hatchling>=1.18", "editables", "setuptools>=80", "pybind11"]


@dataclass
class Cell:
    id: str
    python: str           # interpreter
    pytag: str            # "3.11" / "3.12" (wheelhouse key)
    mcore: str            # "0.16.1" or "git:<commit>"
    numpy: str = "numpy"
    extra: list = field(default_factory=list)
    note: str = ""


def cells() -> list[Cell]:
    out = []
    for v in ["0.12.3", "0.13.1", "0.14.0", "0.15.3"]:
        out.append(Cell(f"mcore-{v}", PY311, "3.11", v, numpy="numpy<2"))
    out.append(Cell("mcore-0.16.1", PY311, "3.11", "0.16.1"))
    for v in ["0.17.1", "0.18.2", "0.19.2"]:
        out.append(Cell(f"mcore-{v}", PY312, "3.12", v))
    out.append(Cell("main", PY312, "3.12", f"git:{MAIN_COMMIT}",
                    note="Megatron-LM main (incl. #6252 FP32 logits), from the pinned tarball or MEGATRON_LM_GITDIR"))
    return out


class Runner:
    def __init__(self, a):
        self.a = a
        self.cache = Path(a.cache).resolve()
        self.results = Path(a.results).resolve()
        self.results.mkdir(parents=True, exist_ok=True)
        self.uv = os.environ.get("MATRIX_UV") or shutil.which("uv")
        self.env = dict(os.environ, UV_CACHE_DIR=str(self.cache / "uv"), PIP_DISABLE_PIP_VERSION_CHECK="1")
        # this machine sets PYTHONDONTWRITEBYTECODE=1; without .pyc every import of torch+megatron
        # costs ~2-3x, so venvs are built with --compile-bytecode (pip does that by default)

    # ------------------------------------------------------------------ helpers
    def sh(self, cmd, log, **kw):
        t = time.time()
        with open(log, "a") as f:
            f.write(f"$ {' '.join(map(str, cmd))}\n"); f.flush()
            p = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, env=kw.pop("env", self.env), **kw)
        if p.returncode:
            raise RuntimeError(f"exit {p.returncode}: {' '.join(map(str, cmd))} (see {log})")
        return time.time() - t

    def wheelhouse(self, pytag):
        return self.cache / f"wheelhouse-py{pytag}"

    def venv_dir(self, c: Cell):
        key = json.dumps([c.python, TORCH, c.mcore, c.numpy, c.extra, COMMON], sort_keys=True)
        return self.cache / "venvs" / f"{c.id}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"

    # ------------------------------------------------------------------ phases
    def prefetch(self, cs):
        log = self.results / "prefetch.log"
        for pytag in sorted({c.pytag for c in cs}):
            py = PY311 if pytag == "3.11" else PY312
            wh = self.wheelhouse(pytag); wh.mkdir(parents=True, exist_ok=True)
            reqs = [f"torch=={TORCH}", "numpy", *COMMON, *BUILD]
            self.sh([py, "-m", "pip", "download", "-q", "-d", wh, *reqs], log)
            self.sh([py, "-m", "pip", "download", "-q", "-d", wh, "numpy<2"], log)
            for c in cs:
                if c.pytag == pytag and not c.mcore.startswith("git:"):
                    self.sh([py, "-m", "pip", "download", "-q", "--no-deps", "-d", wh, f"megatron-core=={c.mcore}"], log)

    def main_tarball(self, commit: str):
        """The pinned Megatron-LM source tarball for ``commit``, if one is at hand."""
        named = os.environ.get("MEGATRON_LM_TARBALL")
        if named:
            return Path(named)
        shared = Path(self.a.project).resolve().parent / "shared" / "megatron-lm"
        found = sorted(shared.glob(f"Megatron-LM-main-{commit[:8]}*.tar.gz"))
        return found[0] if found else None

    def mcore_source(self, c: Cell, tmp: Path):
        if not c.mcore.startswith("git:"):
            return f"megatron-core=={c.mcore}"
        commit = c.mcore[4:]
        src = tmp / "mlm"; src.mkdir()
        tarball = self.main_tarball(commit)
        if tarball is not None:
            if not tarball.exists():
                raise SkipCell(f"MEGATRON_LM_TARBALL={tarball} does not exist")
            # the tarball holds one top directory (Megatron-LM/) with pyproject.toml, setup.py, megatron/
            subprocess.run(["tar", "-xzf", tarball, "-C", src, "--strip-components=1"], check=True)
            if not (src / "pyproject.toml").exists() or not (src / "megatron" / "core").is_dir():
                raise SkipCell(f"{tarball} holds no Megatron-LM source tree (pyproject.toml, megatron/core)")
            return str(src)
        gitdir = os.environ.get("MEGATRON_LM_GITDIR")
        if not gitdir or not Path(gitdir).exists():
            raise SkipCell("no Megatron-LM-main-" + commit[:8] + ".tar.gz in ../shared/megatron-lm (or "
                           "MEGATRON_LM_TARBALL), and MEGATRON_LM_GITDIR is not set or missing: the Megatron-LM "
                           "main cell needs one of them holding commit " + commit)
        ok = subprocess.run(["git", "--git-dir", gitdir, "cat-file", "-e", commit + "^{commit}"]).returncode == 0
        if not ok:
            raise SkipCell(f"commit {commit} not in {gitdir}")
        p1 = subprocess.Popen(["git", "--git-dir", gitdir, "archive", commit, "megatron/core", "pyproject.toml",
                               "setup.py", "MANIFEST.in", "README.md"], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", src], stdin=p1.stdout, check=True); p1.wait()
        return str(src)

    def build(self, c: Cell, log):
        d = self.venv_dir(c)
        if (d / ".complete").exists():
            return d, 0.0, True
        shutil.rmtree(d, ignore_errors=True)
        wh = self.wheelhouse(c.pytag)
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            src = self.mcore_source(c, Path(tmp))
            if self.uv:
                self.sh([self.uv, "venv", "-q", "-p", c.python, d], log)
                inst = [self.uv, "pip", "install", "-q", "--compile-bytecode", "--offline", "--no-index",
                        "--find-links", wh, "--python", d / "bin" / "python"]
            else:
                self.sh([c.python, "-m", "venv", d], log)
                inst = [d / "bin" / "pip", "install", "-q", "--no-index", "--find-links", wh]
            self.sh([*inst, f"torch=={TORCH}", c.numpy, *COMMON, *BUILD, *c.extra], log)
            self.sh([*inst, "--no-deps", "--no-build-isolation", src], log)
        (d / ".complete").write_text(json.dumps(asdict(c)))
        return d, time.time() - t0, False

    def test(self, c: Cell, d: Path, log):
        proj = Path(self.a.project).resolve()
        wh = self.wheelhouse(c.pytag)
        py = d / "bin" / "python"
        if self.uv:
            inst = [self.uv, "pip", "install", "-q", "--offline", "--no-index", "--find-links", wh,
                    "--python", py, "--no-deps", "--reinstall-package", "megapatch"]
        else:
            if not (d / "bin" / "pip").exists():  # an environment built by uv has no pip
                self.sh([py, "-m", "ensurepip", "-q"], log)
            inst = [py, "-m", "pip", "install", "-q", "--no-index", "--find-links", wh, "--no-deps",
                    "--force-reinstall"]
        t_inst = self.sh([*inst, proj], log)
        if self.a.update_locks:  # record this cell's lock into the repo, then ship it in the wheel
            self.sh([py, "-m", "megapatch", "lock", "--update", "--lock-dir",
                     proj / "megapatch" / "commands" / "surface_lock"], log, cwd="/")
            self.sh([*inst, proj], log)
        doctor = subprocess.run([py, "-m", "megapatch", "doctor"], cwd="/", env=self.env,
                                capture_output=True, text=True, timeout=600)
        (self.results / f"{d.name.rsplit('-', 1)[0]}.doctor.txt").write_text(doctor.stdout + doctor.stderr)
        self.doctor = _parse_doctor(doctor.stdout)
        junit = self.results / f"{c.id}.junit.xml"
        env = dict(self.env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        t0 = time.time(); r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        p = subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", junit,
                            *self.a.pytest_args], cwd=proj, env=env, capture_output=True, text=True,
                           timeout=self.a.cell_timeout)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        p.cpu_s = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        with open(log, "a") as f:
            f.write(p.stdout + p.stderr)
        return t_inst, time.time() - t0, p

    # ------------------------------------------------------------------ driver
    def lock(self, cs):
        proj = Path(self.a.project).resolve()
        for c in cs:
            d = self.venv_dir(c)
            if not (d / ".complete").exists():
                print(f"{c.id}: no environment (run build first)")
                continue
            p = subprocess.run([d / "bin" / "python", "-m", "megapatch", "lock", "--update",
                                "--lock-dir", proj / "megapatch" / "commands" / "surface_lock"],
                               cwd="/", env=self.env, capture_output=True, text=True)
            print(c.id, (p.stdout + p.stderr).strip().replace("\n", "; "))
        return 0

    def run(self, phase, cs):
        if phase == "report":
            return write_report(self.results, Path(self.a.project).resolve() / "docs" / "versions.md")
        if phase == "lock":
            return self.lock(cs)
        if phase in ("prefetch", "all"):
            t = time.time(); self.prefetch(cs); print(f"prefetch {time.time()-t:.1f}s", flush=True)
        if phase == "prefetch":
            return 0
        worst = 0
        for c in cs:
            log = self.results / f"{c.id}.log"; log.write_text("")
            res = {"cell": c.id, "python": c.pytag, "torch": TORCH, "mcore": c.mcore, "note": c.note}
            t_cell = time.time()
            try:
                d, t_build, reused = self.build(c, log)
                res.update(venv=str(d), build_s=round(t_build, 1), venv_reused=reused)
                if phase in ("test", "all"):
                    t_inst, t_test, p = self.test(c, d, log)
                    tail = (p.stdout + p.stderr).strip().splitlines()
                    res.update(patches=self.doctor, tests=_junit_counts(self.results / f"{c.id}.junit.xml"),
                               pytest_args=self.a.pytest_args, date=time.strftime("%Y-%m-%d"),
                               install_project_s=round(t_inst, 1), pytest_s=round(t_test, 1),
                               pytest_cpu_s=round(p.cpu_s, 1), loadavg=os.getloadavg(),
                               pytest_rc=p.returncode, summary=tail[-1] if tail else "",
                               status={0: "passed", 5: "no-tests"}.get(p.returncode, "failed"))
                else:
                    res["status"] = "built"
            except SkipCell as e:
                res.update(status="skipped", reason=str(e))
            except subprocess.TimeoutExpired:
                res.update(status="timeout")
            except Exception as e:  # noqa: BLE001
                res.update(status="env-error", reason=str(e))
            res["wall_s"] = round(time.time() - t_cell, 1)
            (self.results / f"{c.id}.json").write_text(json.dumps(res, indent=1))
            print(json.dumps({k: res.get(k) for k in ("cell", "status", "wall_s", "build_s", "pytest_s", "pytest_cpu_s",
                                                      "summary", "reason")}), flush=True)
            if res["status"] in ("failed", "env-error", "timeout"):
                worst = 1
        return worst


class SkipCell(Exception):
    pass


def _parse_doctor(text: str) -> dict:
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


def _junit_counts(path: Path) -> dict:
    """{test file: {passed, failed, skipped}} from a junit XML report."""
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
        else:
            entry["passed"] += 1
    return counts


# Results recorded before the test modules were named after their patch modules
RECORDED_AS = {"test_tp_reduce_mcore": "test_tp_reduce_megatron_core",
               "test_tp_reduce_te_wiring": "test_tp_reduce_transformer_engine_wiring",
               "test_tp_reduce_te_oracles": "test_tp_reduce_transformer_engine_oracles",
               "test_logits_fp32": "test_logits", "test_logits_inference": "test_logits_fp32_inference",
               "test_align_fp8_transposes": "test_fp8_align_transposes"}


def patch_modules(project: Path) -> dict:
    """``{patch module: test modules}`` read from the tree, nothing imported: each module of
    ``patches/`` is a column, proved by ``tests/test_<module>*.py``."""
    found = {}
    for path in sorted((project / "patches").glob("[!_]*.py")):
        tests = sorted(t.stem for t in (project / "tests").glob(f"test_{path.stem}*.py"))
        found[path.stem] = tuple(t for t in tests if not any(  # test_logits* must not take test_logits_fp32_inference*
            t.startswith(f"test_{other.stem}") and len(other.stem) > len(path.stem)
            for other in (project / "patches").glob(f"{path.stem}_*.py")))
    return found


def _renamed(arg: str) -> str:
    """A recorded pytest argument with the test modules' current names."""
    for old, new in RECORDED_AS.items():
        arg = arg.replace(f"tests/{old}.py", f"tests/{new}.py")
    return arg


def module_of(patch: str, modules) -> str:
    """The module a patch lives in: ``<family>_<what>`` or ``<family>`` (tests/test_architecture.py)."""
    exact = patch.replace(".", "_")
    return exact if exact in modules else patch.partition(".")[0]


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
             f"Generated by `python tools/matrix.py report` from `{results.name}/*.json` "
             f"(`python tools/matrix.py test -- <tests>` on CPU); each cell: upstream surface verdict "
             f"from `megapatch doctor` for the patches of each module of `patches/` (`?` = not recorded "
             f"then), then the tests of `tests/test_<module>*.py` passed/failed (`-` = not run).", "",
             "| upstream | python | date | " + " | ".join(columns) + " | tests run |",
             "|---" * (len(columns) + 4) + "|"]
    for r in rows:
        cells = []
        tests = {RECORDED_AS.get(name, name): c for name, c in r.get("tests", {}).items()}
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
        args = tuple(_renamed(a) for a in r.get("pytest_args") or ())
        ran.setdefault(args, []).append(r)
    for args, group in ran.items():
        names = ", ".join(f"{_upstream(r)} ({r.get('date', '?')})" for r in group)
        which = "`python tools/matrix.py --subset test`, i.e. " if list(args) == SUBSET else ""
        shown = " ".join(f'"{a}"' if " " in a else a for a in args) or "(the whole suite)"
        lines += ["", f"{names} ran {which}`pytest {shown}`."]
    lines += ["", END]
    text = readme.read_text()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + "\n".join(lines) + text[text.index(END) + len(END):]
    else:
        text += "\n" + "\n".join(lines) + "\n"
    readme.write_text(text)
    print(f"wrote the supported-versions table ({len(rows)} cells) into {readme}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", nargs="?", default="all", choices=["prefetch", "build", "test", "all", "lock", "report"])
    ap.add_argument("--project", default=".")
    ap.add_argument("--cache", default=os.environ.get("MATRIX_CACHE", os.path.expanduser("~/.cache/megapatch-matrix")))
    ap.add_argument("--results", default="results/matrix")
    ap.add_argument("--cells", help="comma list of cell ids (default: all)")
    ap.add_argument("--part", help="i/n: run the i-th of n round-robin slices of the cells")
    ap.add_argument("--cell-timeout", type=int, default=1200)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--update-locks", action="store_true",
                    help="record each cell's patch-surface lock into megapatch/commands/surface_lock/ before testing")
    ap.add_argument("--subset", action="store_true",
                    help="run the per-patch subset (SUBSET in this file) instead of the pytest args")
    ap.add_argument("pytest_args", nargs="*", default=[])
    a = ap.parse_args()
    if a.subset:
        if a.pytest_args:
            ap.error("--subset and explicit pytest args are exclusive")
        a.pytest_args = list(SUBSET)
    cs = cells()
    if a.cells:
        want = a.cells.split(","); cs = [c for c in cs if c.id in want]
    if a.part:
        i, n = map(int, a.part.split("/")); cs = cs[i - 1::n]
    if a.list:
        for c in cs:
            print(c.id, c.pytag, c.mcore)
        return 0
    return Runner(a).run(a.phase, cs)


if __name__ == "__main__":
    sys.exit(main())
