"""Startup cost of megapatch at scale (issue 10, item 5), as CPU time of fresh interpreters.

(a) ``python -c pass`` with a ``MEGAPATCH_*`` variable set, megatron never imported, against the
    same command with no variable (goal: within 2 ms CPU). For context, a third row imports the
    engine eagerly, as the startup hook did before it deferred its imports.
(b) The TE wiring verdict the TE patch's probe needs (``megapatch.te_check.verdict.installed_problem``)
    in a fresh process that has megapatch's engine loaded, as a rank has when the probe runs:
    the first process of a TE installation runs the static check over TE's sources and stores
    the verdict; every later process (every rank, every job) reads it (goal: under 100 ms per
    rank). TE's sources come from the ``transformer-engine`` py3-none-any wheel
    of ``--te-version`` (downloaded into the static check's wheel cache when missing), extracted
    and put on ``PYTHONPATH`` -- the probe locates TE with ``find_spec`` and never imports it.
(c) ``import megatron.core`` with ``MEGAPATCH_TP_REDUCE_DTYPE=fp32`` against no variable: what
    activation (engine import, patch discovery, surface checks, wrapping) costs a rank.
(d) with ``--te-python``: ``enable(tp_reduce_dtype="fp32")`` + the first ``import
    transformer_engine.pytorch`` in a Python that has TE installed (the TE patch installs, its
    probe runs), against the plain import: first process of the installation, then later ones.

CPU time is user+system of the child (``resource.getrusage(RUSAGE_CHILDREN)`` deltas), medians
over runs that alternate between the rows. Run it in the environment megapatch is pip-installed
in (its ``.pth`` must be there)::

    python benchmarks/startup_cost.py [--runs 200] [--import-runs 7] [--te-version 2.20.2]
        [--te-python <venv with TE>/bin/python]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

CLEAN = {k: v for k, v in os.environ.items()
         if not k.startswith("MEGAPATCH_") and k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}


def cpu_ms(cmd, env, cwd) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return 1000 * ((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))


def alternate(rows, runs, cwd):
    """``{label: [ms, ...]}``, one run of each row per round (load changes hit all rows alike)."""
    for _label, cmd, env in rows:  # warm-up: bytecode caches written, files in the page cache
        subprocess.run(cmd, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    times = {label: [] for label, _cmd, _env in rows}
    for _ in range(runs):
        for label, cmd, env in rows:
            times[label].append(cpu_ms(cmd, env, cwd))
    return times


def table(times, base):
    ref = statistics.median(times[base])
    lines = ["| case | median CPU ms | vs first row |", "|---|---|---|"]
    for label, values in times.items():
        med = statistics.median(values)
        lines.append(f"| {label} | {med:.2f} | {med - ref:+.2f} ms |")
    return "\n".join(lines)


def startup(runs, cwd):
    py = sys.executable
    rows = [
        ("`python -c pass`, no MEGAPATCH_* variable", [py, "-c", "pass"], CLEAN),
        ("`python -c pass`, MEGAPATCH_TP_REDUCE_DTYPE=fp32", [py, "-c", "pass"],
         {**CLEAN, "MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}),
        ("(context) no variable, `python -c 'import megapatch.core.engine'` (the eager hook's imports)",
         [py, "-c", "import megapatch.core.engine"], CLEAN),
    ]
    return table(alternate(rows, runs, cwd), rows[0][0])


def te_tree(version, workdir):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import te_releases

    claimed = te_releases.claimed_versions()
    wheel = te_releases.ensure_wheels({version: claimed[version]})[version]
    root = os.path.join(workdir, f"te-{version}")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root, [n for n in archive.namelist() if n.startswith("transformer_engine/")])
    return root


PROBE = """
import sys, time
import megapatch.core.engine  # loaded before the probe runs in a rank (enable() -> patch install)
from megapatch.patches.tp_reduce import transformer_engine as spec  # (the patch module calls the probe)
t0 = time.process_time()
from megapatch.te_check import verdict
problem = verdict.installed_problem(spec)
ms = 1000 * (time.process_time() - t0)
print(f"{ms:.1f} {problem is None} {'megapatch.te_check.wiring' in sys.modules}")
"""


def te_verdict_cost(version, workdir, runs):
    root = te_tree(version, workdir)
    cache = tempfile.mkdtemp(prefix="cache-", dir=workdir)
    env = {**CLEAN, "PYTHONPATH": root, "XDG_CACHE_HOME": cache}

    def probe():
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=workdir, check=True,
                             capture_output=True, text=True).stdout.split()
        return float(out[0]), out[1] == "True", out[2] == "True"

    first = probe()
    later = [probe() for _ in range(runs)]
    assert first[1] and all(ok for _, ok, _ in later), "the TE wiring check reported problems"
    return "\n".join([
        "| TE wiring verdict, fresh process | CPU ms (in-process) | static checker imported |",
        "|---|---|---|",
        f"| first process of the installation (runs the check, stores it) | {first[0]:.1f} | {first[2]} |",
        f"| every later process (median of {runs}) | {statistics.median(t for t, _, _ in later):.1f} | "
        f"{any(imp for _, _, imp in later)} |",
    ])


def activation(runs, cwd):
    py = sys.executable
    code = "import megatron.core"
    rows = [("`import megatron.core`, no variable", [py, "-c", code], CLEAN),
            ("`import megatron.core`, MEGAPATCH_TP_REDUCE_DTYPE=fp32 (megapatch activates)",
             [py, "-c", code], {**CLEAN, "MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})]
    return table(alternate(rows, runs, cwd), rows[0][0])


TE_IMPORT = """
import os, sys, time
import torch  # TE needs torch first
t0 = time.process_time()
if os.environ.get("BENCH_ENABLE") == "before":
    import megapatch
    megapatch.enable(tp_reduce_dtype="fp32")
