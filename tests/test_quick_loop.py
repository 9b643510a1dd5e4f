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
