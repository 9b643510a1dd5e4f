"""The options megapatch understands, as data: name, environment variable, kind, choices, aliases.

Resolution order for each option: explicit argument to ``enable()``, then the environment, then
the default. Parsing never imports torch, so the startup hook can validate the environment in
processes that will never touch torch (pip, linters, other tools).

Spelling rules, the same for every variable: values are case-insensitive and stripped; booleans
take ``1/true/on/yes`` and ``0/false/off/no``; an *empty* value is an error for every variable
(``MEGAPATCH_X=`` is usually an unexpanded shell variable, and guessing "off" could run BF16 where
FP32 was meant): unset the variable to get its default. ``MEGAPATCH_DISABLE`` follows the same
rule: a value that is neither a true nor a false spelling is an error, never ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, List, Mapping, Optional, Tuple

from megapatch.core.errors import OptionError

ENV_PREFIX = "MEGAPATCH_"
DISABLE_ENV = "MEGAPATCH_DISABLE"
TIMEOUT_ENV = "MEGAPATCH_CHECK_TIMEOUT"
SKIP_PATCHES_ENV = "MEGAPATCH_SKIP_PATCHES"
#: Written by the tools that set ``MEGAPATCH_*`` variables for the user (``megapatch-run``, the
#: NeMo-Run plugin): ``VAR=VALUE|who;...``, so that a message names the flag or field the user
#: really wrote. An entry counts only while ``VAR`` still holds ``VALUE``.
SET_BY_ENV = "MEGAPATCH_SET_BY"
#: how the job is launched (``here``, ``cuda``, ``cpu``, ``cpu-te``): read by ``megapatch doctor`` as the
#: default of ``--launch``, set by the CPU launcher in its ranks; it asks for nothing (no activation)
LAUNCH_ENV = "MEGAPATCH_LAUNCH"

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
_SHOWN_CHARS = 80


def shown(value: Any) -> str:
    """``repr(value)``, cut short: an error message never echoes a 100 kB value whole."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:_SHOWN_CHARS]}... ({len(str(value))} characters)"


