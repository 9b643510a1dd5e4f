"""enable / reconfigure / disable: idempotent, reversible, aliases included, surface-checked."""

import dataclasses
import inspect
import json
import sys
import types

import pytest
import torch

import megapatch
from megapatch.core import engine, wrappers
from megapatch.core.errors import UpstreamSurfaceError

from conftest import run_python

from megatron.core.tensor_parallel import layers, mappings  # noqa: E402

ORIGINALS = {
    "reduce": mappings._reduce,
    "rs": mappings._reduce_scatter_along_first_dim,
    "layers_rs": layers.dist_reduce_scatter_func,
    "all_reduce": torch.distributed.all_reduce,
    "row_forward": layers.RowParallelLinear.__dict__["forward"],
    "backward": layers.LinearWithFrozenWeight.__dict__["backward"],
}


def assert_pristine():
    assert mappings._reduce is ORIGINALS["reduce"]
    assert mappings._reduce_scatter_along_first_dim is ORIGINALS["rs"]
    assert layers.dist_reduce_scatter_func is ORIGINALS["layers_rs"]
    assert torch.distributed.all_reduce is ORIGINALS["all_reduce"]
    assert layers.RowParallelLinear.__dict__["forward"] is ORIGINALS["row_forward"]
    assert layers.LinearWithFrozenWeight.__dict__["backward"] is ORIGINALS["backward"]
    assert isinstance(layers.LinearWithFrozenWeight.__dict__["backward"], staticmethod)
    assert "apply" not in layers.LinearWithFrozenWeight.__dict__


def test_enable_after_import_wraps_every_target_once():
    status = megapatch.enable(tp_reduce_dtype="fp32")
    report = status.patch("tp_reduce.megatron_core")
    assert report.state == "active"
    assert "megatron.core.tensor_parallel.mappings._reduce" in report.targets
    assert wrappers.is_megapatch_wrapper(mappings._reduce)
    assert not wrappers.is_megapatch_wrapper(mappings._reduce.__wrapped__)


def test_enable_twice_and_reconfigure_never_double_wraps():
    megapatch.enable(tp_reduce_dtype="fp32")
    first = mappings._reduce
    megapatch.enable(tp_reduce_dtype="fp32")
    megapatch.enable(tp_reduce_dtype="fp32-accumulate")
    assert mappings._reduce is first  # same wrapper: reconfiguring swaps settings, not wrappers
    assert mappings._reduce.__wrapped__ is ORIGINALS["reduce"]
    assert megapatch.status().settings["tp_reduce_dtype"] == "fp32-accumulate"


def test_disable_restores_originals_exactly():
    megapatch.enable(tp_reduce_dtype="fp32")
    megapatch.disable()
    assert_pristine()
    assert megapatch.status().active == []


def test_reconfigure_to_native_removes_wrappers():
    megapatch.enable(tp_reduce_dtype="fp32")
    megapatch.enable(tp_reduce_dtype="native")
    assert_pristine()


def test_from_import_aliases_follow_and_are_restored():
    holder = types.ModuleType("user_code_holding_alias")
    holder._reduce = mappings._reduce  # like `from megatron.core.tensor_parallel.mappings import _reduce`
    sys.modules[holder.__name__] = holder
    try:
        status = megapatch.enable(tp_reduce_dtype="fp32")
        assert holder._reduce is mappings._reduce and wrappers.is_megapatch_wrapper(holder._reduce)
        assert "user_code_holding_alias._reduce" in status.patch("tp_reduce.megatron_core").aliases
        late = types.ModuleType("user_code_imported_later")
        late._reduce = mappings._reduce  # copied the wrapper after enable()
        sys.modules[late.__name__] = late
        megapatch.disable()
        assert holder._reduce is ORIGINALS["reduce"]
        assert late._reduce is ORIGINALS["reduce"]
    finally:
        sys.modules.pop("user_code_holding_alias", None)
        sys.modules.pop("user_code_imported_later", None)


def test_wrapped_signatures_still_inspect_like_upstream():
    megapatch.enable(tp_reduce_dtype="fp32")
    assert inspect.signature(mappings._reduce) == inspect.signature(ORIGINALS["reduce"])
    assert layers.RowParallelLinear.forward.__name__ == "forward"


def _break_reduce(monkeypatch):
    def _reduce(tensor, process_group):  # an upstream release renamed the parameters
        return tensor

    monkeypatch.setattr(mappings, "_reduce", _reduce)


