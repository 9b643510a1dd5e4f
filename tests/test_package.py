"""The ``megapatch`` package's own surface: lazy attributes, the error classes' contract, and the
source checkout's ``megapatch.patches`` finder."""

import importlib
import os
import pickle
import sys

import pytest

import megapatch
from conftest import REPO, run_python


def test_every_public_name_resolves_to_its_defining_module():
    from megapatch.core import engine, errors
    from megapatch.core.version import __version__

    assert megapatch.__version__ == __version__
    for name in ("enable", "disable", "is_enabled", "status"):
        assert getattr(megapatch, name) is getattr(engine, name), name
    for name in ("MegapatchError", "OptionError", "OptionUnavailableError", "UpstreamSurfaceError",
                 "UnsupportedConfigurationError", "CrossRankMismatchError"):
        assert getattr(megapatch, name) is getattr(errors, name), name
    assert sorted(megapatch.__all__) == sorted(
        ["enable", "disable", "status", "is_enabled", "__version__", "MegapatchError", "OptionError",
         "OptionUnavailableError", "UpstreamSurfaceError", "UnsupportedConfigurationError",
         "CrossRankMismatchError"])


def test_the_error_classes_keep_their_places_in_the_hierarchy():
    errors = importlib.import_module("megapatch.core.errors")
    # callers catch ValueError for bad option values, RuntimeError for the rest
    assert issubclass(errors.OptionError, ValueError) and issubclass(errors.OptionError, errors.MegapatchError)
    assert issubclass(errors.OptionUnavailableError, errors.OptionError)
    for name in ("UpstreamSurfaceError", "UnsupportedConfigurationError", "CrossRankMismatchError"):
        cls = getattr(errors, name)
        assert issubclass(cls, errors.MegapatchError) and not issubclass(cls, ValueError), name
    assert issubclass(errors.MegapatchError, RuntimeError)


def test_a_submodule_is_an_attribute_without_importing_it_first():
    result = run_python("""
        import sys, megapatch
        assert "megapatch.commands" not in sys.modules and "megapatch.te_check" not in sys.modules
        print(megapatch.commands.__name__, megapatch.te_check.__name__)
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["megapatch.commands", "megapatch.te_check"]


def test_an_unknown_attribute_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match=r"module 'megapatch' has no attribute 'no_such_thing'"):
        megapatch.no_such_thing
    assert not hasattr(megapatch, "__wrapped__")  # dunders are never imported as submodules


# names sorting before and after "megapatch.broken_for_test": the check is equality, not order
@pytest.mark.parametrize("dependency", ["aaa_missing_dependency_for_megapatch_tests",
                                        "no_such_dependency_for_megapatch_tests"])
def test_a_submodule_failing_on_a_missing_dependency_raises_that_dependencys_error(tmp_path, monkeypatch, dependency):
    (tmp_path / "broken_for_test.py").write_text(f"import {dependency}\n")
    monkeypatch.setattr(megapatch, "__path__", [*megapatch.__path__, str(tmp_path)])
    monkeypatch.delitem(sys.modules, "megapatch.broken_for_test", raising=False)
    with pytest.raises(ModuleNotFoundError) as info:
        megapatch.broken_for_test
    assert info.value.name == dependency


def test_an_upstream_surface_error_appends_the_installed_versions_once_then_the_hint():
    from megapatch.core.errors import UpstreamSurfaceError
    from megapatch.core.upstream_versions import describe_versions

    error = UpstreamSurfaceError("megatron.core.x.y is missing.", hint="Pin megatron-core 0.16.1")
    assert str(error) == f"megatron.core.x.y is missing. Installed: {describe_versions()}. Pin megatron-core 0.16.1"
    assert str(UpstreamSurfaceError("no hint")) == f"no hint. Installed: {describe_versions()}"
    again = pickle.loads(pickle.dumps(error))  # e.g. a rank's error sent to its launcher
    assert type(again) is UpstreamSurfaceError and str(again) == str(error)


def test_the_checkout_finder_resolves_megapatch_patches_and_nothing_else():
    from megapatch import _checkout

    finder = _checkout.SourceCheckoutPatches()
    spec = finder.find_spec("megapatch.patches")
    assert spec.origin == os.path.join(REPO, "patches", "__init__.py")
    assert list(spec.submodule_search_locations) == [os.path.join(REPO, "patches")]
    for other in ("megapatch.core", "patches", "megapatch.patches.logits._lm_head", "megapatch.patchesx"):
        assert finder.find_spec(other) is None, other


def test_the_checkout_finder_is_installed_once():
    result = run_python("""
        import sys
        import megapatch
        del sys.modules["megapatch._checkout"]  # imported again, as after a test harness's sys.modules reset
        import megapatch._checkout
        print(sum(type(f).__name__ == "SourceCheckoutPatches" for f in sys.meta_path))
        import megapatch.patches.tp_invariant as p
        print(p.__file__)
        """)
    assert result.returncode == 0, result.stderr
    count, path = result.stdout.split()
    assert count == "1" and path == os.path.join(REPO, "patches", "tp_invariant", "__init__.py")
