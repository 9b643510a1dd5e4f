"""``megapatch-run``: run a command with megapatch active in every Python process it starts.

    megapatch-run --tp-reduce-dtype fp32 torchrun --nproc-per-node 8 pretrain_gpt.py ...
    srun megapatch-run --logits-dtype fp32 python pretrain_gpt.py ...
    python -m megapatch.commands.launcher --tp-reduce-dtype fp32 -- python train.py

Like ``ddtrace-run`` or ``opentelemetry-instrument``: the flags (generated from
``megapatch.core.options.OPTIONS``, one per option) become ``MEGAPATCH_*`` variables, the directory of
megapatch's ``sitecustomize.py`` goes first on ``PYTHONPATH`` (so activation works where ``.pth``
files are not read: ``pip install --target``, zipapps), and the command replaces this process
(``exec``: same PID, signals and exit code). Variables already set are kept unless a flag sets
them. Activation itself happens when a process imports megatron (``megapatch.core.startup``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Sequence

from megapatch.core import options as _options
from megapatch.core.errors import OptionError

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher_site")


def _flag(option) -> str:
    return "--" + option.name.replace("_", "-")


def _is_boolean(option) -> bool:
    return option.kind == "boolean"


def _metavar(option) -> str:
    if option.choices and not _is_boolean(option):
        return "{" + ",".join(map(str, option.choices)) + "}"
    return getattr(option, "kind", "VALUE").upper()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megapatch-run",
        usage="megapatch-run [options] [--] command [args ...]",
        description="Run COMMAND with megapatch active in each of its Python processes that "
                    "imports megatron. Each option sets its MEGAPATCH_* variable (see `megapatch "
                    "doctor`); variables already in the environment are kept unless a flag "
                    "overrides them.")
    for option in _options.OPTIONS:
        help_text = f"{option.help} (sets {option.env})"
        if _is_boolean(option):
            p.add_argument(_flag(option), dest=option.name, action=argparse.BooleanOptionalAction,
                           default=None, help=help_text)
        else:
            p.add_argument(_flag(option), dest=option.name, default=None, metavar=_metavar(option),
                           help=help_text)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, with its arguments")
    return p


def environment(args: argparse.Namespace, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The command's environment: ``base`` plus the flags' variables and the bootstrap path.
    Raises OptionError (naming the flag) for an invalid value."""
    env = dict(os.environ if base is None else base)
    values, who = {}, {}
    for option in _options.OPTIONS:
        value = getattr(args, option.name)
        if value is None:
            continue
        option.parse(value, _flag(option))  # the child parses the variable the same way
        if isinstance(value, bool):
            values[option.env] = "1" if value else "0"
            who[option.env] = f"megapatch-run {_flag(option) if value else '--no-' + _flag(option)[2:]}"
        else:
            values[option.env] = value
            who[option.env] = f"megapatch-run {_flag(option)} {value}"
    env.update(values)
    if values:  # messages name the flag, not only the variable it set
        env[_options.SET_BY_ENV] = _options.set_by(values, who, env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + paths)
    return env


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    command: List[str] = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        p.error("no command given (e.g. megapatch-run --tp-reduce-dtype fp32 torchrun ... train.py)")
    try:
        env = environment(args)
    except OptionError as exc:
        p.error(str(exc))
    try:
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        print(f"megapatch-run: command not found: {command[0]}", file=sys.stderr)
        return 127
    except OSError as exc:  # not executable, no shebang (ENOEXEC), a directory, ...: as a shell says
        print(f"megapatch-run: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 126
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