@dataclasses.dataclass(frozen=True)
class Option:
    """One option. ``kind``: ``choice`` (one of ``choices``, after ``aliases``), ``boolean``,
    ``seconds`` (a finite number > 0) or ``names`` (a comma-separated list, a tuple when parsed).

    ``compared``: the ranks of a tensor-parallel group must agree on it (it changes what they
    compute or which collectives they issue). ``request``: a value other than the default asks
    megapatch to change upstream behaviour (what ``Settings.requested()`` lists).
    """

    name: str
    env: str
    default: Any
    help: str
    choices: tuple = ()  # (False, True) for a boolean
    aliases: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    kind: str = "choice"
    compared: bool = True
    request: bool = True
    #: ``{other option: (the value it must keep, why)}`` while this option asks for a change
    requires: Mapping[str, Tuple[Any, str]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind == "boolean":
            object.__setattr__(self, "choices", (False, True))

    @property
    def valid(self) -> str:
        """The valid values, as an error message states them."""
        if self.kind == "boolean":
            return "valid choices: " + ", ".join(_TRUE + _FALSE)
        if self.kind == "seconds":
            return f"valid values: a finite number of seconds > 0 (default {self.default:g})"
        if self.kind == "names":
            return "valid values: comma-separated patch names as listed by megapatch.status()"
        return "valid choices: " + ", ".join(map(str, self.choices))

    def _invalid(self, origin: str, value: Any, why: str = "is not valid") -> OptionError:
        return OptionError(f"{origin}={shown(value)} {why} for megapatch option {self.name!r}; {self.valid}")

    def parse(self, value: Any, origin: str) -> Any:
        """Normalise ``value`` (from ``origin``: an argument or a variable name) to a choice."""
        if isinstance(value, str) and not value.strip() and not (self.kind == "names" and origin == self.name):
            raise self._invalid(origin, value, "is empty (unset the variable to get the default)")
        if self.kind == "boolean":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise self._invalid(origin, value)
        if self.kind == "seconds":
            try:
                seconds = float(value.strip() if isinstance(value, str) else value)
            except (TypeError, ValueError):
                raise self._invalid(origin, value) from None
            if isinstance(value, bool) or not math.isfinite(seconds) or seconds <= 0:
                raise self._invalid(origin, value)
            return seconds
        if self.kind == "names":
            items = value.split(",") if isinstance(value, str) else list(value)
            names = []
            for item in items:
                if not isinstance(item, str):
                    raise self._invalid(origin, value)
                item = item.strip()
                if not item:
                    if isinstance(value, str) and value.strip():
                        raise self._invalid(origin, value, "has an empty entry")
                    continue
                if any(c.isspace() for c in item):
                    raise self._invalid(origin, value)
                names.append(item)
            return tuple(sorted(set(names)))
        # torch dtypes are accepted without importing torch: str(torch.float32) == "torch.float32".
        text = str(value).strip().lower()
        if text.startswith("torch."):
            text = text[len("torch."):]
        text = self.aliases.get(text, text)
        if text in self.refused:
            raise OptionError(f"{origin}={shown(value)} is refused for megapatch option "
                              f"{self.name!r}: {self.refused[text]}")
        if text not in self.choices:
            raise self._invalid(origin, value)
        return text

    def text(self, value: Any) -> str:
        """``value`` as the cross-rank fingerprint and the activation line write it."""
        if self.kind == "names":
            return ",".join(value) or "none"
        if self.kind == "seconds":
            return f"{value:g}"
        return str(value)


OPTIONS: tuple = (
    Option(
        name="tp_reduce_dtype",
        env="MEGAPATCH_TP_REDUCE_DTYPE",
        choices=("native", "fp32", "fp32-accumulate"),
        default="native",
        help="dtype in which tensor-parallel reductions sum",
        aliases={"float32": "fp32", "fp32_accumulate": "fp32-accumulate"},
    ),
    Option(
        name="logits_dtype",
        env="MEGAPATCH_LOGITS_DTYPE",
        choices=("native", "fp32"),
        default="native",
        help="dtype of the LM-head logits (the GEMM accumulator is kept in FP32)",
        aliases={"float32": "fp32", "bf16": "native", "bfloat16": "native"},
        refused={
            "fp16": "FP16 logits lose range; upstream refuses --output-logit-dtype fp16 too",
            "float16": "FP16 logits lose range; upstream refuses --output-logit-dtype fp16 too",
            "half": "FP16 logits lose range; upstream refuses --output-logit-dtype fp16 too",
        },
    ),
    Option(
        name="align_fp8_transposes",
        env="MEGAPATCH_ALIGN_FP8_TRANSPOSES",
        default=False,
        help="run FP8 weight transposes at the interleaved schedule's param-sync slot",
        kind="boolean",
    ),
    Option(
        name="tp_invariant",
        env="MEGAPATCH_TP_INVARIANT",
        default=False,
        help="bitwise TP invariance: every TP-split sum as W fixed blocks in one FP32 tree",
        kind="boolean",
        # the two modes wrap the same layers
        requires={"tp_reduce_dtype": ("native", "tp_invariant already sums every TP-split reduction "
                                                "in FP32 through its fixed tree and rounds once")},
    ),
    Option(
        name="tp_invariant_width",
        env="MEGAPATCH_TP_INVARIANT_WIDTH",
        choices=(1, 2, 4, 8, 16, 32, 64, 128),
        default=8,
        help="the invariance width W: results agree at every TP size dividing it",
        aliases={str(2 ** i): 2 ** i for i in range(8)},
        request=False,
    ),
    Option(
        name="skip_patches",
        env=SKIP_PATCHES_ENV,
        default=(),
        help="patches left out on purpose (comma-separated names as in megapatch.status())",
        kind="names",
        request=False,
    ),
    Option(
        name="strict",
        env="MEGAPATCH_STRICT",
        default=True,
        help="raise (instead of warn and skip) when a requested patch cannot apply",
        kind="boolean",
        compared=False,
        request=False,
    ),
    Option(
        name="check_timeout",
        env=TIMEOUT_ENV,
        default=300.0,
        help="seconds a rank waits for its tensor-parallel peers' settings (cross-rank check)",
        kind="seconds",
        compared=False,
        request=False,
    ),
)

OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}

#: The kill switch: not an option of ``enable()``, parsed with the same boolean rules.
KILL_SWITCH = Option(name="disable", env=DISABLE_ENV, default=False,
                     help="switch megapatch off whatever else is set", kind="boolean",
                     compared=False, request=False)


class _SettingsBehaviour:
    """What every ``Settings`` can say about itself; its fields come from ``OPTIONS``."""

    def requested(self) -> dict:
        """The options that ask for a change from upstream behaviour."""
        return {o.name: getattr(self, o.name) for o in OPTIONS
                if o.request and getattr(self, o.name) != o.default}

    def fingerprint(self) -> str:
        """Stable text that must agree across the ranks of a tensor-parallel group."""
        return ";".join(f"{o.name}={o.text(getattr(self, o.name))}" for o in OPTIONS if o.compared)


#: One resolved configuration (a frozen dataclass, one field per option, defaults from the table).
#: Wrappers read the current one at call time (``megapatch.core.state``).
Settings = dataclasses.make_dataclass(
    "Settings", [(o.name, type(o.default), dataclasses.field(default=o.default)) for o in OPTIONS],
    bases=(_SettingsBehaviour,), frozen=True)
Settings.__module__ = __name__  # (make_dataclass takes ``module=`` only from Python 3.12 on)

NATIVE = Settings()


def disabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """The kill switch, validated: an unknown spelling (``y``, ``2``, ``""``) raises OptionError."""
    environ = os.environ if environ is None else environ
    if DISABLE_ENV not in environ:
        return False
    return KILL_SWITCH.parse(environ[DISABLE_ENV], DISABLE_ENV)


