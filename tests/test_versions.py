"""Versions as the process sees them (the module in use, not whatever metadata exists) and the
supported ranges declared on each patch (Patch.supports)."""

import importlib.metadata
import logging
import sys
import types

import pytest
from packaging.specifiers import SpecifierSet

import megapatch
from megapatch.core import engine, upstream_versions
from megapatch.core.registry import Patch


def test_imported_module_wins_over_distribution_metadata(monkeypatch):
    wheel = importlib.metadata.version("megatron-core")
    info = types.ModuleType("megatron.core.package_info")
    info.__version__ = "0.99.0rc1"  # a checkout imported in place of the wheel
    monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    monkeypatch.setitem(sys.modules, "megatron.core.package_info", info)
    assert upstream_versions.version_info("megatron-core") == ("0.99.0rc1", "imported megatron.core.package_info")
    assert wheel != "0.99.0rc1"


def test_not_imported_reads_the_file_import_would_load(monkeypatch):
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    version, origin = upstream_versions.version_info("megatron-core")
    assert version == importlib.metadata.version("megatron-core")
    assert origin.startswith("file ") and origin.endswith("package_info.py")
    assert "megatron.core" not in sys.modules  # found without importing it


def test_megatron_core_imported_before_its_version_module_is_read_from_that_module(monkeypatch):
    """``megatron.core`` imported, ``megatron.core.package_info`` not loaded yet (as while
    ``megatron/core/__init__.py`` is still importing, before the module that loads it): the version
    is read from the module import loads (plain constants), not from a file or metadata."""
    import megatron.core

    monkeypatch.setattr(megatron.core, "package_info", megatron.core.package_info)  # put back after
    monkeypatch.delitem(sys.modules, "megatron.core.package_info")
    assert upstream_versions.version_info("megatron-core") == (importlib.metadata.version("megatron-core"),
                                                               "imported megatron.core.package_info")
    assert "megatron.core.package_info" in sys.modules


@pytest.mark.parametrize("version, specifier, inside", [
    ("2.8.0a0+nv25.5", ">=2.4", True),      # an NGC torch: pre-release, local build
    ("0.12.3", ">=0.13,<0.21", False),
    ("0.20.0", ">=0.13,<0.21", True),
    ("0.21.0rc1", ">=0.13,<0.21", False),   # a pre-release of the excluded version
    ("2.20.2", ">=2.9,<=2.20.2", True),
    ("not-a-version", ">=0", False),
])
def test_in_range(version, specifier, inside):
    assert upstream_versions.in_range(version, specifier) is inside


def test_every_patch_declares_a_valid_range_that_names_its_package():
    for patch in engine.patches():
        supports = upstream_versions.supported_range(patch)
        assert patch.package in supports, patch.name
        for package, specifier in supports.items():
            SpecifierSet(specifier)  # raises when malformed
            assert package in upstream_versions.installed_versions(), package


def test_outside_the_range_warns_once_and_never_refuses(caplog):
    patch = Patch(name="test.only", option=None, summary="", hook="megatron.core", targets=(),
                  applies=lambda s: True, supports={"megatron-core": ">=99"})
    lines = upstream_versions.outside_range(patch)
    assert lines == [f"megatron-core {upstream_versions.version_of('megatron-core')} is outside test.only's "
                     f"supported range >=99"]
    with caplog.at_level(logging.WARNING, logger="megapatch"):
        upstream_versions.warn_if_unsupported(patch)
        upstream_versions.warn_if_unsupported(patch)
    assert [r.getMessage() for r in caplog.records].count(
        f"megapatch: {lines[0]} (untested there; the upstream surface it wraps checked out)") == 1


def test_status_shows_each_patchs_range():
    status = megapatch.status()
    for patch in engine.patches():
        assert status.patch(patch.name).supports == upstream_versions.supported_range(patch)
    assert status.as_dict()["patches"][0]["supports"] == upstream_versions.supported_range(engine.patches()[0])


# -- the readers behind version_info, on stand-in packages (in-process) ---------------------------

def _package(root, name, files):
    (root / name).mkdir(parents=True, exist_ok=True)
    for relative, text in files.items():
        path = root / name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / name / "__init__.py").write_text("")


