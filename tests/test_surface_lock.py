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
    symbols = lock.current(packages=("megatron-core",))["megatron-core"]
    assert "megatron.core.tensor_parallel.layers.RowParallelLinear.forward" in symbols
    assert "megatron.core.tensor_parallel.layers.LinearWithFrozenWeight.forward" in symbols  # watched
    assert all(entry["present"] is not None for entry in symbols.values())
