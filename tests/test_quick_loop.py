"""The fast loop (`pytest -m quick`, README "Tests") touches every patch at least once with real
megatron-core: each quick test names the patches it exercises (``@pytest.mark.quick("name", ...)``),
and together they name every patch megapatch ships; a name that is no patch is refused too. Read
from the test files themselves, so it holds whichever tests a run selects."""

import ast
import pathlib

import pytest

from megapatch.core import engine

TESTS = pathlib.Path(__file__).resolve().parent


def _quick_marks():
    """{patch name: [test function, ...]} from every ``@pytest.mark.quick(...)`` in tests/."""
    named = {}
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and ast.unparse(deco.func) == "pytest.mark.quick":
                    for arg in deco.args:
                        named.setdefault(ast.literal_eval(arg), []).append(f"{path.name}::{node.name}")
    return named


@pytest.mark.quick()
def test_the_quick_loop_names_every_patch_and_only_patches():
    named = _quick_marks()
    shipped = {p.name for p in engine.patches()}
    assert not set(named) - shipped, f"quick markers name no patch: {sorted(set(named) - shipped)}"
    missing = sorted(shipped - set(named))
    assert not missing, f"no quick test exercises {missing}: mark one with @pytest.mark.quick(...)"


def _readme_test_command():
    """The pytest invocation of the README's "Tests" install line (what follows its last ``&&``)."""
    readme = (TESTS.parent / "README.md").read_text()
    lines = [line for line in readme.splitlines()
             if line.startswith("python3 -m venv") and "[test," in line and "pytest" in line]
    assert len(lines) == 1, lines
    return lines[0].rsplit("&&", 1)[1].strip()


def test_ci_runs_the_readme_test_command_with_what_the_test_extra_installs():
    """.ci/run's default stage runs the README's test command verbatim; its options come from
    plugins that the ``test`` extra installs (``-n``/``--dist``: pytest-xdist)."""
    import tomllib

    command = _readme_test_command()
    assert command.startswith("python -m pytest"), command
    ci = (TESTS.parent / ".ci" / "run").read_text().splitlines()
    assert f"  {command}" in ci, f".ci/run does not run the README's test command: {command}"
    extra = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    if " -n " in f" {command} " or "--dist" in command:
        assert any(req.startswith("pytest-xdist") for req in extra), extra


def test_what_the_readme_test_command_leaves_out_runs_in_its_own_ci_stage():
    """Issue 36 item 4: a marker the README's test command deselects (``-m "not X"``) names tests
    that CI still runs, in a stage of its own with ``-m X``, and the README says how to run them."""
    import re
    import shlex

    command = shlex.split(_readme_test_command())
    markers = [i for i, word in enumerate(command) if word == "-m"][1:]  # the first: python -m pytest
    expression = command[markers[-1] + 1] if markers else ""
    left_out = re.findall(r"not (\w+)", expression)
    assert left_out, f"the README's test command deselects nothing: {command}"
    ci = (TESTS.parent / ".ci" / "run").read_text()
    readme = (TESTS.parent / "README.md").read_text()
    for marker in left_out:
        stage = f"python -m pytest -q -n auto --dist load -m {marker}"
        assert f"  {stage}\n" in ci, f".ci/run never runs the tests marked {marker}"
        assert f'if [[ "$stages" == *" {marker} "* ]]' in ci and f"default {marker} " in ci, \
            f"the {marker} stage is not on by default"
        assert stage in readme, f"the README does not say how to run the tests marked {marker}"
