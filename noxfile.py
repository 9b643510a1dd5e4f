"""The version matrix: megapatch's CPU tests against every pinned upstream version, and the
supported-versions table in docs/versions.md generated from what actually ran.

    nox -s cell                          # every cell, one after another, the per-patch subset
    nox -s "cell(mcore-0.16.1)"          # one cell (`nox -l` lists them)
    nox -s "cell(main)" -- tests/test_options.py     # other pytest arguments
    nox -s cell -- --update-locks        # also record missing lock entries (never a changed one)
    nox -s report                        # docs/versions.md from results/matrix/*.json

Each cell is a reused virtualenv under $MATRIX_CACHE/nox (default ~/.cache/megapatch-matrix):
torch, numpy and the test tools from a per-Python wheelhouse ($MATRIX_CACHE/wheelhouse-py3.X,
filled by `pip download`, the only networked step; MATRIX_OFFLINE=1 skips it), megatron-core
pinned with --no-deps (Megatron-LM main from the pinned tarball in ../shared/megatron-lm/), then
megapatch installed as a wheel, `megapatch doctor` (each patch's surface verdict), `megapatch
lock` and pytest. Results go to $MATRIX_RESULTS (default results/matrix). What nox has no
equivalent for lives in tools/matrix.py.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
import matrix  # noqa: E402

CACHE = Path(os.environ.get("MATRIX_CACHE", "~/.cache/megapatch-matrix")).expanduser().resolve()
RESULTS = Path(os.environ.get("MATRIX_RESULTS", ROOT / "results" / "matrix")).resolve()

nox.options.envdir = str(CACHE / "nox")
nox.options.reuse_venv = "yes"          # a cell's environment is built once, then reused
nox.options.download_python = "never"   # the interpreters are this machine's (matrix.find_python)
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["cell"]


def _wheelhouse(cell: matrix.Cell) -> Path:
    return CACHE / f"wheelhouse-py{cell.pytag}"


def _prepare(session: nox.Session, cell: matrix.Cell) -> bool:
    """Install the cell's upstream into its environment unless a reused one already holds it."""
    marker = Path(session.virtualenv.location) / ".matrix-cell"
    if marker.exists() and marker.read_text() == cell.key():
        return True
    wheelhouse = str(_wheelhouse(cell))
    with tempfile.TemporaryDirectory() as tmp:
        mcore = matrix.mcore_source(cell, ROOT, Path(tmp))
        if os.environ.get("MATRIX_OFFLINE") != "1":
            session.run("python", "-m", "pip", "download", "-q", "-d", wheelhouse, *cell.requirements())
            if not cell.mcore.startswith("git:"):
                session.run("python", "-m", "pip", "download", "-q", "--no-deps", "-d", wheelhouse, mcore)
        session.install("--no-index", "--find-links", wheelhouse, *cell.requirements())
        session.install("--no-index", "--find-links", wheelhouse, "--no-deps", "--no-build-isolation", mcore)
    marker.write_text(cell.key())
    return False


@nox.session(venv_backend="venv")
@nox.parametrize("python,cell", [nox.param(c.python, c, id=c.id) for c in matrix.cells()])
def cell(session: nox.Session, cell: matrix.Cell) -> None:
    """One upstream version: its environment, doctor, lock, and the per-patch subset (or posargs)."""
    update_locks = "--update-locks" in session.posargs
    pytest_args = [a for a in session.posargs if a != "--update-locks"] or list(matrix.SUBSET)
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS / f"{cell.id}.log"
    res = {"cell": cell.id, "python": cell.pytag, "torch": matrix.TORCH, "mcore": cell.mcore,
           "note": cell.note, "venv": session.virtualenv.location}
    t_cell = time.time()
    with open(log_path, "w") as log:
        def run(*args, **kw):
            log.write(f"$ {' '.join(map(str, args))}\n")
            log.flush()
            return session.run(*args, stdout=log, **kw)
        try:
            t0 = time.time()
            res["venv_reused"] = _prepare(session, cell)
            res["build_s"] = round(time.time() - t0, 1)
            t0 = time.time()
            # a regular wheel (the startup .pth and megapatch.patches as users get them), rebuilt each run
            install_project = ("python", "-m", "pip", "install", "-q", "--no-index", "--find-links",
                               str(_wheelhouse(cell)), "--no-deps", "--force-reinstall", str(ROOT))
            run(*install_project)
            res["install_project_s"] = round(time.time() - t0, 1)
            with session.chdir("/"):  # the installed megapatch, not the tree
                lock = session.run("python", "-m", "megapatch", "lock", silent=True, success_codes=[0, 1],
                                   env={"PYTHONWARNINGS": "ignore"})
                changed = matrix.lock_changes(lock)
                res["lock"] = lock.strip().splitlines()
                if update_locks and changed:
                    raise RuntimeError("changed fingerprints need a review, not --update-locks: "
                                       + "; ".join(changed))
                if update_locks and "matches" not in lock:
                    lock_dir = ROOT / "megapatch" / "commands" / "surface_lock"
                    run("python", "-m", "megapatch", "lock", "--update", "--lock-dir", str(lock_dir))
                    run(*install_project)  # ship the lock just recorded
                doctor = session.run("python", "-m", "megapatch", "doctor", silent=True,
                                     success_codes=range(256))
            (RESULTS / f"{cell.id}.doctor.txt").write_text(doctor)
            junit = RESULTS / f"{cell.id}.junit.xml"
            junit.unlink(missing_ok=True)
            t0, r0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
            try:
                run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(junit),
                    *pytest_args, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
                rc = 0
            except nox.command.CommandFailed as failed:
                rc = failed.return_code
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            log.flush()
            tail = log_path.read_text().strip().splitlines()
            res.update(patches=matrix.parse_doctor(doctor), tests=matrix.junit_counts(junit),
                       pytest_args=pytest_args, date=time.strftime("%Y-%m-%d"),
                       pytest_s=round(time.time() - t0, 1),
                       pytest_cpu_s=round(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, 1),
                       loadavg=os.getloadavg(), pytest_rc=rc, summary=tail[-1] if tail else "",
                       status={0: "passed", 5: "no-tests"}.get(rc, "failed"))
        except matrix.SkipCell as e:
            res.update(status="skipped", reason=str(e))
        except Exception as e:  # noqa: BLE001 - recorded in the cell's JSON, then the session fails
            res.update(status="env-error", reason=str(e) or type(e).__name__)
    res["wall_s"] = round(time.time() - t_cell, 1)
    (RESULTS / f"{cell.id}.json").write_text(json.dumps(res, indent=1) + "\n")
    session.log(json.dumps({k: res.get(k) for k in ("cell", "status", "wall_s", "build_s", "pytest_s",
                                                    "pytest_cpu_s", "summary", "reason")}))
    if res["status"] == "skipped":
        session.skip(res["reason"])
    if res["status"] != "passed":
        session.error(f"{cell.id}: {res['status']}: {res.get('reason', res.get('summary'))} (see {log_path})")


@nox.session(python=False)
def report(session: nox.Session) -> None:
    """Write docs/versions.md's supported-versions table from the cells' results."""
    if matrix.write_report(RESULTS, ROOT / "docs" / "versions.md"):
        session.error(f"no results in {RESULTS}")
