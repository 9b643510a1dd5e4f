"""The version matrix's own logic (tools/matrix.py, used by noxfile.py): the generated table, the
lock differences it refuses to record, and the parsing of doctor and junit output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import matrix
from conftest import REPO

DOCTOR = """megapatch 0.1.0 doctor

patch                         requested  upstream      detail
----------------------------  ---------  ------------  ---------------------------------------
cross_rank.publish_settings   yes        compatible    1 targets checked
tp_invariant.tensor_parallel  no         INCOMPATIBLE  megatron.core.tensor_parallel.layers.ColumnParallelLinear._forward_impl does not exist
tp_invariant.mlp              no         compatible    1 targets checked

result: OK
"""

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_tp_invariant" name="test_a"/>
<testcase classname="tests.test_tp_invariant" name="test_b"><skipped type="pytest.skip"
  message="Skipped: this megatron-core cannot take tp_invariant">...</skipped></testcase>
<testcase classname="tests.test_tp_invariant" name="test_c"><skipped type="pytest.skip"
  message="Skipped: this megatron-core cannot take tp_invariant">...</skipped></testcase>
<testcase classname="tests.test_options" name="test_d"><failure message="boom"/></testcase>
</testsuite></testsuites>"""


def test_doctor_verdicts_are_read_per_patch():
    verdicts = matrix.parse_doctor(DOCTOR)
    assert {name: v["verdict"] for name, v in verdicts.items()} == {
        "cross_rank.publish_settings": "compatible", "tp_invariant.tensor_parallel": "INCOMPATIBLE",
        "tp_invariant.mlp": "compatible"}
    assert "_forward_impl does not exist" in verdicts["tp_invariant.tensor_parallel"]["detail"]


def test_junit_counts_keep_each_skip_reason(tmp_path):
    path = tmp_path / "cell.junit.xml"
    path.write_text(JUNIT)
    counts = matrix.junit_counts(path)
    assert counts["test_tp_invariant"] == {"passed": 1, "failed": 0, "skipped": 2, "skip_reasons": {
        "this megatron-core cannot take tp_invariant": 2}}
    assert counts["test_options"] == {"passed": 0, "failed": 1, "skipped": 0}


def test_only_a_changed_fingerprint_needs_a_review():
    output = "\n".join([
        "megatron-core 0.13.1: megatron.core.a.f: not in the lock (a new target?)",
        "megatron-core 0.13.1: megatron.core.a.g: in the lock but no patch uses it now",
        "megatron-core 0.13.1: megatron.core.a.h: source_sha256 changed",
        "    locked:    1234", "    installed: 5678",
        "no lock for torch 2.14.0 (/x/torch/2.14.0.json); record it with `megapatch lock --update`"])
    assert matrix.lock_changes(output) == ["megatron-core 0.13.1: megatron.core.a.h: source_sha256 changed"]
    assert matrix.lock_changes("the installed upstream matches the patch-surface lock") == []


def _result(tmp_path, cell, mcore, tests, patches, args=None):
    row = {"cell": cell, "python": "3.11", "mcore": mcore, "date": "2026-12-01", "status": "passed",
           "summary": "3 passed", "tests": tests, "patches": patches,
           "pytest_args": list(matrix.SUBSET) if args is None else args}
    (tmp_path / "matrix" / f"{cell}.json").write_text(json.dumps(row))


def test_the_table_is_generated_between_its_markers_from_the_results(tmp_path):
    (tmp_path / "matrix").mkdir()
    incompatible = {"verdict": "INCOMPATIBLE", "detail": "_forward_impl does not exist"}
    _result(tmp_path, "mcore-0.13.1", "0.13.1",
            {"test_tp_invariant": {"passed": 1, "failed": 0, "skipped": 2,
                                   "skip_reasons": {"this megatron-core cannot take tp_invariant": 2}}},
            {"tp_invariant.tensor_parallel": incompatible,
             "tp_invariant.mlp": {"verdict": "compatible", "detail": ""}})
    _result(tmp_path, "main", "git:d98e8a64ddf34856", {"test_tp_invariant": {"passed": 3, "failed": 1,
                                                                            "skipped": 0}},
            {"tp_invariant.mlp": {"verdict": "compatible", "detail": ""}}, args=["tests/test_options.py"])
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "versions.md"
    page.write_text(f"# above\n\n{matrix.BEGIN}\nstale\n{matrix.END}\n\nbelow\n")
    # the columns come from the checkout's patches/ and tests/
    (tmp_path / "patches").symlink_to(Path(REPO) / "patches")
    (tmp_path / "tests").symlink_to(Path(REPO) / "tests")
    assert matrix.write_report(tmp_path / "matrix", page) == 0
    text = page.read_text()
    assert text.startswith("# above\n") and text.endswith("\n\nbelow\n") and "stale" not in text
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    header = rows["| upstream"].split(" | ")
    column = header.index("tp_invariant")
    old = rows["| 0.13.1"].split(" | ")
    assert old[column] == ("tp_invariant.mlp: compatible; tp_invariant.tensor_parallel: INCOMPATIBLE, "
                           "1 passed, 2 skipped")
    assert rows["| Megatron-LM main d98e8a64"].split(" | ")[column] == "compatible, 3 passed, **1 failed**"
    assert "- `test_tp_invariant` on 0.13.1 (2): this megatron-core cannot take tp_invariant" in text
    assert "0.13.1 (2026-12-01) ran `nox -s cell`, i.e. `pytest tests/test_options.py" in text
    assert "Megatron-LM main d98e8a64 (2026-12-01) ran `pytest tests/test_options.py`." in text


def test_every_test_module_of_the_subset_exists_and_tp_invariant_is_in_it():
    files = [a for a in matrix.SUBSET if a.startswith("tests/")]
    assert all((Path(REPO) / f).is_file() for f in files), files
    assert "tests/test_tp_invariant.py" in files


def test_the_noxfile_has_one_session_per_cell_with_its_interpreter():
    pytest.importorskip("nox")
    listed = subprocess.run([sys.executable, "-m", "nox", "-f", "noxfile.py", "-l", "--json"], cwd=REPO,
                            capture_output=True, text=True, check=True)
    sessions = {s["session"]: s["python"] for s in json.loads(listed.stdout)}
    assert sessions == {f"cell({c.id})": c.python for c in matrix.cells()}  # `nox` alone runs every cell
