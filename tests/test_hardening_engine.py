"""Engine defects found by the outside audit (issue 11) and the engine side of issue 10: each test
failed on the code before its fix."""

import copy
import json
import logging
import pickle
import sys
import types

import pytest
import torch
import wrapt

import megapatch
from megapatch.core import engine, options, wrappers
from megapatch.core.errors import OptionError, UpstreamSurfaceError

from conftest import run_python

from megatron.core.tensor_parallel import layers, mappings  # noqa: E402

ORIGINAL_REDUCE = mappings._reduce
ORIGINAL_ALL_REDUCE = torch.distributed.all_reduce


def _megapatch_lines(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.name == "megapatch" and r.levelno >= level]


# -- 1. MEGAPATCH_CHECK_TIMEOUT is validated like every other variable ------------------------

@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "abc", "", "-inf", "1e400"])
def test_bad_check_timeout_is_refused_naming_variable_value_and_range(value):
    with pytest.raises(OptionError) as err:
        options.resolve({}, environ={"MEGAPATCH_CHECK_TIMEOUT": value})
    message = str(err.value)
    assert f"MEGAPATCH_CHECK_TIMEOUT={value!r}" in message
    assert "a finite number of seconds > 0" in message


def test_check_timeout_is_resolved_and_reaches_the_settings():
    settings, sources = options.resolve({}, environ={"MEGAPATCH_CHECK_TIMEOUT": " 2.5 "})
    assert settings.check_timeout == 2.5 and sources["check_timeout"] == "env MEGAPATCH_CHECK_TIMEOUT"
    assert "check_timeout" not in settings.fingerprint()  # a local wait: peers need not agree
    with pytest.raises(OptionError, match="check_timeout=0"):
        megapatch.enable(tp_reduce_dtype="fp32", check_timeout=0)
    assert not megapatch.is_enabled()


def test_activation_refuses_a_bad_check_timeout(monkeypatch):
    monkeypatch.setenv("MEGAPATCH_CHECK_TIMEOUT", "inf")
    with pytest.raises(OptionError, match="MEGAPATCH_CHECK_TIMEOUT='inf'"):
        megapatch.enable(tp_reduce_dtype="fp32")
    assert not megapatch.is_enabled() and megapatch.status().active == []