def test_the_version_file_is_executed_from_where_import_would_find_it_and_only_if_plain(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    _package(first, "mp_ver_plain", {"core/package_info.py": "MAJOR = 9\n__version__ = f'{MAJOR}.1.0'\n"})
    _package(first, "mp_ver_broken", {"core/package_info.py": "import not_a_module_anywhere\n"})
    _package(first, "mp_ver_none", {"core/package_info.py": "OTHER = '1.0'\n"})
    _package(first, "mp_ver_nofile", {})
    _package(second, "mp_ver_plain", {"core/package_info.py": "__version__ = '0.0.1'\n"})  # shadowed
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))
    read = upstream_versions._version_from_file
    version, origin = read("mp_ver_plain", "core/package_info.py", "__version__")
    assert version == "9.1.0" and origin == f"file {first / 'mp_ver_plain' / 'core' / 'package_info.py'}"
    for top in ("mp_ver_broken", "mp_ver_none", "mp_ver_nofile", "mp_ver_not_installed"):
        assert read(top, "core/package_info.py", "__version__") is None, top
    assert "mp_ver_plain" not in sys.modules and "mp_ver_broken" not in sys.modules  # never imported


def test_a_namespace_package_is_searched_in_each_of_its_locations(tmp_path, monkeypatch):
    for where, files in (("a", {}), ("b", {"core/package_info.py": "__version__ = '3.2.1'\n"})):
        (tmp_path / where / "mp_ver_ns" / "core").mkdir(parents=True)  # no __init__.py: a namespace
        for relative, text in files.items():
            (tmp_path / where / "mp_ver_ns" / relative).write_text(text)
        monkeypatch.syspath_prepend(str(tmp_path / where))
    version, origin = upstream_versions._version_from_file("mp_ver_ns", "core/package_info.py", "__version__")
    assert version == "3.2.1" and origin.endswith(str(tmp_path / "b" / "mp_ver_ns" / "core" / "package_info.py"))


def test_distribution_metadata_is_tried_name_by_name_and_absent_is_none(monkeypatch):
    tried = []

    def version(dist):
        tried.append(dist)
        if dist != "transformer_engine":
            raise importlib.metadata.PackageNotFoundError(dist)
        return "2.20.2"

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert upstream_versions._version_from_metadata("transformer-engine") == ("2.20.2", "distribution transformer_engine")
    assert tried == ["transformer-engine", "transformer_engine"]
    assert upstream_versions._version_from_metadata("wrapt") == (None, None)
    assert upstream_versions._version_from_metadata("some-package") == (None, None) and tried[-1] == "some-package"


def test_a_broken_imported_version_module_falls_through_to_metadata(monkeypatch):
    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("half-initialised")

    monkeypatch.setitem(sys.modules, "wrapt", Broken("wrapt"))
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "1.17.0")
    assert upstream_versions.version_info("wrapt") == ("1.17.0", "distribution wrapt")
    monkeypatch.setitem(sys.modules, "wrapt", types.SimpleNamespace(__version__=None))  # no version there
    assert upstream_versions.version_info("wrapt") == ("1.17.0", "distribution wrapt")


def test_the_versions_line_names_every_package_and_absent_ones(monkeypatch):
    found = {"torch": "2.13.0", "megatron-core": "0.16.1", "transformer-engine": None, "wrapt": "1.17.0"}
    monkeypatch.setattr(upstream_versions, "version_of", found.get)
    monkeypatch.setattr(upstream_versions.platform, "python_version", lambda: "3.11.7")
    assert upstream_versions.describe_versions() == (
        "python 3.11.7, torch 2.13.0, megatron-core 0.16.1, transformer-engine absent, wrapt 1.17.0")


def test_an_untested_stack_warns_once_per_version_and_an_absent_or_tested_one_not_at_all(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="megapatch")
    monkeypatch.setattr(upstream_versions, "_warned", set())
    versions = {"megatron-bridge": None}
    monkeypatch.setattr(upstream_versions, "version_of", versions.get)
    assert upstream_versions.warn_if_untested_stack("megatron-bridge") is False  # absent
    versions["megatron-bridge"] = "0.6.2"
    assert upstream_versions.warn_if_untested_stack("megatron-bridge") is False  # tested
    versions["megatron-bridge"] = "0.7.0"
    assert upstream_versions.warn_if_untested_stack("megatron-bridge") is True
    assert upstream_versions.warn_if_untested_stack("megatron-bridge") is False  # once
    versions["megatron-bridge"] = "0.8.0"
    assert upstream_versions.warn_if_untested_stack("megatron-bridge") is True  # another version: again
    said = [r.getMessage() for r in caplog.records if r.name == "megapatch"]
    assert len(said) == 2 and said[0].startswith("megapatch: megatron-bridge 0.7.0 is outside the versions "
                                                 "megapatch was run under (>=0.6.2,<0.6.3)"), said