def test_changed_upstream_surface_is_refused_in_strict_mode(monkeypatch):
    _break_reduce(monkeypatch)
    with pytest.raises(UpstreamSurfaceError) as err:
        megapatch.enable(tp_reduce_dtype="fp32")
    message = str(err.value)
    assert "megatron.core.tensor_parallel.mappings._reduce takes (tensor, process_group)" in message
    assert "expected it to start with (input_, group)" in message
    assert "megatron-core 0." in message and "torch 2." in message
    assert not megapatch.is_enabled() or megapatch.status().active == []
    assert not wrappers.is_megapatch_wrapper(layers.dist_reduce_scatter_func)  # nothing half-applied


def test_changed_upstream_surface_is_skipped_with_a_warning_when_not_strict(monkeypatch, caplog):
    _break_reduce(monkeypatch)
    with caplog.at_level("WARNING", logger="megapatch"):
        status = megapatch.enable(tp_reduce_dtype="fp32", strict=False)
    logged = [r.getMessage() for r in caplog.records if r.name == "megapatch"]
    assert len(logged) == 1 and "mappings._reduce takes" in logged[0] and "skipped" in logged[0]
    report = status.patch("tp_reduce.megatron_core")
    assert report.state == "skipped" and "_reduce takes (tensor, process_group)" in report.reason
    assert not wrappers.is_megapatch_wrapper(layers.dist_reduce_scatter_func)


def test_missing_upstream_symbol_names_the_path(monkeypatch):
    monkeypatch.delattr(layers, "dist_reduce_scatter_func")
    with pytest.raises(UpstreamSurfaceError, match="megatron.core.tensor_parallel.layers.dist_reduce_scatter_func does not exist"):
        megapatch.enable(tp_reduce_dtype="fp32")


def test_status_prints_a_table_and_serialises():
    status = megapatch.enable(tp_reduce_dtype="fp32")
    text = str(status)
    assert "tp_reduce.megatron_core" in text and "active" in text
    assert "megatron.core.tensor_parallel.layers.RowParallelLinear.forward" in text
    json.dumps(status.as_dict())