def test_doctor_reports_a_bad_check_timeout():
    result = run_python("import sys; from megapatch.commands.cli import main; sys.exit(main(['doctor']))",
                        env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_CHECK_TIMEOUT": "nan"}, fresh=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "MEGAPATCH_CHECK_TIMEOUT='nan'" in result.stdout + result.stderr


# -- 4. the kill switch never fails open -----------------------------------------------------

@pytest.mark.parametrize("value", ["y", "2", "", "disable"])
def test_unknown_kill_switch_spelling_is_an_error(monkeypatch, value):
    monkeypatch.setenv("MEGAPATCH_DISABLE", value)
    with pytest.raises(OptionError) as err:
        megapatch.enable(tp_reduce_dtype="fp32")
    message = str(err.value)
    assert f"MEGAPATCH_DISABLE={value!r}" in message and "valid choices: 1, true, on, yes, 0, false" in message
    assert not megapatch.is_enabled() and megapatch.status().active == []
    assert mappings._reduce is ORIGINAL_REDUCE


def test_resolve_refuses_a_bad_kill_switch_so_doctor_does_too():
    with pytest.raises(OptionError, match="MEGAPATCH_DISABLE='y'"):
        options.resolve({}, environ={"MEGAPATCH_DISABLE": "y", "MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    assert options.disabled({"MEGAPATCH_DISABLE": "off"}) is False
    assert options.disabled({"MEGAPATCH_DISABLE": "On"}) is True


@pytest.mark.parametrize("value", ["YES", " on ", "1"])
def test_true_kill_switch_spellings_disable(monkeypatch, value):
    monkeypatch.setenv("MEGAPATCH_DISABLE", value)
    with pytest.warns(UserWarning, match="MEGAPATCH_DISABLE"):
        status = megapatch.enable(tp_reduce_dtype="fp32")
    assert not status.enabled and status.active == []


def test_environment_activation_with_a_bad_kill_switch_stops_the_megatron_process():
    result = run_python("import megatron.core, megapatch; print(megapatch.status().active)",
                        env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_DISABLE": "y"}, fresh=False)
    assert result.returncode != 0, result.stdout
    assert "MEGAPATCH_DISABLE='y'" in result.stderr


# -- 5. strict=False never raises; enable() is all or nothing --------------------------------

class _NotAFunction:
    """An upstream ``__init__`` that is a callable object, not a plain function."""

    def __call__(self, *args, **kwargs):
        return None


def _break_fp8_probe(monkeypatch):
    from megatron.core.distributed import param_and_grad_buffer as pgb
    import megatron.core.pipeline_parallel.schedules  # noqa: F401 -- the patch's hook module

    monkeypatch.setattr(pgb._ParamAndGradBucketGroup, "__init__", _NotAFunction())


def test_a_probe_that_raises_is_a_skip_when_not_strict(monkeypatch, caplog):
    _break_fp8_probe(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="megapatch"):
        status = megapatch.enable(align_fp8_transposes=True, strict=False)
    report = status.patch("fp8.align_transposes")
    assert report.state == "skipped" and "raised AttributeError" in report.reason


def test_a_probe_that_raises_is_a_surface_error_when_strict(monkeypatch):
    _break_fp8_probe(monkeypatch)
    with pytest.raises(UpstreamSurfaceError, match="fp8.align_transposes.*raised AttributeError"):
        megapatch.enable(align_fp8_transposes=True)
    assert not megapatch.is_enabled()


def test_non_strict_import_never_raises_when_a_probe_raises():
    result = run_python("""
        import dataclasses, megapatch
        from megapatch.core import engine

        def probe():  # as the FP8 probe does on an upstream whose __init__ is not a function
            return object().__init__.__code__

        engine._patches = tuple(dataclasses.replace(p, probe=probe) if p.name == "tp_reduce.megatron_core"
                                else p for p in engine.patches())
        megapatch.enable(tp_reduce_dtype='fp32', strict=False)
        import megatron.core.tensor_parallel   # the hook fires here: must not raise
        report = megapatch.status().patch("tp_reduce.megatron_core")
        print(report.state, "|", report.reason)
    """, fresh=False)
    assert result.returncode == 0, result.stderr[-3000:]
    state, reason = result.stdout.strip().splitlines()[-1].split(" | ", 1)
    assert state == "skipped" and "raised AttributeError" in reason


def _passthrough(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


@pytest.mark.parametrize("strict", [True, False])
def test_third_party_wrapper_on_top_of_ours_survives_disable_and_enable(strict):
    megapatch.enable(tp_reduce_dtype="fp32", strict=strict)
    ours = mappings._reduce
    theirs = wrapt.FunctionWrapper(ours, _passthrough)  # e.g. a profiler wrapping after us
    mappings._reduce = theirs
    try:
        megapatch.disable()
        assert mappings._reduce is theirs
        status = megapatch.enable(tp_reduce_dtype="fp32", strict=strict)
        assert status.patch("tp_reduce.megatron_core").state == "active"
        assert wrappers.find_megapatch_wrapper(theirs) is ours
        assert mappings._reduce is theirs and ours._self_switch.on is True
        assert not wrappers.is_megapatch_wrapper(ours.__wrapped__)  # never wrapped twice
        megapatch.disable()
        assert ours._self_switch.on is False  # cannot be taken out from under theirs: passes through
    finally:
        megapatch.disable()
        mappings._reduce = ORIGINAL_REDUCE


def test_failed_enable_changes_nothing(monkeypatch):
    before = megapatch.enable(logits_dtype="fp32")
    column_forward = layers.ColumnParallelLinear.__dict__["forward"]
    real_install = wrappers.install

    def failing_install(target, patch_name):
        if target.attr == "dist_reduce_scatter_func":
            raise RuntimeError("simulated failure half-way through a patch")
        return real_install(target, patch_name)

    monkeypatch.setattr(wrappers, "install", failing_install)
    with pytest.raises(UpstreamSurfaceError, match="simulated failure"):
        megapatch.enable(tp_reduce_dtype="fp32")
    after = megapatch.status()
    assert after.settings == before.settings and after.sources == before.sources
    assert after.active == before.active and after.enabled
    assert [(p.name, p.state) for p in after.patches] == [(p.name, p.state) for p in before.patches]
    assert mappings._reduce is ORIGINAL_REDUCE  # the half-installed patch was taken out again
    assert layers.ColumnParallelLinear.__dict__["forward"] is column_forward


def test_failed_enable_from_disabled_stays_disabled(monkeypatch):
    monkeypatch.setattr(wrappers, "install", lambda target, name: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(UpstreamSurfaceError):
        megapatch.enable(tp_reduce_dtype="fp32")
    status = megapatch.status()
    assert not status.enabled and status.settings["tp_reduce_dtype"] == "native" and status.active == []


# -- 10. reconfiguring changes only what is passed; status after a failed import -------------

def test_reconfigure_keeps_earlier_explicit_values():
    megapatch.enable(tp_reduce_dtype="fp32", check_timeout=9)
    status = megapatch.enable(logits_dtype="fp32")
    assert status.settings["tp_reduce_dtype"] == "fp32" and status.sources["tp_reduce_dtype"] == "enable()"
    assert status.settings["logits_dtype"] == "fp32" and status.settings["check_timeout"] == 9
    status = megapatch.enable(tp_reduce_dtype="native")  # changing it means passing it
    assert status.settings["tp_reduce_dtype"] == "native" and status.settings["logits_dtype"] == "fp32"
    megapatch.disable()  # forgets earlier arguments
    assert megapatch.enable(logits_dtype="fp32").settings["check_timeout"] == 300


def test_status_after_a_strict_import_failure_says_incompatible():
    result = run_python("""
        import megapatch, dataclasses
        from megapatch.core import engine, registry
        broken = registry.Target("megatron.core.tensor_parallel.mappings", "no_such_symbol", lambda *a: None)
        engine._patches = tuple(dataclasses.replace(p, targets=p.targets + (broken,))
                                if p.name == "tp_reduce.megatron_core" else p for p in engine.patches())
        megapatch.enable(tp_reduce_dtype='fp32')
        try:
            import megatron.core.tensor_parallel
        except Exception as exc:
            print("import failed:", type(exc).__name__)
        report = megapatch.status().patch("tp_reduce.megatron_core")
        print(report.state, "|", report.reason)
    """, fresh=False)
    assert result.returncode == 0, result.stderr[-3000:]
    state, reason = result.stdout.strip().splitlines()[-1].split(" | ", 1)
    assert state == "incompatible" and "no_such_symbol does not exist" in reason


# -- 10. spellings, long values, misspelled variable names -----------------------------------

@pytest.mark.parametrize("variable", ["MEGAPATCH_ALIGN_FP8_TRANSPOSES", "MEGAPATCH_STRICT",
                                      "MEGAPATCH_TP_REDUCE_DTYPE", "MEGAPATCH_LOGITS_DTYPE",
                                      "MEGAPATCH_SKIP_PATCHES", "MEGAPATCH_CHECK_TIMEOUT"])
@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_value_is_an_error_for_every_variable(variable, value):
    with pytest.raises(OptionError) as err:
        options.resolve({}, environ={variable: value})
    assert f"{variable}={value!r} is empty" in str(err.value) and "unset the variable" in str(err.value)


def test_a_huge_invalid_value_is_not_echoed_whole():
    value = "x" * 100_000
    for variable in ("MEGAPATCH_TP_REDUCE_DTYPE", "MEGAPATCH_STRICT", "MEGAPATCH_CHECK_TIMEOUT"):
        with pytest.raises(OptionError) as err:
            options.resolve({}, environ={variable: value})
        message = str(err.value)
        assert len(message) < 600 and variable in message and "(100000 characters)" in message


def test_misspelled_variables_are_reported_with_the_closest_name(monkeypatch, caplog):
    env = {"MEGAPATCH_TP_REDUCE_DTPYE": "fp32", "MEGAPATCH_LOGITS_DTYPE": "fp32", "MEGAPATCH_ZZZ": "1"}
    found = dict(options.unknown_env_variables(env))
    assert found == {"MEGAPATCH_TP_REDUCE_DTPYE": "MEGAPATCH_TP_REDUCE_DTYPE", "MEGAPATCH_ZZZ": None}
    monkeypatch.setenv("MEGAPATCH_TP_REDUCE_DTPYE", "fp32")
    with caplog.at_level(logging.WARNING, logger="megapatch"):
        megapatch.enable(logits_dtype="fp32")
    warned = [m for m in _megapatch_lines(caplog, logging.WARNING) if "MEGAPATCH_TP_REDUCE_DTPYE" in m]
    assert len(warned) == 1 and "did you mean MEGAPATCH_TP_REDUCE_DTYPE?" in warned[0]


def test_our_wrapper_is_found_beneath_63_others_and_a_looping_chain_ends_the_search():
    """``find_megapatch_wrapper`` follows a ``__wrapped__`` chain for 64 objects: ours beneath 63
    third-party wrappers is still found (so re-enabling adopts it instead of wrapping twice), and a
    chain that loops back on itself ends the search instead of hanging."""
    megapatch.enable(tp_reduce_dtype="fp32")
    ours = mappings._reduce
    top = ours
    for _ in range(63):
        top = wrapt.FunctionWrapper(top, _passthrough)
    assert wrappers.find_megapatch_wrapper(top) is ours

    class Loop:
        pass

    loop = Loop()
    loop.__wrapped__ = loop
    assert wrappers.find_megapatch_wrapper(loop) is None


# -- 8. from-import aliases and pickling -----------------------------------------------------

def test_alias_held_in_main_is_rebound_and_restored():
    result = run_python("""
        from megatron.core.tensor_parallel.mappings import _reduce
        import megapatch
        from megapatch.core import wrappers
        original = _reduce
        megapatch.enable(tp_reduce_dtype='fp32')
        wrapped = wrappers.is_megapatch_wrapper(_reduce)
        megapatch.disable()
        print(wrapped, _reduce is original)
    """, fresh=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "True True"


def test_torch_collective_alias_taken_while_enabled_is_restored_by_disable():
    megapatch.enable(tp_reduce_dtype="fp32")
    # `from torch.distributed import all_reduce` in user code and in a torch module imported late
    holders = [types.ModuleType("user_code_from_torch_distributed"),
               types.ModuleType("torch.distributed._imported_while_megapatch_was_on")]
    for holder in holders:
        holder.all_reduce = torch.distributed.all_reduce
        sys.modules[holder.__name__] = holder
    try:
        assert all(wrappers.is_megapatch_wrapper(h.all_reduce) for h in holders)
        megapatch.disable()
        assert [h.all_reduce is ORIGINAL_ALL_REDUCE for h in holders] == [True, True]
        assert torch.distributed.all_reduce is ORIGINAL_ALL_REDUCE
    finally:
        for holder in holders:
            sys.modules.pop(holder.__name__, None)


def test_wrapped_functions_pickle_and_copy_like_stock():
    megapatch.enable(tp_reduce_dtype="fp32")
    wrapper = mappings._reduce
    assert pickle.loads(pickle.dumps(wrapper)) is mappings._reduce
    assert copy.copy(wrapper) is wrapper and copy.deepcopy(wrapper) is wrapper
    assert copy.deepcopy({"fn": wrapper})["fn"] is wrapper
    loaded = pickle.loads(pickle.dumps(layers.RowParallelLinear.forward))  # a method, via the class
    assert wrappers.is_megapatch_wrapper(loaded)
    assert loaded.__wrapped__ is layers.RowParallelLinear.__dict__["forward"].__wrapped__
    stale = pickle.dumps(wrapper)
    megapatch.disable()
    assert pickle.loads(stale) is ORIGINAL_REDUCE  # by reference: whatever the name holds now
    assert pickle.loads(pickle.dumps(wrapper)) is ORIGINAL_REDUCE


# -- issue 10 item 4: per-patch opt-out ------------------------------------------------------

def test_skip_patches_opts_one_patch_out_and_says_so(monkeypatch):
    monkeypatch.setenv("MEGAPATCH_SKIP_PATCHES", "tp_reduce.transformer_engine")
    status = megapatch.enable(tp_reduce_dtype="fp32")
    te = status.patch("tp_reduce.transformer_engine")
    assert te.state == "opted-out" and "MEGAPATCH_SKIP_PATCHES" in te.reason
    assert status.patch("tp_reduce.megatron_core").state == "active"
    assert status.settings["skip_patches"] == ("tp_reduce.transformer_engine",)
    assert "opted-out" in str(status)


def test_skip_patches_argument_removes_an_installed_patch():
    megapatch.enable(tp_reduce_dtype="fp32")
    status = megapatch.enable(skip_patches=["tp_reduce.megatron_core"])
    assert status.patch("tp_reduce.megatron_core").state == "opted-out"
    assert mappings._reduce is ORIGINAL_REDUCE
    assert status.sources["skip_patches"] == "enable()"
    # the MoE patch reads what the RowParallelLinear wrapper hands on: it is left out with it
    moe = status.patch("tp_reduce.moe")
    assert moe.state == "opted-out" and "builds on tp_reduce.megatron_core" in moe.reason, moe


def test_unknown_patch_name_is_refused_with_the_valid_names(monkeypatch):
    monkeypatch.setenv("MEGAPATCH_SKIP_PATCHES", "tp_reduce.transformer_engin")
    with pytest.raises(OptionError) as err:
        megapatch.enable(tp_reduce_dtype="fp32")
    message = str(err.value)
    assert "MEGAPATCH_SKIP_PATCHES='tp_reduce.transformer_engin'" in message
    assert "did you mean tp_reduce.transformer_engine?" in message
    assert "valid patch names:" in message and "tp_reduce.megatron_core" in message
    assert not megapatch.is_enabled()


def test_an_unknown_patch_name_given_to_enable_is_named_as_its_argument():
    """The refusal names where the value came from: ``skip_patches`` of ``enable()``, not the
    variable (mutation sample 29: the origin test ``== "enable()"`` had no test)."""
    with pytest.raises(OptionError) as err:
        megapatch.enable(tp_reduce_dtype="fp32", skip_patches="tp_reduce.transformer_engin")
    message = str(err.value)
    assert message.startswith("skip_patches='tp_reduce.transformer_engin' names unknown megapatch patch"), message
    assert "MEGAPATCH_SKIP_PATCHES" not in message
    assert not megapatch.is_enabled()


def test_opting_out_every_patch_of_a_requested_option_is_refused():
    with pytest.raises(OptionError, match="every patch serving it is opted out") as err:
        megapatch.enable(tp_reduce_dtype="fp32",
                         skip_patches="tp_reduce.megatron_core,tp_reduce.transformer_engine")
    assert not megapatch.is_enabled()
    assert "tp_reduce.moe builds on tp_reduce.megatron_core" in str(err.value), err.value


# -- issue 10 item 3: one activation line, once-per-job lines --------------------------------

def test_one_activation_line_with_settings_sources_and_patches(monkeypatch, caplog):
    monkeypatch.setenv("MEGAPATCH_LOGITS_DTYPE", "fp32")
    with caplog.at_level(logging.INFO, logger="megapatch"):
        megapatch.enable(tp_reduce_dtype="fp32", skip_patches="tp_reduce.transformer_engine")
        megapatch.enable(tp_reduce_dtype="fp32")  # nothing changed: no second line
    lines = [m for m in _megapatch_lines(caplog) if m.startswith("megapatch enabled:")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "tp_reduce_dtype=fp32 (enable())" in line
    assert "logits_dtype=fp32 (env MEGAPATCH_LOGITS_DTYPE)" in line and "strict=True (default)" in line
    # counts only (issue 48 item 4): the names are on the patches line, the backends in status()
    assert " active" in line and "1 opted-out" in line and "tp_reduce.megatron_core" not in line, line
    assert "megatron-core 0." in line


def test_activation_line_only_on_rank_zero(monkeypatch, caplog):
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger="megapatch"):
        megapatch.enable(tp_reduce_dtype="fp32")
    assert not [m for m in _megapatch_lines(caplog) if m.startswith("megapatch enabled:")]


def test_activation_line_reaches_stderr_without_any_logging_configuration():
    result = run_python("""
        import logging, megapatch
        megapatch.enable(tp_reduce_dtype='fp32')
        assert not logging.getLogger().handlers  # the root logger was left alone
    """, fresh=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("megapatch enabled: tp_reduce_dtype=fp32 (enable())") == 1


def test_activation_line_goes_to_the_applications_handlers_once_it_has_some():
    result = run_python("""
        import logging, sys, megapatch
        logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="APP %(name)s %(message)s")
        megapatch.enable(tp_reduce_dtype='fp32')
    """, fresh=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("APP megapatch megapatch enabled:") == 1
    assert "megapatch enabled:" not in result.stderr  # no duplicate through a handler of ours


def test_a_rank_variable_that_is_not_a_number_counts_as_rank_zero(monkeypatch, caplog):
    """No process group and ``RANK`` not an integer: rank 0 (the line is logged), never an error
    out of ``enable()``."""
    monkeypatch.setenv("RANK", "worker-3")
    with caplog.at_level(logging.INFO, logger="megapatch"):
        megapatch.enable(tp_reduce_dtype="fp32")
    assert [m for m in _megapatch_lines(caplog) if m.startswith("megapatch enabled:")]


def test_the_activation_line_gives_each_patch_that_is_not_active_its_reason(monkeypatch, caplog):
    from megapatch.core import report

    def _reduce(tensor, process_group):  # an upstream whose surface changed: skipped (strict=False)
        return tensor

    monkeypatch.setattr(mappings, "_reduce", _reduce)
    monkeypatch.setattr(report, "_said", set())  # the skip's once-per-process warning: not used up here
    with caplog.at_level(logging.INFO, logger="megapatch"):
        megapatch.enable(tp_reduce_dtype="fp32", strict=False, skip_patches="tp_reduce.transformer_engine")
    [line] = [m for m in _megapatch_lines(caplog) if m.startswith("megapatch enabled:")]
    assert "1 opted-out, 1 skipped" in line, line  # counted; each reason in status() (issue 48 item 4)
    status = megapatch.status()
    assert status.patch("tp_reduce.transformer_engine").reason == "left out on purpose: skip_patches from enable()"
    assert status.patch("tp_reduce.megatron_core").reason.startswith(
        "megatron.core.tensor_parallel.mappings._reduce takes (tensor, process_group)")
    [skipped] = [m for m in _megapatch_lines(caplog) if "patch tp_reduce.megatron_core skipped" in m]
    assert "mappings._reduce takes (tensor, process_group)" in skipped, skipped


def test_the_level_megapatch_set_is_undone_once_the_application_configures_logging():
    """With no handler anywhere megapatch shows its INFO lines itself (its handler, level INFO on its
    logger); once the application configures logging, both go and the application's level rules."""
    result = run_python("""
        import logging, sys, megapatch
        megapatch.enable(tp_reduce_dtype='fp32')
        assert logging.getLogger("megapatch").level == logging.INFO
        logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="APP %(name)s %(message)s")
        megapatch.enable(logits_dtype='fp32')  # another activation line, at INFO
        print("LEVEL", logging.getLogger("megapatch").level)
    """, fresh=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("megapatch enabled:") == 1  # the first, through megapatch's handler
    assert "megapatch enabled:" not in result.stdout  # INFO is below the application's WARNING
    assert "LEVEL 0" in result.stdout  # NOTSET again: the level is the application's


def test_fp8_pass_through_is_logged_once(caplog):
    from megapatch.patches.fp8 import align_transposes as fp8

    with caplog.at_level(logging.INFO, logger="megapatch"):
        for _ in range(3):
            fp8._decide(False, "test reason: no FP8 parameters")
        fp8._decide(True, "aligned", 2)
    lines = [m for m in _megapatch_lines(caplog) if "passes through" in m]
    assert lines == ["megapatch: fp8.align_transposes was requested but passes through: "
                     "test reason: no FP8 parameters"]


def test_status_serialises_with_the_new_options():
    status = megapatch.enable(tp_reduce_dtype="fp32", skip_patches="tp_reduce.transformer_engine")
    json.dumps(status.as_dict())


# -- wrappers: install and uninstall on stand-in modules (every alias, inherited attributes) -------

def _module(name, **attributes):
    import types

    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


def test_aliases_are_found_in_every_module_but_the_skipped_packages_and_put_back_everywhere(monkeypatch):
    """Install binds the wrapper into every module holding the original (``from``-imports), except
    the owner and the packages that cannot hold upstream functions (torch, numpy, ... matched as
    the name or a dotted prefix, not as a bare prefix: ``torchvision`` is scanned). Uninstall puts
    the original back in every module that holds the wrapper, skipped packages included."""
    import sys

    from megapatch.core import wrappers
    from megapatch.core.registry import Target

    def original(x):
        return ("original", x)

    owner = _module("mp_stand_in_upstream", fn=original)
    holders = {name: _module(name, alias=original) for name in
               ("mp_stand_in_client", "torchvision_like", "torch.mp_stand_in", "numpy")}
    monkeypatch.setitem(sys.modules, "mp_stand_in_upstream", owner)
    monkeypatch.setitem(sys.modules, "mp_stand_in_none", None)  # a failed import leaves None
    monkeypatch.setitem(sys.modules, "mp_stand_in_not_a_module", object())
    for name, module in holders.items():
        monkeypatch.setitem(sys.modules, name, module)
    assert [wrappers._skipped(n) for n in ("torch", "torch.x", "torchvision", "numpyro", "numpy")] == \
        [True, True, False, False, True]
    installed = wrappers.install(Target("mp_stand_in_upstream", "fn", lambda w, i, a, k: ("wrapped", w(*a, **k))),
                                 "test.patch")
    assert owner.fn(1) == ("wrapped", ("original", 1))
    rebound = {name for name, module in holders.items() if module.alias is not original}
    assert rebound == {"mp_stand_in_client", "torchvision_like"}
    assert {m.__name__ for m, _ in installed.aliases} == rebound
    holders["numpy"].alias = owner.fn  # taken while installed, in a skipped package
    wrappers.uninstall(installed)
    assert owner.fn is original and all(m.alias is original for m in holders.values())
    assert not installed.wrapper._self_switch.on


def test_an_inherited_method_is_removed_again_not_left_as_an_own_attribute(monkeypatch):
    """A target inherited from a base class is set on the subclass while installed; uninstall
    deletes it (the class inherits again), instead of pinning the original on the subclass."""
    from megapatch.core import wrappers
    from megapatch.core.registry import Target

    class Base:
        def forward(self):
            return "base"

    class Child(Base):
        pass

    module = _module("mp_stand_in_inherit", Child=Child)
    holder = _module("mp_stand_in_holder", function=Base.forward)  # the same function, held elsewhere
    monkeypatch.setitem(sys.modules, "mp_stand_in_inherit", module)
    monkeypatch.setitem(sys.modules, "mp_stand_in_holder", holder)
    installed = wrappers.install(Target("mp_stand_in_inherit", "Child.forward",
                                        lambda w, i, a, k: "wrapped " + w(*a, **k), kind="method"), "test.patch")
    assert "forward" in Child.__dict__ and Child().forward() == "wrapped base"
    assert holder.function is Base.__dict__["forward"] and installed.aliases == []  # a method: no alias scan
    wrappers.uninstall(installed)
    assert "forward" not in Child.__dict__ and Child().forward() == "base"
    Base.forward = lambda self: "changed base"
    assert Child().forward() == "changed base"  # inherits again


def test_a_proxy_whose_wrapped_attribute_raises_ends_the_search_and_unreachable_functions_do_not_pickle():
    from megapatch.core import wrappers

    class Exotic:
        @property
        def __wrapped__(self):
            raise RuntimeError("no chain here")

    assert wrappers.find_megapatch_wrapper(Exotic()) is None and not wrappers.is_megapatch_wrapper(Exotic())

    def local():
        pass

    for unreachable in (local, lambda: None, staticmethod(local)):
        with pytest.raises(TypeError, match="not reachable by module and qualified name"):
            wrappers._by_reference(unreachable)
    getter, (module,) = wrappers._by_reference(pickle.dumps)
    assert getter(pickle.loads(pickle.dumps(module))) is pickle.dumps


def test_a_wrapped_method_bound_to_an_instance_copies_and_pickles_like_a_bound_method(monkeypatch):
    """``copy`` keeps the bound method; ``deepcopy`` binds to a copy of the instance (as a bound
    method in a deep-copied structure does); pickling rebuilds it from the instance and the name;
    through the class (no instance) it pickles by reference."""
    import sys

    from megapatch.core import wrappers
    from megapatch.core.registry import Target

    def forward(self, x):
        return x * self.scale

    Layer = type("Layer", (), {"__module__": "mp_stand_in_bound", "scale": 2, "forward": forward})
    Layer.__qualname__ = "Layer"
    forward.__qualname__, forward.__module__ = "Layer.forward", "mp_stand_in_bound"
    monkeypatch.setitem(sys.modules, "mp_stand_in_bound", _module("mp_stand_in_bound", Layer=Layer))
    installed = wrappers.install(Target("mp_stand_in_bound", "Layer.forward",
                                        lambda w, i, a, k: w(*a, **k) + 1, kind="method"), "test.patch")
    layer = Layer()
    layer.scale = 3
    bound = layer.forward
    assert type(bound) is wrappers.MegapatchBoundWrapper and bound(5) == 16
    assert copy.copy(bound) is bound
    deep = copy.deepcopy(bound)
    assert deep.__self__ is not layer and isinstance(deep.__self__, Layer) and deep.__self__.scale == 3
    assert deep(5) == 16 and wrappers.is_megapatch_wrapper(deep)
    memo_shared = copy.deepcopy({"layer": layer, "fn": bound})
    assert memo_shared["fn"].__self__ is memo_shared["layer"]  # one copy of the instance
    loaded = pickle.loads(pickle.dumps(bound))
    assert loaded.__self__ is not layer and loaded.__self__.scale == 3 and loaded(5) == 16
    through_class = Layer.forward
    assert copy.deepcopy(through_class) is through_class
    by_reference = pickle.loads(pickle.dumps(through_class))  # whatever the name holds now: the wrapper
    assert wrappers.is_megapatch_wrapper(by_reference) and by_reference.__wrapped__ is forward
    wrappers.uninstall(installed)


def test_an_alias_in_a_module_no_longer_in_sys_modules_is_put_back_from_the_install_record(monkeypatch):
    """Install records each alias it bound; uninstall puts those back even where the module has
    left ``sys.modules`` since (a reload, a test harness): the scan of ``sys.modules`` alone would
    leave the wrapper there."""
    import sys

    from megapatch.core import wrappers
    from megapatch.core.registry import Target

    def original():
        return "original"

    owner, client = _module("mp_stand_in_owner", fn=original), _module("mp_stand_in_gone", fn=original)
    monkeypatch.setitem(sys.modules, "mp_stand_in_owner", owner)
    monkeypatch.setitem(sys.modules, "mp_stand_in_gone", client)
    installed = wrappers.install(Target("mp_stand_in_owner", "fn", lambda w, i, a, k: "wrapped"), "test.patch")
    assert client.fn() == "wrapped" and installed.aliases == [(client, "fn")]
    del sys.modules["mp_stand_in_gone"]
    wrappers.uninstall(installed)
    assert owner.fn is original and client.fn is original


# -- the engine's per-patch steps on a stand-in patch (in-process) ---------------------------------

@pytest.fixture
def engine_records(monkeypatch):
    """Fresh per-patch records, so that a stand-in patch leaves the real ones untouched."""
    from megapatch.core import engine as core_engine

    for name in ("_installed", "_skipped", "_failed"):
        monkeypatch.setattr(core_engine, name, {})
    return core_engine


def _stand_in_patch(module_name, attrs, **fields):
    from megapatch.core.registry import Patch, Target

    return Patch(name="stand.in", option="logits_dtype", summary="a stand-in", hook=module_name,
                 targets=tuple(Target(module_name, a, lambda w, i, a_, k: w(*a_, **k)) for a in attrs),
                 applies=lambda s: s.logits_dtype == "fp32", **fields)


def test_a_wrapper_that_cannot_be_installed_takes_the_patchs_earlier_targets_out_again(engine_records, monkeypatch):
    import sys

    from megapatch.core import wrappers
    from megapatch.core.errors import UpstreamSurfaceError

    def first():
        return 1

    def second():
        return 2

    taken = wrappers.MegapatchWrapper(second, lambda w, i, a, k: w(*a, **k), "other.patch")
    module = _module("mp_stand_in_engine", first=first, second=taken)
    monkeypatch.setitem(sys.modules, "mp_stand_in_engine", module)
    patch = _stand_in_patch("mp_stand_in_engine", ("first", "second"))
    reason = ("installing the wrapper on mp_stand_in_engine.second failed: RuntimeError: mp_stand_in_engine.second "
              "is already wrapped by megapatch patch 'other.patch'")
    engine_records._install(patch, strict=False)
    assert module.first is first and "stand.in" not in engine_records._installed
    assert engine_records._skipped == {"stand.in": reason}
    with pytest.raises(UpstreamSurfaceError, match="cannot apply: " + reason.replace("(", r"\(").replace(")", r"\)")):
        engine_records._install(patch, strict=True)
    assert module.first is first and module.second is taken


def test_a_check_or_probe_that_raises_is_a_reason_not_a_crash_and_the_probe_waits_for_the_surface(engine_records, monkeypatch):
    import sys

    from megapatch.core import surface

    def fn(x):
        return x

    monkeypatch.setitem(sys.modules, "mp_stand_in_engine", _module("mp_stand_in_engine", fn=fn))
    probed = []

    def probe():
        probed.append(True)
        raise ValueError("an __init__ that is not a function")

    patch = _stand_in_patch("mp_stand_in_engine", ("fn",), probe=probe)
    assert engine_records._incompatibilities(patch) == [
        "the upstream check of stand.in raised ValueError: an __init__ that is not a function"]
    missing = _stand_in_patch("mp_stand_in_engine", ("gone",), probe=probe)
    assert engine_records._incompatibilities(missing) == ["mp_stand_in_engine.gone does not exist"]
    assert len(probed) == 1  # no probe while the surface itself is wrong

    def unreadable(target, import_module=False):
        raise RuntimeError("a C object without a signature")

    monkeypatch.setattr(surface, "problems", unreadable)
    assert engine_records._incompatibilities(patch) == [
        "checking mp_stand_in_engine.fn raised RuntimeError: a C object without a signature"]


def test_status_of_a_patch_says_why_it_is_not_active_and_survives_a_backend_that_raises(engine_records, monkeypatch):
    from megapatch.core import options

    def backend():
        raise RuntimeError("not yet known")

    patch = _stand_in_patch("mp_stand_in_engine", (), backend=backend)
    fp32 = options.Settings(logits_dtype="fp32")
    monkeypatch.setattr(engine_records, "_enabled", False)
    assert (engine_records._report(patch, fp32).state, engine_records._report(patch, fp32).reason) == (
        "inactive", "megapatch is disabled")
    monkeypatch.setattr(engine_records, "_enabled", True)
    native = engine_records._report(patch, options.NATIVE)
    assert (native.state, native.reason) == ("inactive", "not requested (logits_dtype is native)")
    pending = engine_records._report(patch, fp32)
    assert (pending.state, pending.reason) == ("pending-import", "installs when mp_stand_in_engine is imported")
    engine_records._skipped["stand.in"] = "a reason"
    assert (engine_records._report(patch, fp32).state, engine_records._report(patch, fp32).reason) == ("skipped", "a reason")
    engine_records._failed["stand.in"] = "it raised"
    assert engine_records._report(patch, fp32).state == "incompatible"
    engine_records._installed["stand.in"] = []
    active = engine_records._report(patch, fp32)
    assert (active.state, active.backend) == ("active", "unknown (RuntimeError: not yet known)")


# -- issue 28 item 8: survivors of the eighth fresh mutation sample (seed 35) ----------------------

def test_an_optional_target_is_installed_where_present_and_left_out_where_absent(engine_records, monkeypatch):
    import sys

    from megapatch.core.registry import Patch, Target

    def here(x):
        return x

    module = _module("mp_stand_in_engine", here=here)
    monkeypatch.setitem(sys.modules, "mp_stand_in_engine", module)
    wrap = lambda w, i, a, k: ("wrapped", w(*a, **k))  # noqa: E731
    patch = Patch(name="stand.in", option="logits_dtype", summary="a stand-in", hook="mp_stand_in_engine",
                  targets=(Target("mp_stand_in_engine", "here", wrap, optional=True),
                           Target("mp_stand_in_engine", "only_in_later_releases", wrap, optional=True)),
                  applies=lambda s: True)
    engine_records._install(patch, strict=True)
    try:
        assert module.here(1) == ("wrapped", 1)
        assert [i.target.attr for i in engine_records._installed["stand.in"]] == ["here"]
    finally:
        engine_records._uninstall(patch)
    assert module.here is here


def test_stopping_the_kill_switchs_announcements_takes_their_wrappers_out(engine_records, monkeypatch):
    import sys

    from megapatch.core import wrappers
    from megapatch.core.registry import Target

    def initialize_model_parallel():
        return "groups"

    module = _module("mp_stand_in_engine", initialize_model_parallel=initialize_model_parallel)
    monkeypatch.setitem(sys.modules, "mp_stand_in_engine", module)
    installed = wrappers.install(Target("mp_stand_in_engine", "initialize_model_parallel",
                                        lambda w, i, a, k: w(*a, **k)), "cross_rank.publish_settings")
    monkeypatch.setattr(engine_records, "_announcing", {"cross_rank.publish_settings": [installed]})
    assert module.initialize_model_parallel is not initialize_model_parallel
    engine_records._stop_announcing()
    assert module.initialize_model_parallel is initialize_model_parallel and engine_records._announcing == {}


def test_a_rollback_that_cannot_reinstall_a_patch_says_so_and_restores_the_rest(engine_records, monkeypatch, caplog):
    """enable() failing half-way puts back what it changed; a patch it cannot reinstall (its upstream
    went away meanwhile) is logged, and the settings and records are restored all the same."""
    from megapatch.core import options, state, wrappers
    from megapatch.core.registry import Target

    gone = wrappers.Installed(Target("mp_stand_in_module_gone", "fn", lambda w, i, a, k: None), None, "fn",
                              None, None, [])
    before = (True, options.Settings(logits_dtype="fp32"), {"logits_dtype": "enable()"}, {"stand.in": [gone]},
              {"other": "a skip reason"}, {})
    monkeypatch.setattr(state, "_current", options.NATIVE)
    monkeypatch.setattr(state, "_sources", {})
    monkeypatch.setattr(engine_records, "_enabled", False)
    caplog.set_level(logging.ERROR, logger="megapatch")
    engine_records._rollback(before)
    assert any("reinstalling stand.in failed" in r.getMessage() for r in caplog.records), caplog.records
    assert state.current() == options.Settings(logits_dtype="fp32") and engine_records._enabled is True
    assert engine_records._skipped == {"other": "a skip reason"} and "stand.in" not in engine_records._installed


def test_a_patch_whose_targets_span_modules_installs_once_the_last_of_them_is_imported(monkeypatch, tmp_path):
    """megatron-core imports ``distributed_data_parallel`` (tp_invariant.data_parallel's hook) before
    ``finalize_model_grads`` (one of its targets): with TE installed that order reached the hook's
    import first and ``import megatron.core`` failed under the mode. A patch now waits for every
    module it needs; here a package imports the hook's module, then the target's."""
    import sys

    import megapatch
    from megapatch.core import engine as core_engine
    from megapatch.core.registry import Patch, Target

    package = tmp_path / "mp_order_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from . import first\nfrom . import second\n")
    (package / "first.py").write_text("def fn():\n    return 'first'\n")
    (package / "second.py").write_text("def fn():\n    return 'second'\n")
    wrap = lambda w, i, a, k: ("wrapped", w(*a, **k))  # noqa: E731
    patch = Patch(name="stand.in", option="logits_dtype", summary="a stand-in", hook="mp_order_pkg.first",
                  targets=(Target("mp_order_pkg.first", "fn", wrap), Target("mp_order_pkg.second", "fn", wrap)),
                  applies=lambda s: s.logits_dtype == "fp32")
    for name in ("_installed", "_skipped", "_failed"):
        monkeypatch.setattr(core_engine, name, {})
    monkeypatch.setattr(core_engine, "_patches", (patch,))
    monkeypatch.setattr(core_engine, "_hooked", set())
    monkeypatch.setattr(core_engine, "_loaded", set())
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("mp_order_pkg", "mp_order_pkg.first", "mp_order_pkg.second"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    megapatch.enable(logits_dtype="fp32")
    try:
        report = next(r for r in megapatch.status().patches if r.name == "stand.in")
        assert report.state == "pending-import" and "mp_order_pkg.first" in report.reason
        import mp_order_pkg

        assert mp_order_pkg.first.fn() == ("wrapped", "first") and mp_order_pkg.second.fn() == ("wrapped", "second")
        assert "stand.in" in core_engine._installed
    finally:
        megapatch.disable()
    assert mp_order_pkg.first.fn() == "first" and mp_order_pkg.second.fn() == "second"
