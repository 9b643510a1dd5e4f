"""Command-line conventions: --version, exit codes in --help, demo usage errors, a quiet demo."""

import os
import re
import subprocess
import sys

import pytest

import megapatch
from megapatch.commands.cli import main
from megapatch.commands.demo import MODES, TP_SIZES, count_warnings

from conftest import REPO, environ_without_megapatch


def _usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"megapatch {megapatch.__version__}"


def test_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out
    for code in ("0", "1", "2"):
        assert re.search(rf"^\s+{code}\s+\S", out, re.M), code
    for command in ("doctor", "status", "demo", "lock"):
        assert command in out


@pytest.mark.parametrize("tp", ["3", "0", "1,2,16", "-2", "two"])
def test_demo_rejects_tp_sizes_the_model_cannot_take(tp, capsys):
    err = _usage_error(["demo", "--tp", tp], capsys)
    assert "argument --tp" in err and "valid TP sizes: " + ", ".join(map(str, TP_SIZES)) in err
    bad = next(item for item in tp.split(",") if item not in ("1", "2"))
    assert bad in err
    assert "Traceback" not in err


def test_demo_rejects_unknown_modes(capsys):
    err = _usage_error(["demo", "--modes", "native,bogus"], capsys)
    assert "argument --modes" in err and "'bogus'" in err
    assert "valid modes: " + ", ".join(MODES) in err


def test_demo_tp_sizes_always_include_the_reference():
    from megapatch.commands.cli import build_parser

    args = build_parser().parse_args(["demo", "--tp", "4,2,4", "--modes", "fp32,native,fp32"])
    assert args.tp == [1, 2, 4]
    assert args.modes == ["fp32", "native"]


def test_count_warnings():
    text = ("/x/y.py:114: UserWarning: Apex is not installed\n  warnings.warn(\n"
            "/x/z.py:3: FutureWarning: deprecated\n  foo()\nplain line: Warning: not one\n")
    assert count_warnings(text) == 2


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    """``megapatch demo --quick`` as a newcomer runs it (warnings shown unless hidden): its
    result, plot path and JSON table, shared by the tests of its output and of its figures."""
    tmp_path = tmp_path_factory.mktemp("quick-demo")
    env = environ_without_megapatch()
    env["PYTHONWARNINGS"] = "default"  # as in a fresh shell: warnings shown unless we hide them
    plot, table = tmp_path / "tp.png", tmp_path / "tp.json"
    result = subprocess.run(
        [sys.executable, "-m", "megapatch", "demo", "--quick", "--plot", str(plot), "--json", str(table)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, plot, table


def test_demo_quick_keeps_upstream_warnings_out_of_the_way(quick_demo):
    """The main job, as a newcomer runs it: progress, the table and where the plot went; the
    ranks' upstream warnings (TE/Apex missing, deprecations) hidden and counted."""
    result, plot, table = quick_demo
    out = result.stdout
    assert "TP=1: done" in out and "TP=2: done" in out
    assert re.search(r"^\| outliers \| fp32 \| 2 \|", out, re.M)
    hidden = re.search(r"; (\d+) upstream warnings hidden, --verbose to show\)", out)
    assert hidden and int(hidden.group(1)) > 0, out  # there were warnings, and they were hidden
    assert count_warnings(result.stderr) == 0, result.stderr
    assert "Warning" not in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in result.stderr
    else:
        assert f"plot written to {plot}" in out and plot.exists()
    assert table.exists()


def test_the_quick_demo_prints_the_documented_tp_1_and_2_rows_exactly(quick_demo):
    """docs/results.md and README quote what `megapatch demo` prints: the quick run (TP 1 and 2, the
    GELU GPT, random and planted outliers) must print those rows character for character. A change
    to the model, the planted outliers, the batch or a metric changes a figure the docs show. The
    figures are those of the CPU build docs/results.md was made with (torch 2.13.0): another torch
    may round a BF16 kernel differently."""
    import json

    import torch

    from megapatch.commands.demo import format_table

    if not torch.__version__.startswith("2.13.0"):
        pytest.skip(f"docs/results.md's figures are torch 2.13.0's; this is torch {torch.__version__}")
    rows = json.loads(quick_demo[2].read_text())
    assert {(r["variant"], r["mode"], r["tp"]) for r in rows} == {
        (v, m, tp) for v in ("random", "outliers") for m in MODES for tp in (1, 2)}
    with open(os.path.join(REPO, "docs", "results.md")) as fh:
        documented = fh.read().splitlines()
    printed = format_table(rows).splitlines()[2:]
    missing = [line for line in printed if line not in documented]
    assert not missing, "\n".join(missing)
    assert all(line in quick_demo[0].stdout.splitlines() for line in printed)  # as printed, not only as saved


def test_lock_update_says_what_it_wrote_and_lock_then_compares_against_it(tmp_path, monkeypatch, capsys):
    """``megapatch lock --update --lock-dir D`` names every file it writes; ``megapatch lock`` then
    exits 0 against them, 1 with the difference once one is edited, 1 where no lock exists."""
    import json

    from megapatch.commands import lock
    from megapatch.core.upstream_versions import version_of

    monkeypatch.setattr(lock, "LOCK_DIR", lock.LOCK_DIR)  # --lock-dir sets it for the process
    assert main(["lock", "--update", "--lock-dir", str(tmp_path)]) == 0
    core = tmp_path / "megatron-core" / f"{version_of('megatron-core')}.json"
    torch_lock = tmp_path / "torch" / f"{version_of('torch')}.json"
    assert capsys.readouterr().out.splitlines() == [f"wrote {core}", f"wrote {torch_lock}"]
    assert main(["lock", "--lock-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == "the installed upstream matches the patch-surface lock"
    recorded = json.loads(core.read_text())
    symbol = "megatron.core.tensor_parallel.mappings._reduce"
    recorded["symbols"][symbol]["source_sha256"] = "0" * 16
    core.write_text(json.dumps(recorded))
    assert main(["lock", "--lock-dir", str(tmp_path)]) == 1
    assert f"{symbol}: source_sha256 changed" in capsys.readouterr().out
    assert main(["lock", "--lock-dir", str(tmp_path / "empty")]) == 1
    assert "no lock for megatron-core" in capsys.readouterr().out
