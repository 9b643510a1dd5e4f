"""NeMo-Run plugin: megapatch's options as ``MEGAPATCH_*`` variables of a task's executor.

    import nemo_run as run
    from megapatch.integrations.nemo_run import MegapatchPlugin

    run.run(recipe, executor=executor, plugins=[MegapatchPlugin(tp_reduce_dtype="fp32")])

Every megapatch option is a field (``None``: leave the variable alone). Values are validated when
the plugin is built, with the same rules as the variables; ``setup`` adds the variables to
``executor.env_vars`` (every rank of every node the executor launches gets them, and the startup
hook activates megapatch when the task imports megatron). The executor's environment must have
megapatch installed; where ``.pth`` files are not processed, launch through ``megapatch-run``.

Install with the ``nemo-run`` extra (``pip install 'megapatch[nemo-run]'``): it pins the leptonai
that ``import nemo_run`` needs (docs/stack.md section 6). Building the plugin under a nemo-run
outside :data:`TESTED_NEMO_RUN` logs one warning naming both.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, Optional

import nemo_run as run

from megapatch.core import options as _options
from megapatch.core import upstream_versions as _versions

log = logging.getLogger("megapatch")

#: the nemo-run versions the plugin was run against (tests/test_integrations_nemo_run.py, with
#: leptonai 0.27.3: the ``nemo-run`` extra); see docs/stack.md section 6
TESTED_NEMO_RUN = ">=0.10.0,<=0.11.1"

_warned: set = set()


def warn_if_untested(version: Optional[str]) -> bool:
    """One warning per process and version when ``version`` of nemo-run is outside
    :data:`TESTED_NEMO_RUN` (None: unknown, nothing said). The plugin only sets ``env_vars`` on
    the executor, so it is not refused: the warning says what was not tried. True when it warned."""
    if version is None or _versions.in_range(version, TESTED_NEMO_RUN) or version in _warned:
        return False
    _warned.add(version)
    log.warning("megapatch: nemo-run %s is outside the versions MegapatchPlugin was tested with "
                "(%s); it sets the MEGAPATCH_* variables on executor.env_vars, check the job log "
                "for the 'megapatch enabled' line", version, TESTED_NEMO_RUN)
    return True


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
    warn_if_untested(_versions.version_of("nemo-run"))


def _options_of(self) -> Dict[str, Any]:
    return {o.name: getattr(self, o.name) for o in _options.OPTIONS}


def _setup(self, task, executor) -> None:
    values = environment(self.options())
    executor.env_vars.update(values)
    # messages on the ranks name the plugin field the user wrote, not only the variable
    given = self.options()
    who = {o.env: f"NeMo-Run MegapatchPlugin({o.name}={given[o.name]!r})" for o in _options.OPTIONS
           if o.env in values}
    executor.env_vars[_options.SET_BY_ENV] = _options.set_by(values, who, executor.env_vars)


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
