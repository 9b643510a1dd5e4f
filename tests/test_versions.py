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
