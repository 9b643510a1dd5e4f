"""NeMo-Run plugin: megapatch's options as ``MEGAPATCH_*`` variables of a task's executor.

    import nemo_run as run
    from megapatch.integrations.nemo_run import MegapatchPlugin

    run.run(recipe, executor=executor, plugins=[MegapatchPlugin(tp_reduce_dtype="fp32")])

Every megapatch option is a field (``None``: leave the variable alone). Values are validated when
the plugin is built, with the same rules as the variables; ``setup`` adds the variables to
``executor.env_vars`` (every rank of every node the executor launches gets them, and the startup
hook activates megapatch when the task imports megatron). The executor's environment must have
megapatch installed; where ``.pth`` files are not processed, launch through ``megapatch-run``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import nemo_run as run

from megapatch.core import options as _options


def environment(values: Dict[str, Any]) -> Dict[str, str]:
    """``{MEGAPATCH_*: text}`` for the options in ``values`` that are not None; OptionError
    (naming the field, the value and the valid choices) for an invalid one."""
    env = {}
    for option in _options.OPTIONS:
        value = values.get(option.name)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        parsed = option.parse(value, f"MegapatchPlugin.{option.name}")
        if isinstance(parsed, bool):
            env[option.env] = "1" if parsed else "0"
        elif isinstance(parsed, tuple):
            env[option.env] = ",".join(parsed)
        elif isinstance(parsed, float):
            env[option.env] = f"{parsed:g}"
        else:
            env[option.env] = str(parsed)
    return env


def _post_init(self) -> None:
    environment(self.options())  # fail at configuration time, not on the cluster


def _options_of(self) -> Dict[str, Any]:
    return {o.name: getattr(self, o.name) for o in _options.OPTIONS}


def _setup(self, task, executor) -> None:
    executor.env_vars.update(environment(self.options()))


MegapatchPlugin = dataclasses.make_dataclass(
    "MegapatchPlugin",
    [(o.name, Optional[Any], dataclasses.field(default=None)) for o in _options.OPTIONS],
    bases=(run.Plugin,),
    namespace={"__post_init__": _post_init, "options": _options_of, "setup": _setup,
               "__module__": __name__,
               "__doc__": "megapatch options (fields named as in enable()) set as MEGAPATCH_* "
                          "variables on the executor of each task."},
    kw_only=True,
)
