"""Activation from ``MEGAPATCH_*`` variables in processes that never import megapatch themselves.

Two entry points run ``activate_from_environment()`` at interpreter start: the wheel's
``megapatch-startup.pth`` (site-packages installs) and ``megapatch/bootstrap/sitecustomize.py``
(put on ``PYTHONPATH`` by ``megapatch-run``, for ``pip install --target`` dirs, zipapps and other
places where ``.pth`` files are not read). Both only do it when a ``MEGAPATCH_*`` variable is set.

At start nothing but a tiny finder is installed (stdlib only: every Python process in a job pays
for this, most of them never touch megatron). The first time ``megatron`` or ``transformer_engine``
is looked up, the finder removes itself, reads the options and registers post-import hooks; when
``megatron.core`` or ``transformer_engine.pytorch`` has finished importing, megapatch is enabled
from the environment -- unless the script already called ``enable()``, whose explicit arguments
win. A bad value, or a request megapatch cannot serve (wrapt missing), stops the process that
imports megatron, naming the variable; every other process stays quiet.
"""


import os
import sys

ENV_PREFIX = "MEGAPATCH_"
TRIGGERS = ("megatron", "transformer_engine")  # top-level packages: looked up before their modules
HOOKED_MODULES = ("megatron.core", "transformer_engine.pytorch")


class _Trigger:
    """``sys.meta_path`` entry that arms megapatch when a trigger package is first looked up.

    It never finds anything itself. It runs before ``megatron`` is found, so the post-import hooks
    it registers (which put wrapt's finder on ``sys.meta_path``) see ``megatron.core`` load.
    """

    megapatch_trigger = True  # one per process, whichever copy of this module installed it

    def find_spec(self, fullname, path=None, target=None):
        if fullname in TRIGGERS and _disarm(self):
            arm()
        return None


#: ``MEGAPATCH_*`` variables that ask for nothing: how the job was launched (``options.LAUNCH_ENV``,
#: set by the CPU launcher for the doctor)
RECORDS_ONLY = ("MEGAPATCH_LAUNCH",)


def activate_from_environment() -> None:
    """Install the trigger once per process when a ``MEGAPATCH_*`` variable is set."""
    if not any(name.startswith(ENV_PREFIX) and name not in RECORDS_ONLY for name in os.environ):
        return
    if any(getattr(finder, "megapatch_trigger", False) for finder in sys.meta_path) or _armed:
        return
    if any(name in sys.modules for name in TRIGGERS):  # imported before the hook ran (rare)
        try:
            arm()
        except Exception as exc:  # noqa: BLE001 -- re-raised as what site.py does not swallow
            # Running inside a .pth file here: site.py prints an Exception as "Error processing
            # line ..." and carries on, megapatch silently off. A bad value must stop the process.
            raise SystemExit(f"megapatch: {type(exc).__name__}: {exc}") from None
        return
    sys.meta_path.insert(0, _Trigger())


_armed = False


def _disarm(trigger) -> bool:
    try:
        sys.meta_path.remove(trigger)
    except ValueError:  # another thread got there first
        return False
    return True


def _requested_variables() -> str:
    return ", ".join(f"{k}={v[:40]!r}" for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIX))


def arm() -> None:
    """Read the options (cheap) and register the activation hooks (imports the engine and wrapt)."""
    global _armed
    if _armed:
        return
    from megapatch.core import options, report

    report.warn_unknown_env_variables()  # logged once per name; enable() calls it too
    if options.disabled() and options.env_requests():  # disabled() validates the spelling
        _armed = True
        try:
            from megapatch.core import engine
        except ImportError:  # wrapt missing: the kill switch still works, peers time out instead
            return
        engine.announce_kill_switch()  # nothing changes upstream; peers learn megapatch is off here
        return
    if not options.env_requests():
        _armed = True
        return
    try:
        import wrapt

        from megapatch.core import engine  # noqa: F401 -- fails here, not inside the hook, if broken
    except ImportError as exc:
        from megapatch.core.errors import MegapatchError

        sys.meta_path.insert(0, _Trigger())  # a retried import is refused again
        hint = (" (megapatch requires wrapt>=2.0: pip install 'wrapt>=2.0')"
                if getattr(exc, "name", None) == "wrapt" else "")
        raise MegapatchError(
            f"megapatch cannot activate: {exc}{hint}. The environment asks for it "
            f"({_requested_variables()}): unset those variables, or set MEGAPATCH_DISABLE=1 to "
            f"run upstream behaviour knowingly.") from exc
    _armed = True
    for name in HOOKED_MODULES:
        wrapt.register_post_import_hook(_activate, name)


#: set by a process that activated from the environment, to its pid; not a ``MEGAPATCH_*`` name
#: (those are options), inherited by the processes it starts
ACTIVATED_ENV = "_MEGAPATCH_ACTIVATED_PID"


def _parent_activated() -> bool:
    """Whether this process was started by one that activated from the environment: a worker of a
    rank (the torch_dist checkpoint writer's spawned ``Manager``, a spawned data-loader worker),
    which imports ``__main__`` and so megatron again. It is patched like its rank but stays quiet:
    its rank already logged the activation line of the job."""
    return os.environ.get(ACTIVATED_ENV) == str(os.getppid())


def _inside_another_import(module) -> bool:
    """Whether ``module`` finished importing inside another hooked module's import: megatron-core's
    ``utils`` imports Transformer Engine half-way through ``megatron.core``, whose modules
    (``parallel_state``, ...) are then half-initialised; activating there would check and wrap
    them before their functions exist. That outer import's own hook activates when it is done."""
    for name in HOOKED_MODULES:
        outer = sys.modules.get(name)
        if outer is not None and outer is not module and getattr(getattr(outer, "__spec__", None), "_initializing", False):
            return True
    return False


def _activate(_module) -> None:
    import contextlib

    from megapatch.core import engine, report
    from megapatch.core.errors import OptionError

    if engine.is_enabled():  # an explicit enable() in the script wins over the environment
        return
    if _inside_another_import(_module):
        return
    try:
        with report.muted() if _parent_activated() else contextlib.nullcontext():
            engine.enable()
    except OptionError as exc:
        raise type(exc)(f"megapatch (activated from the environment): {exc}") from None
    os.environ[ACTIVATED_ENV] = str(os.getpid())
