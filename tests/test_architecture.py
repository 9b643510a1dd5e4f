"""The layout's rules, checked: import-linter's contracts (pyproject.toml [tool.importlinter]) on
the package as the wheel lays it out, a contract breaking when a runtime module imports the test
harness, patch modules named after their patches, and the option table driving every surface."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pkgutil
import shutil
import subprocess
import sys

import pytest

import megapatch
from megapatch.core import engine, options

from conftest import REPO

RUNTIME = ("megapatch.core", "megapatch.numerics", "megapatch.patches", "megapatch.te_check",
           "megapatch.integrations", "megapatch._checkout")


def _wheel_layout(tmp_path):
    """megapatch/ with patches/ inside it, as the wheel ships them (pyproject force-include)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(os.path.join(REPO, "megapatch"), tmp_path / "megapatch", ignore=ignore)
    shutil.copytree(os.path.join(REPO, "patches"), tmp_path / "megapatch" / "patches", ignore=ignore)
    return tmp_path


def _lint_imports(root):
    env = dict(os.environ, PYTHONPATH=str(root))
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept(tmp_path):
    result = _lint_imports(_wheel_layout(tmp_path))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "5 kept, 0 broken" in result.stdout


def test_a_stand_in_importing_a_launcher_breaks_the_testing_layers(tmp_path):
    """The kinds of test infrastructure stay layered: a stand-in (lowest) importing a launcher fails."""
    result = _lint_with_added_line(tmp_path, "testing/stand_ins/cpu_compat.py",
                                   "import megapatch.testing.ranks.cpu_launch  # careless")
    assert result.returncode == 1, result.stdout[-4000:]
    assert "test infrastructure: scenarios > ranks | models > stand_ins BROKEN" in result.stdout


def _lint_with_added_line(tmp_path, module_file: str, line: str):
    """``lint-imports`` over the wheel layout after appending ``line`` to ``megapatch/<module_file>``."""
    root = _wheel_layout(tmp_path)
    path = root / "megapatch" / module_file
    path.write_text(path.read_text() + f"\n{line}\n")
    return _lint_imports(root)


def test_a_runtime_module_importing_the_test_harness_breaks_a_contract(tmp_path):
    result = _lint_with_added_line(tmp_path, "core/state.py", "import megapatch.testing.ranks.harness  # careless")
    assert result.returncode == 1, result.stdout[-4000:]
    assert "the runtime path imports nothing from testing or commands BROKEN" in result.stdout
    assert "megapatch.core.state -> megapatch.testing.ranks.harness" in result.stdout


def test_a_family_importing_another_family_breaks_a_contract(tmp_path):
    result = _lint_with_added_line(tmp_path, "patches/tp_invariant/_marks.py",
                                   "from megapatch.patches.tp_reduce import _reduction  # careless")
    assert result.returncode == 1, result.stdout[-4000:]
    assert "patch families never import each other" in result.stdout and "BROKEN" in result.stdout
    said = " ".join(result.stdout.split())  # import-linter wraps long lines
    assert "megapatch.patches.tp_invariant._marks -> megapatch.patches.tp_reduce._reduction" in said


