"""The TE wiring verdict is computed once per TE installation (megapatch.te_check.verdict): a later
process reads it without importing the static checker; another TE (or an edited file) is checked
again; an unwritable cache means checking every time, never an error."""

import os
import sys

import pytest

from megapatch.te_check import verdict, wiring
from megapatch.patches.tp_reduce import transformer_engine as SPEC
from conftest import run_python


@pytest.fixture
def te_tree(tmp_path, monkeypatch):
    """A stand-in TE source tree, a private cache dir, and a counting checker."""
    root = tmp_path / "site"
    module = root / "transformer_engine" / "pytorch" / "module"
    module.mkdir(parents=True)
    (root / "transformer_engine" / "__init__.py").write_text("")
    (root / "transformer_engine" / "pytorch" / "__init__.py").write_text("")
    (module / "linear.py").write_text("def allreduce(inp, tp_group=None, async_op=False):\n    pass\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []

    def check(sources, spec):
        calls.append(sources.label)
        return [f"problem seen in {len(sources.files('transformer_engine/pytorch/'))} files"]

    monkeypatch.setattr(wiring, "check", check)
    return root, calls


def test_checked_once_then_read_from_the_cache(te_tree):
    root, calls = te_tree
    first, origin = verdict.verdict(str(root), SPEC)
    assert origin == "checked" and first == ("problem seen in 2 files",) and len(calls) == 1
    again, origin = verdict.verdict(str(root), SPEC)
    assert origin.startswith("cache ") and again == first and len(calls) == 1


def test_another_installation_or_an_edited_file_is_checked_again(te_tree):
    root, calls = te_tree
    verdict.verdict(str(root), SPEC)
    linear = root / "transformer_engine" / "pytorch" / "module" / "linear.py"
    linear.write_text(linear.read_text() + "# edited\n")  # a patched TE in place
    _, origin = verdict.verdict(str(root), SPEC)
    assert origin == "checked" and len(calls) == 2
    (root / "transformer_engine" / "pytorch" / "extra.py").write_text("")  # a file added
    _, origin = verdict.verdict(str(root), SPEC)
    assert origin == "checked" and len(calls) == 3
    _, origin = verdict.verdict(str(root), SPEC)
    assert origin.startswith("cache ") and len(calls) == 3


def test_unwritable_cache_checks_every_time(te_tree, tmp_path, monkeypatch):
    root, calls = te_tree
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # a file where the cache directory would go
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    for expected in (1, 2):
        problems, origin = verdict.verdict(str(root), SPEC)
        assert problems and origin.startswith("checked (not cached:") and len(calls) == expected


def test_a_cached_verdict_never_imports_the_checker(te_tree, tmp_path):
    root, _calls = te_tree
    env = {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"]}
    code = """
        import sys
        from megapatch.te_check import verdict
        from megapatch.patches.tp_reduce import transformer_engine as spec
        print(repr(verdict.installed_problem(spec)), "megapatch.te_check.wiring" in sys.modules)
    """
    first = run_python(code, env=env)  # the real checker: the stand-in tree is not wired as TE is
    assert first.returncode == 0, first.stderr[-3000:]
    assert "not wired as megapatch relies on" in first.stdout and first.stdout.split()[-1] == "True"
    later = run_python(code, env=env)
    assert later.returncode == 0, later.stderr[-3000:]
    assert later.stdout == first.stdout.replace(" True\n", " False\n")
    assert sys.modules.get("megapatch.te_check.wiring") is wiring  # (this process: untouched)


def test_another_patch_module_or_an_edited_checker_is_checked_again(te_tree, tmp_path, monkeypatch):
    """issue 28 survivor: the key must cover megapatch's side too. Two patch modules (or two
    versions of one) on the same TE get their own verdicts, never each other's cached one; an
    edited static checker checks again. Each stand-in module's verdict names it, so a verdict
    served from the other's cache entry shows."""
    import types

    root, _calls = te_tree
    seen = []

    def check(sources, spec):  # a verdict of this (TE, patch module) pair
        seen.append(spec.__name__)
        return [f"{spec.__name__} not wired"]

    monkeypatch.setattr(wiring, "check", check)
    modules = {}
    for name in ("patch_a", "patch_b"):
        path = tmp_path / f"{name}.py"
        path.write_text(f"# the TE patch module {name}\nNAME = {name!r}\n")
        modules[name] = types.ModuleType(name)
        modules[name].__file__ = str(path)
    a, b = modules["patch_a"], modules["patch_b"]
    assert verdict.verdict(str(root), a) == (("patch_a not wired",), "checked")
    assert verdict.verdict(str(root), b) == (("patch_b not wired",), "checked")  # not a's entry
    problems, origin = verdict.verdict(str(root), a)
    assert problems == ("patch_a not wired",) and origin.startswith("cache "), origin
    with open(a.__file__, "a") as f:
        f.write("# edited: another megapatch release\n")
    assert verdict.verdict(str(root), a) == (("patch_a not wired",), "checked")
    checker = tmp_path / "wiring.py"
    checker.write_text(open(verdict._CHECKER).read() + "\n# edited checker\n")
    monkeypatch.setattr(verdict, "_CHECKER", str(checker))
    assert verdict.verdict(str(root), b) == (("patch_b not wired",), "checked")
    assert seen == ["patch_a", "patch_b", "patch_a", "patch_b"], seen


def test_a_process_asks_once_and_the_message_shows_four_problems_then_counts_the_rest(te_tree, tmp_path, monkeypatch):
    """fresh-sample survivors (verdict.py): ``installed_problem`` reads the verdict once per process
    for each (TE, patch module) pair (every probe and status call asks again); its message shows
    the first four problems and counts the others, with no count at four or fewer."""
    import types

    root, _calls = te_tree
    monkeypatch.setattr(verdict, "installed_root", lambda: str(root))
    asked, real = [], verdict.verdict

    def counting(*args, **kwargs):
        asked.append(args[1].__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(verdict, "verdict", counting)
    getattr(verdict._problems, "cache_clear", lambda: None)()
    for count, shown, more in ((6, 4, "; and 2 more"), (4, 4, ""), (5, 4, "; and 1 more"), (1, 1, "")):
        spec = types.ModuleType(f"spec_{count}")
        spec.__file__ = str(tmp_path / f"spec_{count}.py")
        (tmp_path / f"spec_{count}.py").write_text(f"# a TE patch module with {count} problems\n")
        monkeypatch.setattr(wiring, "check", lambda sources, s, n=count: [f"problem {i}" for i in range(1, n + 1)])
        expected = ("the installed Transformer Engine is not wired as megapatch relies on: "
                    + "; ".join(f"problem {i}" for i in range(1, shown + 1)) + more)
        assert verdict.installed_problem(spec) == expected
        assert verdict.installed_problem(spec) == expected  # the second time from this process's memory
    assert asked == ["spec_6", "spec_4", "spec_5", "spec_1"], asked
    getattr(verdict._problems, "cache_clear", lambda: None)()