def test_status_and_its_patch_reports_are_snapshots_that_cannot_be_assigned_to():
    status = megapatch.enable(tp_reduce_dtype="fp32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.enabled = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.patch("tp_reduce.megatron_core").state = "inactive"


def test_an_upstream_attribute_of_another_kind_is_refused_naming_both_kinds(monkeypatch):
    """Same name and parameters, another kind (a method turned staticmethod, a staticmethod turned
    method): called differently, so refused whichever way the kind changed."""
    row_forward = ORIGINALS["row_forward"]

    def forward(self, input_):
        return row_forward(self, input_)

    def backward(ctx, grad_output):
        return ORIGINALS["backward"].__func__(ctx, grad_output)

    cases = ((layers.RowParallelLinear, "forward", staticmethod(forward), "staticmethod", "method"),
             (layers.LinearWithFrozenWeight, "backward", backward, "method", "staticmethod"))
    for owner, name, raw, found, expected in cases:
        with monkeypatch.context() as m:
            m.setattr(owner, name, raw)
            with pytest.raises(UpstreamSurfaceError) as err:
                megapatch.enable(tp_reduce_dtype="fp32")
            assert f"{owner.__name__}.{name} is a {found}, expected a {expected}" in str(err.value)
            assert not megapatch.is_enabled()
    assert_pristine()


# -- import / enable / disable orderings, each in a fresh interpreter --------------------------

CHECK = """
import json, megapatch, torch
from megapatch.core import wrappers
from megatron.core.tensor_parallel import mappings, layers
wrapped = wrappers.is_megapatch_wrapper(mappings._reduce)
double = wrapped and wrappers.is_megapatch_wrapper(mappings._reduce.__wrapped__)
print(json.dumps({"wrapped": wrapped, "double": double,
                  "active": megapatch.status().active,
                  "row": wrappers.is_megapatch_wrapper(layers.RowParallelLinear.__dict__["forward"]),
                  "all_reduce": wrappers.is_megapatch_wrapper(torch.distributed.all_reduce)}))
"""

ORDERINGS = {
    "enable-then-import": ("import megapatch; megapatch.enable(tp_reduce_dtype='fp32')\n"
                           "import megatron.core", True),
    "import-then-enable": "import megatron.core\nimport megapatch; megapatch.enable(tp_reduce_dtype='fp32')",
    "enable-import-disable": ("import megapatch; megapatch.enable(tp_reduce_dtype='fp32')\n"
                              "import megatron.core\nmegapatch.disable()", False),
    "enable-disable-import": ("import megapatch; megapatch.enable(tp_reduce_dtype='fp32'); megapatch.disable()\n"
                              "import megatron.core", False),
    "import-enable-x3": ("import megatron.core, megapatch\n"
                         "for _ in range(3): megapatch.enable(tp_reduce_dtype='fp32')", True),
    "enable-disable-enable": ("import megapatch, megatron.core\nmegapatch.enable(tp_reduce_dtype='fp32')\n"
                              "megapatch.disable(); megapatch.enable(tp_reduce_dtype='fp32-accumulate')", True),
    "submodule-first": ("import megapatch; megapatch.enable(tp_reduce_dtype='fp32')\n"
                        "from megatron.core.tensor_parallel.layers import RowParallelLinear", True),
    "native-after-fp32": ("import megapatch, megatron.core\nmegapatch.enable(tp_reduce_dtype='fp32')\n"
                          "megapatch.enable(tp_reduce_dtype='native')", False),
}


@pytest.mark.parametrize("name", sorted(ORDERINGS))
def test_orderings_in_subprocess(name):
    entry = ORDERINGS[name]
    code, expect = (entry, True) if isinstance(entry, str) else entry
    result = run_python(code + "\n" + CHECK, fresh=False)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["double"] is False
    assert found["wrapped"] is expect and found["row"] is expect and found["all_reduce"] is expect
    assert ("tp_reduce.megatron_core" in found["active"]) is expect


def test_hook_registered_before_disable_does_nothing_after_it():
    result = run_python("""
        import megapatch
        megapatch.enable(tp_reduce_dtype='fp32')   # registers the post-import hook
        megapatch.disable()
        import megatron.core.tensor_parallel      # hook fires now, must not install
        print(megapatch.status().active)
    """, fresh=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_non_strict_never_raises_from_the_users_import():
    result = run_python("""
        import megapatch, sys, types
        from megapatch.core import engine, registry
        broken = registry.Target("megatron.core.tensor_parallel.mappings", "no_such_symbol", lambda *a: None)
        patch = engine.patches()[-1]
        import dataclasses
        engine._patches = tuple(dataclasses.replace(p, targets=p.targets + (broken,)) if p.name == "tp_reduce.megatron_core" else p
                                for p in engine.patches())
        megapatch.enable(tp_reduce_dtype='fp32', strict=False)
        import megatron.core.tensor_parallel     # must not raise
        print(megapatch.status().patch("tp_reduce.megatron_core").state)
    """, fresh=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "skipped"


def test_strict_raises_from_the_import_with_the_symbol_path():
    result = run_python("""
        import megapatch, dataclasses
        from megapatch.core import engine, registry
        broken = registry.Target("megatron.core.tensor_parallel.mappings", "no_such_symbol", lambda *a: None)
        engine._patches = tuple(dataclasses.replace(p, targets=p.targets + (broken,)) if p.name == "tp_reduce.megatron_core" else p
                                for p in engine.patches())
        megapatch.enable(tp_reduce_dtype='fp32')
        import megatron.core.tensor_parallel
    """, fresh=False)
    assert result.returncode != 0
    assert "megatron.core.tensor_parallel.mappings.no_such_symbol does not exist" in result.stderr


def test_an_opted_out_patch_stays_out_when_its_module_is_imported_after_enable():
    """issue 48 audit survivor F1 (engine.py's import hook checking ``patch.applies`` where it must
    check that the patch is wanted): ``logits.fp32_output_layer`` opted out alone before megatron is
    imported -- no other guard keeps it out (nothing it builds on is opted out) -- must not be
    installed when ``megatron.core.tensor_parallel`` is imported, and ``status`` must say opted-out."""
    result = run_python("""
        import megapatch
        megapatch.enable(logits_dtype="fp32", skip_patches="logits.fp32_output_layer")
        from megatron.core.tensor_parallel import layers
        status = megapatch.status()
        print(status.patch("logits.fp32_output_layer").state)
        print(hasattr(layers.ColumnParallelLinear.forward, "__wrapped__"))
        print(sorted(n for n in status.active if n.startswith("logits.")))
        """)
    assert result.returncode == 0, result.stderr[-3000:]
    state, wrapped, active = result.stdout.splitlines()[-3:]
    assert state == "opted-out", result.stdout
    assert wrapped == "False", result.stdout  # ColumnParallelLinear.forward: the opted-out patch's only target
    assert "logits.fp32_output_layer" not in active, result.stdout