def test_the_families_contract_lists_every_family_package():
    """A new family is independent of the others only once the contract names it."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    [families] = [c["modules"] for c in contracts if c["id"] == "families-independent"]
    package = importlib.import_module("megapatch.patches")
    found = {f"megapatch.patches.{i.name}" for i in pkgutil.iter_modules(package.__path__) if i.ispkg}
    assert set(families) == found


def test_a_cycle_inside_the_engine_breaks_a_contract(tmp_path):
    result = _lint_with_added_line(tmp_path, "core/report.py", "from megapatch.core import engine  # a cycle")
    assert result.returncode == 1 and "no import cycles inside a layer BROKEN" in result.stdout


def _layout_problems(package) -> list:
    """Where ``megapatch.patches`` breaks the rule: the record ``<family>.<what>`` is declared, alone,
    in ``patches/<family>/<what>.py``; a family is a package; modules starting with ``_`` hold helpers
    and declare no record."""
    problems = []
    for family in pkgutil.iter_modules(package.__path__):
        if family.name.startswith("_"):
            continue
        if not family.ispkg:
            problems.append(f"{family.name}.py is a module, not a family package")
            continue
        family_package = importlib.import_module(f"{package.__name__}.{family.name}")
        for info in pkgutil.iter_modules(family_package.__path__):
            module = importlib.import_module(f"{family_package.__name__}.{info.name}")
            names = [getattr(p, "name", p) for p in getattr(module, "PATCHES", ())]
            if info.name.startswith("_") or info.ispkg:
                if names:
                    problems.append(f"{family.name}/{info.name} is a helper and declares {names}")
            elif names != [f"{family.name}.{info.name}"]:
                problems.append(f"{family.name}/{info.name}.py declares {names}, not [{family.name}.{info.name!r}]")
    return problems


def test_every_patch_record_lives_in_its_family_package_under_its_own_name():
    """``<family>.<what>`` in ``patches/<family>/<what>.py``, one record a module: a user's patch name
    (``megapatch status``, ``MEGAPATCH_SKIP_PATCHES``) finds its file."""
    package = importlib.import_module("megapatch.patches")
    assert _layout_problems(package) == []
    families = {p.name.partition(".")[0] for p in engine.patches()}
    assert families == {"cross_rank", "fp8", "linear", "logits", "rl_report", "tp_invariant", "tp_reduce"}


def test_a_record_in_the_wrong_module_or_a_flat_patch_module_breaks_the_layout_rule(tmp_path, monkeypatch):
    """The rule can fail: a second record beside a module's own, a record in a helper module, and a
    flat module next to the families are each named."""
    root = _wheel_layout(tmp_path)
    patches = root / "megapatch" / "patches"
    mlp = patches / "tp_invariant" / "mlp.py"
    mlp.write_text(mlp.read_text() + "\nimport dataclasses\n"
                   "PATCHES = PATCHES + (dataclasses.replace(PATCHES[0], name='tp_invariant.moe_router'),)\n")
    marks = patches / "tp_invariant" / "_marks.py"
    marks.write_text(marks.read_text() + "\nPATCHES = ('tp_invariant.marks',)\n")
    (patches / "tp_invariant_extra.py").write_text("PATCHES = ()\n")
    code = ("import sys, importlib; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2]); "
            "import test_architecture as t; print(t._layout_problems(importlib.import_module('megapatch.patches')))")
    result = subprocess.run([sys.executable, "-c", code, str(root), os.path.join(REPO, "tests")],
                            capture_output=True, text=True, cwd=root, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tp_invariant/mlp.py declares ['tp_invariant.mlp', 'tp_invariant.moe_router']" in result.stdout
    assert "tp_invariant/_marks is a helper and declares ['tp_invariant.marks']" in result.stdout
    assert "tp_invariant_extra.py is a module, not a family package" in result.stdout


def test_the_option_table_drives_settings_enable_and_the_launcher():
    names = [o.name for o in options.OPTIONS]
    assert [f.name for f in dataclasses.fields(options.Settings)] == names
    assert list(inspect.signature(megapatch.enable).parameters) == names
    assert all(getattr(options.NATIVE, o.name) == o.default for o in options.OPTIONS)
    from megapatch.commands import launcher

    parser_flags = {a for action in launcher.parser()._actions for a in action.option_strings}
    assert {"--" + n.replace("_", "-") for n in names} <= parser_flags
    with pytest.raises(TypeError, match="unexpected keyword argument 'tp_reduce_dtpye'"):
        megapatch.enable(tp_reduce_dtpye="fp32")


def test_the_runtime_never_imports_testing_or_commands_at_run_time():
    """What a training process loads: the engine and every patch module (import-linter checks the
    static graph; this checks the modules really loaded)."""
    code = ("import sys, megapatch; from megapatch.core import engine; engine.patches(); "
            "print(sorted(m for m in sys.modules if m.startswith('megapatch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = eval(result.stdout.strip())  # noqa: S307 -- our own printout
    assert loaded and all(m.startswith(RUNTIME) for m in loaded), loaded
