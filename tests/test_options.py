"""Option parsing and every error message a user can get from bad input."""

import pytest
import torch

import megapatch
from megapatch.core import options
from megapatch.core.errors import OptionError, OptionUnavailableError


def test_defaults_are_native():
    settings, sources = options.resolve({}, environ={})
    assert settings == options.NATIVE
    assert set(sources.values()) == {"default"}


@pytest.mark.parametrize("value", ["fp32", "FP32", " float32 ", torch.float32, "torch.float32"])
def test_fp32_spellings(value):
    settings, sources = options.resolve({"tp_reduce_dtype": value}, environ={})
    assert settings.tp_reduce_dtype == "fp32"
    assert sources["tp_reduce_dtype"] == "enable()"


def test_argument_beats_environment_beats_default():
    env = {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32-accumulate", "MEGAPATCH_STRICT": "0"}
    settings, sources = options.resolve({"tp_reduce_dtype": "fp32"}, environ=env)
    assert settings.tp_reduce_dtype == "fp32" and sources["tp_reduce_dtype"] == "enable()"
    assert settings.strict is False and sources["strict"] == "env MEGAPATCH_STRICT"
    assert sources["logits_dtype"] == "default"


def test_unknown_value_names_option_value_and_choices():
    with pytest.raises(OptionError) as err:
        options.resolve({"tp_reduce_dtype": "bf8"}, environ={})
    message = str(err.value)
    assert "tp_reduce_dtype='bf8'" in message
    assert "valid choices: native, fp32, fp32-accumulate" in message


def test_unknown_env_value_names_the_variable():
    with pytest.raises(OptionError) as err:
        options.resolve({}, environ={"MEGAPATCH_TP_REDUCE_DTYPE": "fp64"})
    assert "MEGAPATCH_TP_REDUCE_DTYPE='fp64'" in str(err.value)
    assert "valid choices" in str(err.value)


def test_bad_boolean_names_the_variable_and_choices():
    with pytest.raises(OptionError) as err:
        options.resolve({}, environ={"MEGAPATCH_STRICT": "maybe"})
    assert "MEGAPATCH_STRICT='maybe'" in str(err.value) and "valid choices: 1, true" in str(err.value)


@pytest.mark.parametrize("value", ["fp16", "float16", torch.float16])
def test_fp16_logits_are_refused_with_the_reason(value):
    with pytest.raises(OptionError) as err:
        options.resolve({"logits_dtype": value}, environ={})
    assert "refused" in str(err.value) and "upstream refuses --output-logit-dtype fp16" in str(err.value)


def test_enable_with_bad_value_changes_nothing():
    # logits_dtype: an option every matrix version takes (tp_reduce_dtype is refused on 0.12.3)
    megapatch.enable(logits_dtype="fp32")
    before = megapatch.status()
    with pytest.raises(OptionError):
        megapatch.enable(logits_dtype="fp32", tp_reduce_dtype="fp8")
    after = megapatch.status()
    assert after.settings == before.settings and after.active == before.active


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        megapatch.enable(tp_reduce="fp32")


def test_option_without_a_patch_is_not_available_yet(monkeypatch):
    from megapatch.core import engine

    kept = tuple(p for p in engine.patches() if p.option != "tp_reduce_dtype")
    monkeypatch.setattr(engine, "_patches", kept)
    with pytest.raises(OptionUnavailableError) as err:
        megapatch.enable(tp_reduce_dtype="fp32")
    # the message names what set the value: here the keyword, not a variable nobody set
    assert "from enable(tp_reduce_dtype='fp32')" in str(err.value)
    assert "MEGAPATCH_TP_REDUCE_DTYPE" not in str(err.value) and "not available yet" in str(err.value)
    monkeypatch.setenv("MEGAPATCH_TP_REDUCE_DTYPE", "fp32")
    with pytest.raises(OptionUnavailableError, match="from MEGAPATCH_TP_REDUCE_DTYPE=fp32 in the environment"):
        megapatch.enable()


def test_disable_env_turns_enable_into_a_no_op(monkeypatch):
    monkeypatch.setenv("MEGAPATCH_DISABLE", "1")
    with pytest.warns(UserWarning, match="MEGAPATCH_DISABLE"):
        status = megapatch.enable(tp_reduce_dtype="fp32")
    assert not status.enabled and status.active == []


def test_every_power_of_two_up_to_128_is_a_width_and_nothing_else_is():
    """fresh-sample survivor (options.py: the choices' 32 turned 33): each width the docs promise
    (tp_invariant.md: a power of two in 1..128) is taken from the variable and from enable(), and
    the refusal of another lists exactly those."""
    widths = [2 ** i for i in range(8)]
    for width in widths:
        env = {"MEGAPATCH_TP_INVARIANT": "1", "MEGAPATCH_TP_INVARIANT_WIDTH": str(width)}
        assert options.resolve({}, environ=env)[0].tp_invariant_width == width
        assert options.resolve({"tp_invariant": True, "tp_invariant_width": width}, environ={})[0].tp_invariant_width == width
    for other in ("33", "48", "256"):
        with pytest.raises(OptionError) as err:
            options.resolve({}, environ={"MEGAPATCH_TP_INVARIANT_WIDTH": other})
        assert "valid choices: " + ", ".join(map(str, widths)) in str(err.value), str(err.value)
