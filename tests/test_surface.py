"""``megapatch.core.surface``: how a patch target is found on the installed upstream and what is
checked about it, on stand-in modules (in-process; the lifecycle and lock tests use the real ones)."""

import sys
import types

import pytest

from megapatch.core import surface
from megapatch.core.registry import Target

MODULE = "mp_stand_in_surface"


def _wrapper(w, i, a, k):
    return w(*a, **k)


def _target(attr, **fields):
    return Target(MODULE, attr, _wrapper, **fields)


class Layer:
    scale = 2

    def forward(self, input_, extra=None):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output

    @classmethod
    def build(cls, config):
        return cls()

    class Inner:
        def run(self):
            return None


def function(x, y, z=0):
    return x + y + z


@pytest.fixture
def stand_in(monkeypatch):
    module = types.ModuleType(MODULE)
    module.Layer, module.function, module.CONSTANT = Layer, function, 3
    monkeypatch.setitem(sys.modules, MODULE, module)
    return module


def test_a_target_resolves_to_its_owner_name_and_attribute_as_stored(stand_in):
    owner, name, raw = surface.resolve(_target("Layer.backward"))
    assert owner is Layer and name == "backward" and isinstance(raw, staticmethod)  # not unwrapped
    assert surface.resolve(_target("Layer.Inner.run"))[0] is Layer.Inner
    assert surface.resolve(_target("function")) == (stand_in, "function", function)
    assert surface.present(_target("Layer.forward")) and not surface.present(_target("Layer.missing"))


def test_a_missing_target_names_the_first_missing_piece_of_its_path(stand_in, monkeypatch):
    with pytest.raises(LookupError, match=f"^{MODULE}.Layer.Gone does not exist$"):
        surface.resolve(_target("Layer.Gone.run"))
    with pytest.raises(LookupError, match=f"^{MODULE}.Layer.gone does not exist$"):
        surface.resolve(_target("Layer.gone"))
    monkeypatch.delitem(sys.modules, MODULE)
    with pytest.raises(LookupError, match=f"^module {MODULE} is not imported$"):
        surface.resolve(_target("function"))
    imported = types.ModuleType(MODULE)
    imported.function = function
    monkeypatch.setattr(surface.importlib, "import_module", lambda name: imported if name == MODULE else None)
    assert surface.resolve(_target("function"), import_module=True)[0] is imported


def test_each_kind_of_attribute_is_named_as_targets_name_it(stand_in):
    kind = lambda attr: surface._kind_of(*surface.resolve(_target(attr))[::2])  # noqa: E731
    assert [kind(a) for a in ("Layer.forward", "Layer.backward", "Layer.build", "Layer.scale", "function",
                              "CONSTANT")] == ["method", "staticmethod", "classmethod", "attribute", "function",
                                               "attribute"]
    assert surface._kind_of(dict, dict.__dict__["fromkeys"]) == "classmethod"  # a C classmethod_descriptor


def test_parameter_names_see_through_static_and_class_methods_and_say_none_without_a_signature():
    assert surface.parameter_names(Layer.__dict__["backward"]) == ("ctx", "grad_output")
    assert surface.parameter_names(Layer.__dict__["build"]) == ("cls", "config")
    assert surface.parameter_names(function) == ("x", "y", "z")
    assert surface.parameter_names(3) is None  # TypeError: not callable
    assert surface.callable_of(Layer.__dict__["build"]) is Layer.__dict__["build"].__func__


def test_problems_name_the_kind_and_the_leading_parameters_expected_and_found(stand_in):
    assert surface.problems(_target("Layer.forward", kind="method", params=("self", "input_"))) == []
    assert surface.problems(_target("Layer.forward", kind="any", params=("self",))) == []
    assert surface.problems(_target("Layer.forward", kind="staticmethod")) == [
        f"{MODULE}.Layer.forward is a method, expected a staticmethod"]
    assert surface.problems(_target("function", params=("x", "q"))) == [
        f"{MODULE}.function takes (x, y, z), expected it to start with (x, q)"]
    assert surface.problems(_target("function", params=("x", "y", "z", "w"))) == [
        f"{MODULE}.function takes (x, y, z), expected it to start with (x, y, z, w)"]
    assert surface.problems(_target("CONSTANT", kind="attribute", params=("x",))) == [
        f"{MODULE}.CONSTANT takes no signature, expected it to start with (x)"]
    assert surface.problems(_target("Layer.missing", optional=True)) == []
    assert surface.problems(_target("Layer.missing")) == [f"{MODULE}.Layer.missing does not exist"]
    stand_in.wrapped = types.SimpleNamespace(_self_megapatch="a.patch")  # our own wrapper stands there
    assert surface.problems(_target("wrapped", kind="method")) == []


def test_an_upstream_module_that_fails_to_import_is_a_problem_named_by_its_error(monkeypatch):
    def failing(name):
        raise ImportError("libcudart.so.12: cannot open shared object file")

    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    monkeypatch.setattr(surface.importlib, "import_module", failing)
    assert surface.problems(_target("function"), import_module=True) == [
        f"cannot import {MODULE}: libcudart.so.12: cannot open shared object file"]
    assert surface.fingerprint(_target("function")) == {
        "present": False, "error": "libcudart.so.12: cannot open shared object file"}


def test_the_lock_fingerprint_is_the_signature_and_a_hash_of_the_dedented_source(stand_in):
    import hashlib
    import inspect

    found = surface.fingerprint(_target("function"))
    digest = hashlib.sha256(inspect.cleandoc(inspect.getsource(function)).encode()).hexdigest()[:16]
    assert found == {"present": True, "signature": "(x, y, z=0)", "source_sha256": digest}
    method = surface.fingerprint(_target("Layer.backward"))  # through the staticmethod
    assert method["signature"] == "(ctx, grad_output)" and len(method["source_sha256"]) == 16
    assert method["source_sha256"] != digest
    stand_in.builtin = len  # no Python source
    assert surface.fingerprint(_target("builtin")) == {"present": True, "signature": "(obj, /)", "source_sha256": None}
    assert surface.fingerprint(_target("missing")) == {"present": False, "error": f"{MODULE}.missing does not exist"}


def test_a_target_without_a_signature_or_source_is_fingerprinted_as_none_not_an_error(stand_in):
    """``inspect.signature`` raises ValueError for a built-in without a text signature and TypeError
    for something not callable; ``inspect.getsource`` raises TypeError for both."""
    stand_in.no_signature = getattr
    assert surface.fingerprint(_target("no_signature")) == {"present": True, "signature": None, "source_sha256": None}
    assert surface.fingerprint(_target("CONSTANT")) == {"present": True, "signature": None, "source_sha256": None}
    assert surface.parameter_names(getattr) is None