def env_requests(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment asks megapatch to do anything at all: a variable of an option that
    can request a change (set to any value, ``native`` included: an explicitly native rank is
    enabled, so that it tells its peers). Tuning variables alone (``MEGAPATCH_STRICT``,
    ``MEGAPATCH_CHECK_TIMEOUT``, ...) activate nothing."""
    environ = os.environ if environ is None else environ
    return any(o.env in environ for o in OPTIONS if o.request)


def known_env_variables() -> Tuple[str, ...]:
    """Every ``MEGAPATCH_*`` variable megapatch reads."""
    names = {o.env for o in OPTIONS} | {DISABLE_ENV}
    names |= {v for k, v in globals().items() if k.endswith("_ENV") and isinstance(v, str)}
    return tuple(sorted(names))


def unknown_env_variables(environ: Optional[Mapping[str, str]] = None,
                          known: Optional[Tuple[str, ...]] = None) -> List[Tuple[str, Optional[str]]]:
    """``(name, closest known name or None)`` for each ``MEGAPATCH_*`` variable megapatch does not
    read (a misspelling such as ``MEGAPATCH_TP_REDUCE_DTPYE`` would otherwise be ignored).
    ``known`` adds names other megapatch components read (e.g. the launcher's)."""
    environ = os.environ if environ is None else environ
    valid = sorted(set(known_env_variables()) | set(known or ()))
    found = []
    strip = len(ENV_PREFIX)  # compare what follows the shared prefix
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX) and name not in valid:
            close = difflib.get_close_matches(name[strip:], [v[strip:] for v in valid], n=1, cutoff=0.6)
            found.append((name, ENV_PREFIX + close[0] if close else None))
    return found


def set_by(values: Mapping[str, str], who: Mapping[str, str],
           environ: Optional[Mapping[str, str]] = None) -> str:
    """The ``MEGAPATCH_SET_BY`` text recording that ``who[var]`` (``megapatch-run --tp-invariant``)
    set each ``values[var]``; entries for other variables already in ``environ`` are kept."""
    entries = {var: f"{values[var]}|{who[var]}" for var in values}
    for var, (value, by) in _set_by(environ or {}).items():
        entries.setdefault(var, f"{value}|{by}")
    return ";".join(f"{var}={entry}" for var, entry in sorted(entries.items()))


def _set_by(environ: Mapping[str, str]) -> dict:
    """``{var: (value, who)}`` from ``MEGAPATCH_SET_BY``; malformed entries are ignored (the
    variable only improves messages, it never changes a value)."""
    found = {}
    for entry in environ.get(SET_BY_ENV, "").split(";"):
        var, _, rest = entry.partition("=")
        value, bar, who = rest.partition("|")
        if var.startswith(ENV_PREFIX) and bar and who.strip():
            found[var] = (value, who.strip())
    return found


def origin(name: str, value: Any, source: str) -> str:
    """``enable(tp_invariant=True)`` / ``MEGAPATCH_TP_INVARIANT=1`` / ``megapatch-run
    --tp-invariant`` / ``the default tp_invariant=False``, and how to undo it: what a refusal says
    about an option's value."""
    option = OPTIONS_BY_NAME[name]
    if source == "enable()":
        return f"enable({name}={value!r}); pass another {name} to enable() to change it"
    if source.startswith("env "):
        text = ("1" if value else "0") if option.kind == "boolean" else option.text(value)
        _, _, who = source.partition(" set by ")
        if who:
            return f"{who}, which sets {option.env}={text}; remove it there to change it"
        return f"{option.env}={text} in the environment; unset {option.env} to change it"
    return f"the default {name}={value!r}"


def _check_requirements(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """An option asking for a change may require others to keep a value (``Option.requires``)."""
    for option in OPTIONS:
        if values[option.name] == option.default:
            continue
        for other, (needed, why) in option.requires.items():
            if values[other] != needed:
                raise OptionError(
                    f"megapatch {option.name}={values[option.name]!r} (from "
                    f"{origin(option.name, values[option.name], sources[option.name])}) cannot be combined "
                    f"with {other}={values[other]!r} (from {origin(other, values[other], sources[other])}): "
                    f"{why}. Valid with {option.name}: {other}={needed!r}.")


def resolve(arguments: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None):
    """Return ``(Settings, sources)``; ``sources[name]`` says where each value came from.

    Every value in use is validated, the kill switch's spelling included (so that ``megapatch
    doctor`` and activation refuse the same values)."""
    environ = os.environ if environ is None else environ
    values, sources = {}, {}
    recorded = _set_by(environ)
    for option in OPTIONS:
        explicit = arguments.get(option.name)
        if explicit is not None:
            values[option.name] = option.parse(explicit, option.name)
            sources[option.name] = "enable()"
        elif option.env in environ:
            values[option.name] = option.parse(environ[option.env], option.env)
            sources[option.name] = f"env {option.env}"
            value, who = recorded.get(option.env, (None, None))
            if who and value == environ[option.env]:
                sources[option.name] += f" set by {who}"
        else:
            values[option.name] = option.default
            sources[option.name] = "default"
    disabled(environ)
    _check_requirements(values, sources)
    return Settings(**values), sources
