"""The options megapatch understands, as data: name, environment variable, choices, aliases.

Resolution order for each option: explicit argument to ``enable()``, then the environment, then
the default. Parsing never imports torch, so the startup hook can validate the environment in
processes that will never touch torch (pip, linters, other tools).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

from .errors import OptionError

ENV_PREFIX = "MEGAPATCH_"
DISABLE_ENV = "MEGAPATCH_DISABLE"

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no", "")


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    env: str
    choices: tuple
    default: Any
    help: str
    aliases: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
    boolean: bool = False

    def parse(self, value: Any, origin: str) -> Any:
        """Normalise ``value`` (from ``origin``: an argument or a variable name) to a choice."""
        if self.boolean:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise OptionError(
                f"{origin}={value!r} is not valid for megapatch option {self.name!r}; "
                f"valid choices: {', '.join(_TRUE + _FALSE[:-1])}"
            )
        # torch dtypes are accepted without importing torch: str(torch.float32) == "torch.float32".
        text = str(value).strip().lower()
        if text.startswith("torch."):
            text = text[len("torch."):]
        text = self.aliases.get(text, text)
        if text in self.refused:
            raise OptionError(f"{origin}={value!r} is refused for megapatch option "
                              f"{self.name!r}: {self.refused[text]}")
        if text not in self.choices:
            raise OptionError(
                f"{origin}={value!r} is not valid for megapatch option {self.name!r}; "
                f"valid choices: {', '.join(map(str, self.choices))}"
            )
        return text


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
        choices=(False, True),
        default=False,
        help="run FP8 weight transposes at the interleaved schedule's param-sync slot",
        boolean=True,
    ),
    Option(
        name="strict",
        env="MEGAPATCH_STRICT",
        choices=(False, True),
        default=True,
        help="raise (instead of warn and skip) when a requested patch cannot apply",
        boolean=True,
    ),
)

OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class Settings:
    """One resolved configuration. Wrappers read the current one at call time."""

    tp_reduce_dtype: str = "native"
    logits_dtype: str = "native"
    align_fp8_transposes: bool = False
    strict: bool = True

    def requested(self) -> dict:
        """The options that ask for a change from upstream behaviour."""
        return {o.name: getattr(self, o.name) for o in OPTIONS
                if o.name != "strict" and getattr(self, o.name) != o.default}

    def fingerprint(self) -> str:
        """Stable text that must agree across the ranks of a tensor-parallel group."""
        return ";".join(f"{o.name}={getattr(self, o.name)}" for o in OPTIONS if o.name != "strict")


NATIVE = Settings()


def env_disabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(DISABLE_ENV, "").strip().lower() in _TRUE


def env_requests(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment asks megapatch to do anything at all."""
    environ = os.environ if environ is None else environ
    return any(o.env in environ for o in OPTIONS if o.name != "strict")


def resolve(arguments: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None):
    """Return ``(Settings, sources)``; ``sources[name]`` says where each value came from."""
    environ = os.environ if environ is None else environ
    values, sources = {}, {}
    for option in OPTIONS:
        explicit = arguments.get(option.name)
        if explicit is not None:
            values[option.name] = option.parse(explicit, option.name)
            sources[option.name] = "enable()"
        elif option.env in environ:
            values[option.name] = option.parse(environ[option.env], option.env)
            sources[option.name] = f"env {option.env}"
        else:
            values[option.name] = option.default
            sources[option.name] = "default"
    return Settings(**values), sources