import transformer_engine.pytorch
t1 = time.process_time()
if os.environ.get("BENCH_ENABLE") == "after":  # the same work, timed alone: installs at once
    import megapatch
    megapatch.enable(tp_reduce_dtype="fp32")
t2 = time.process_time()
if os.environ.get("BENCH_ENABLE"):
    assert "tp_reduce.transformer_engine" in megapatch.status().active, megapatch.status()
print(f"{1000 * (t1 - t0):.1f} {1000 * (t2 - t1):.1f}")
"""


def te_enable_cost(te_python, runs, workdir):
    """enable() + first import of transformer_engine.pytorch in a Python that has TE installed
    (megapatch from this checkout on PYTHONPATH), against the same import without megapatch; and
    enable() alone right after the import (the same work, without the import's noise)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**CLEAN, "PYTHONPATH": repo, "PYTHONWARNINGS": "ignore"}

    def once(enable, cache):
        out = subprocess.run([te_python, "-c", TE_IMPORT], env={**env, "BENCH_ENABLE": enable,
                                                                "XDG_CACHE_HOME": cache},
                             cwd=workdir, check=True, capture_output=True, text=True).stdout
        return [float(x) for x in out.split()[-2:]]

    cold = lambda: tempfile.mkdtemp(prefix="cache-", dir=workdir)  # noqa: E731
    warm = cold()
    once("", warm)  # warm-up: page cache, bytecode
    first_before = once("before", cold())[0]
    first_after = once("after", cold())[1]
    native, before, after = [], [], []
    for _ in range(runs):
        native.append(once("", warm)[0])
        before.append(once("before", warm)[0])
        after.append(once("after", warm)[1])
    base = statistics.median(native)
    med = statistics.median
    return "\n".join([
        "| fresh process, after `import torch` | CPU ms | vs native |",
        "|---|---|---|",
        f"| `import transformer_engine.pytorch`, native (median of {runs}) | {base:.1f} | |",
        f"| `enable(tp_reduce_dtype='fp32')` + that import, first process of the TE installation | "
        f"{first_before:.1f} | {first_before - base:+.1f} |",
        f"| `enable(tp_reduce_dtype='fp32')` + that import, later processes (median of {runs}) | "
        f"{med(before):.1f} | {med(before) - base:+.1f} |",
        f"| `enable(tp_reduce_dtype='fp32')` alone, right after the import, first process | {first_after:.1f} | |",
        f"| `enable(tp_reduce_dtype='fp32')` alone, right after the import, later processes "
        f"(median of {runs}) | {med(after):.1f} | |",
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="rounds of (a); 0 skips it")
    parser.add_argument("--import-runs", type=int, default=7, help="rounds of (c); 0 skips it")
    parser.add_argument("--te-version", default="2.20.2", help="TE release for (b); '' skips it")
    parser.add_argument("--te-runs", type=int, default=10)
    parser.add_argument("--te-python", default=None,
                        help="a Python with TE installed, for (d): enable() + first TE import")
    args = parser.parse_args()
    if not os.path.exists(os.path.join(sysconfig.get_paths()["purelib"], "megapatch-startup.pth")):
        sys.exit("megapatch's startup .pth is not installed in this environment: pip install it first")
    with tempfile.TemporaryDirectory(prefix="megapatch-startup-") as workdir:
        print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
        if args.runs:
            print(f"(a) interpreter start, {args.runs} rounds\n\n{startup(args.runs, workdir)}\n")
        if args.te_version:
            print(f"(b) TE {args.te_version} wiring verdict\n\n"
                  f"{te_verdict_cost(args.te_version, workdir, args.te_runs)}\n")
        if args.te_python:
            print(f"(d) enable() + first TE import\n\n"
                  f"{te_enable_cost(args.te_python, args.te_runs, workdir)}\n")
        if args.import_runs:
            print(f"(c) activation at import, {args.import_runs} rounds\n\n{activation(args.import_runs, workdir)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
