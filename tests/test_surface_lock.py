"""The patch-surface lock catches any change to an upstream symbol megapatch touches."""

import json
import os

import pytest

from megapatch.commands import lock
from megapatch.core.registry import Target
from megapatch.core.upstream_versions import version_of


def test_installed_megatron_core_matches_its_lock():
    differences, missing = lock.compare()
    missing_core = [m for m in missing if m.startswith("no lock for megatron-core")]
    assert not missing_core, missing_core
    assert not differences, "upstream changed under megapatch:\n" + "\n".join(differences)


def test_a_changed_upstream_symbol_is_reported_with_a_readable_diff(tmp_path, monkeypatch):
    version = version_of("megatron-core")
    with open(lock.lock_path("megatron-core", version)) as fh:
        recorded = json.load(fh)
    symbol = "megatron.core.tensor_parallel.mappings._reduce"
    installed = recorded["symbols"][symbol]["signature"]  # (input_, group); 0.12.3: (input_)
    assert installed.startswith("(input_") and installed != "(input_, group, async_op=False)"
    recorded["symbols"][symbol]["signature"] = "(input_, group, async_op=False)"
    recorded["symbols"][symbol]["source_sha256"] = "0000000000000000"
    target = tmp_path / "megatron-core" / f"{version}.json"
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps(recorded))
    monkeypatch.setattr(lock, "LOCK_DIR", str(tmp_path))
    differences, _ = lock.compare(packages=("megatron-core",))
    text = "\n".join(differences)
    assert f"megatron-core {version}: {symbol}: signature changed" in text
    assert "locked:    (input_, group, async_op=False)" in text
    assert f"installed: {installed}" in text
    assert f"{symbol}: source_sha256 changed" in text


def test_every_target_and_watched_symbol_is_fingerprinted():
    found = lock.current(packages=("megatron-core",))
    assert set(found) == {"megatron-core"}  # torch is installed too, and not asked for
    symbols = found["megatron-core"]
    assert "megatron.core.tensor_parallel.layers.RowParallelLinear.forward" in symbols
    assert "megatron.core.tensor_parallel.layers.LinearWithFrozenWeight.forward" in symbols  # watched
    assert all(entry["present"] is not None for entry in symbols.values())


def test_update_rewrites_the_committed_lock_byte_for_byte(tmp_path, monkeypatch):
    """Refreshing an unchanged upstream's lock leaves the shipped file as it is (no churn in review):
    ``update`` writes the same bytes, JSON layout included, as the committed file."""
    monkeypatch.setattr(lock, "LOCK_DIR", str(tmp_path))
    [written] = lock.update(packages=("megatron-core",))
    version = version_of("megatron-core")
    assert written == str(tmp_path / "megatron-core" / f"{version}.json")
    shipped = os.path.join(os.path.dirname(lock.__file__), "surface_lock", "megatron-core", f"{version}.json")
    with open(shipped, "rb") as ours, open(written, "rb") as theirs:
        assert theirs.read() == ours.read()
