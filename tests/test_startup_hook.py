"""The startup hook (megapatch-startup.pth -> megapatch.core.startup): nothing heavy until megatron is
imported, then activation from the environment, once; errors only in the process importing megatron.

Each test runs a fresh interpreter of this environment, where pip installed megapatch (and so its
.pth): ``tests/test_activation.py`` checks that the hook is installed.
"""

import ast
import os
import textwrap

import pytest

from conftest import REPO, environ_without_megapatch, run_python

FP32 = {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}
# what the hook itself may add to a process that never imports megatron
HOOK_MODULES = {"megapatch", "megapatch._checkout", "megapatch.core", "megapatch.core.startup"}
STATUS = """
import megapatch
s = megapatch.status()
print("ENABLED", s.enabled, "ACTIVE", ",".join(s.active), "SOURCE", s.sources["tp_reduce_dtype"])
"""


def _modules(env):
    result = run_python("import sys; print(sorted(sys.modules)); "
                        "print(sum(getattr(f, 'megapatch_trigger', False) for f in sys.meta_path))",
                        env=env)
    assert result.returncode == 0 and not result.stderr, result.stderr
    modules, triggers = result.stdout.splitlines()
    return set(ast.literal_eval(modules)), int(triggers)


def test_a_variable_alone_imports_nothing_heavy():
    plain, no_trigger = _modules({})
    hooked, triggers = _modules(FP32)
    assert no_trigger == 0 and triggers == 1  # the hook ran, and installed one finder
    assert hooked - plain <= HOOK_MODULES, sorted(hooked - plain - HOOK_MODULES)
    for heavy in ("wrapt", "megapatch.core.engine", "megapatch.core.options", "importlib.metadata", "asyncio",
                  "torch", "logging"):
        assert heavy not in hooked


def test_activates_after_megatron_core_is_imported():
    result = run_python(textwrap.dedent("""
        import sys
        assert "megapatch.core.engine" not in sys.modules
        import megatron.core
        assert "megapatch.core.engine" in sys.modules
    """) + STATUS, env=FP32)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ENABLED True" in result.stdout
    assert "tp_reduce.megatron_core" in result.stdout
    assert "SOURCE env MEGAPATCH_TP_REDUCE_DTYPE" in result.stdout


def test_explicit_enable_wins_over_an_invalid_environment_value():
    """issue 11 defect 6: the argument replaced the variable, so its bad value must not matter."""
    env = {"MEGAPATCH_TP_REDUCE_DTYPE": "bogus"}
    result = run_python(textwrap.dedent("""
        import megapatch
        megapatch.enable(tp_reduce_dtype="fp32")
        import megatron.core
    """) + STATUS, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ENABLED True" in result.stdout and "tp_reduce.megatron_core" in result.stdout
    assert "SOURCE enable()" in result.stdout
    # without the argument the same variable stops the import, naming it
    stopped = run_python("import megatron.core", env=env)
    assert stopped.returncode != 0
    assert "MEGAPATCH_TP_REDUCE_DTYPE='bogus' is not valid" in stopped.stderr


def _without_wrapt(tmp_path):
    """A directory that shadows wrapt with a module failing as a missing wrapt does."""
    (tmp_path / "wrapt.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'wrapt'\", name='wrapt')\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def test_missing_wrapt_stops_only_the_megatron_process(tmp_path):
    """issue 11 defect 9: requested but impossible must not train unpatched with exit code 0."""
    env = {**_without_wrapt(tmp_path), **FP32}
    quiet = run_python("import json; print('fine')", env=env)
    assert quiet.returncode == 0 and quiet.stdout.strip() == "fine" and not quiet.stderr
    stopped = run_python("import megatron.core; print('trained unpatched')", env=env)
    assert stopped.returncode != 0
    assert "trained unpatched" not in stopped.stdout
    assert "No module named 'wrapt'" in stopped.stderr
    assert "MEGAPATCH_TP_REDUCE_DTYPE='fp32'" in stopped.stderr
    assert "pip install 'wrapt>=2.0'" in stopped.stderr
    # a retried import is refused again, never half-activated
    retried = run_python("""
        try:
            import megatron.core
        except Exception:
            pass
        import megatron.core
        print('trained unpatched')
    """, env=env)
    assert retried.returncode != 0 and "trained unpatched" not in retried.stdout


def test_missing_wrapt_without_a_request_stays_quiet(tmp_path):
    env = {**_without_wrapt(tmp_path), "MEGAPATCH_STRICT": "0"}  # a setting, no change requested
    result = run_python("import megatron.core; print('ran')", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ran"


def test_misspelled_variable_warns_when_megatron_is_imported_not_at_start():
    env = {"MEGAPATCH_TP_REDUCE_DTPYE": "fp32"}
    quiet = run_python("pass", env={**env, "PYTHONWARNINGS": "default"})
    assert quiet.returncode == 0 and not quiet.stderr
    warned = run_python("import megatron.core", env={**env, "PYTHONWARNINGS": "default"})
    assert warned.returncode == 0, warned.stderr[-3000:]
    assert "MEGAPATCH_TP_REDUCE_DTPYE" in warned.stderr
    assert "did you mean MEGAPATCH_TP_REDUCE_DTYPE" in warned.stderr


def test_startup_pth_calls_the_bootstrap():
    with open(os.path.join(REPO, "megapatch-startup.pth")) as f:
        line = f.read().strip()
    assert line.startswith("import ") and "\n" not in line  # site runs one import line
    assert "megapatch.core.startup" in line and "activate_from_environment" in line


def _startup_site_dir():
    import site

    for folder in site.getsitepackages():
        if os.path.exists(os.path.join(folder, "megapatch-startup.pth")):
            return folder
    return None


def test_megatron_imported_before_the_hook_runs_still_activates():
    """issue 28 survivor: the branch for a process where megatron was imported before the startup
    hook ran (a ``.pth`` sorted before ``megapatch-startup.pth`` that imports it, a
    sitecustomize...). docs/stack.md: the variables take effect when the process imports megatron,
    and ``enable()`` works before or after ``import megatron.core``; so here too megapatch must be
    enabled from the environment, not silently left off. A real interpreter started with ``-S``
    imports megatron.core from site-packages without running any ``.pth``, then runs
    site-packages' ``.pth`` files (megapatch's hook among them) as interpreter start does."""
    import subprocess
    import sys

    folder = _startup_site_dir()
    if folder is None:
        pytest.skip("megapatch-startup.pth is not installed in this environment's site-packages")
    code = textwrap.dedent(f"""
        import sys
        sys.path.append({folder!r})  # site-packages on the path, no .pth file run yet
        import megatron.core
        assert "megapatch" not in sys.modules
        import site
        site.addsitedir({folder!r})  # now its .pth files run, megapatch-startup.pth among them
        assert "megapatch.core.startup" in sys.modules
    """) + STATUS
    env = environ_without_megapatch()
    env.update(FP32, PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True,
                            timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ENABLED True" in result.stdout, (result.stdout, result.stderr[-3000:])
    assert "tp_reduce.megatron_core" in result.stdout
    assert "SOURCE env MEGAPATCH_TP_REDUCE_DTYPE" in result.stdout


def test_a_bad_value_stops_a_process_that_imported_megatron_before_the_hook():
    """The same early-import branch with an invalid value: inside a ``.pth`` file site.py swallows
    an ordinary exception ("Error processing line ...") and the process would run on unpatched;
    it must stop instead, naming the variable and its value."""
    import subprocess
    import sys

    folder = _startup_site_dir()
    if folder is None:
        pytest.skip("megapatch-startup.pth is not installed in this environment's site-packages")
    code = textwrap.dedent(f"""
        import sys
        sys.path.append({folder!r})
        import megatron.core
        import site
        site.addsitedir({folder!r})
        print("RAN ON")
    """)
    env = environ_without_megapatch()
    env.update(MEGAPATCH_TP_REDUCE_DTYPE="bogus", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True,
                            timeout=180, cwd=REPO)
    assert result.returncode != 0 and "RAN ON" not in result.stdout, (result.stdout, result.stderr[-3000:])
    assert "MEGAPATCH_TP_REDUCE_DTYPE" in result.stderr and "bogus" in result.stderr, result.stderr[-3000:]



def test_a_trigger_another_thread_already_removed_arms_nothing_and_raises_nothing(monkeypatch):
    """fresh-sample survivor (startup.py: ``_disarm``'s ``except ValueError`` replaced): two threads
    that look up ``megatron`` at once both reach the one trigger; the first removes it and arms,
    the second finds it gone and must neither raise (its import would fail) nor arm again. Made
    deterministic here: the second lookup runs after the first, in this process."""
    import sys

    from megapatch.core import startup

    armed = []
    monkeypatch.setattr(startup, "arm", lambda: armed.append(True))
    trigger = startup._Trigger()
    monkeypatch.setattr(sys, "meta_path", [trigger, *sys.meta_path])
    assert trigger.find_spec("megatron") is None and armed == [True] and trigger not in sys.meta_path
    assert trigger.find_spec("megatron") is None and armed == [True]  # the other thread's lookup
    assert trigger.find_spec("transformer_engine") is None and armed == [True]


def test_activation_waits_for_an_outer_import_that_is_half_way(monkeypatch):
    """With Transformer Engine installed, megatron-core's ``utils`` imports TE half-way through
    ``import megatron.core``: TE's hook fired while ``megatron.core.parallel_state`` had no
    ``initialize_model_parallel`` yet, and activation from the environment failed the import
    (UpstreamSurfaceError) for every TE user. It now waits for megatron.core's own hook."""
    import importlib.machinery
    import sys
    import types

    from megapatch.core import engine, startup

    calls = []
    monkeypatch.setattr(engine, "is_enabled", lambda: False)
    monkeypatch.setattr(engine, "enable", lambda: calls.append("enable"))
    outer = types.ModuleType("megatron.core")
    outer.__spec__ = importlib.machinery.ModuleSpec("megatron.core", None)
    outer.__spec__._initializing = True
    inner = types.ModuleType("transformer_engine.pytorch")
    inner.__spec__ = importlib.machinery.ModuleSpec("transformer_engine.pytorch", None)
    inner.__spec__._initializing = True  # as at its own post-import hook
    monkeypatch.setitem(sys.modules, "megatron.core", outer)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", inner)
    # recorded, so that teardown removes what _activate sets (a worker's later child processes
    # would otherwise read this process as their activated parent)
    monkeypatch.setenv(startup.ACTIVATED_ENV, "0")
    startup._activate(inner)
    assert calls == []  # megatron.core is half-way: wait
    inner.__spec__._initializing = False  # TE's import ends, then megatron.core's body does
    startup._activate(outer)  # megatron.core's own hook, its body done
    assert calls == ["enable"]
    outer.__spec__._initializing = False
    startup._activate(inner)  # TE imported after megatron.core: activates at once
    assert calls == ["enable", "enable"]


def test_a_missing_wrapt_stops_a_process_that_imported_megatron_before_a_pth_hook(tmp_path):
    """issue 48 audit survivor F6 (startup.py's early-import stop narrowed from ``except Exception``):
    run the hook as ``site.py`` runs a ``.pth`` -- a real site directory holding megapatch's
    ``megapatch-startup.pth``, added by ``site.addsitedir`` after ``megatron.core`` was imported --
    with a requested option and wrapt missing. site.py prints an ordinary exception from a ``.pth``
    line and carries on, so only a ``SystemExit`` stops the job; the missing wrapt must stop it
    (non-zero exit, naming wrapt), never let it run on unpatched with exit 0."""
    import site
    import subprocess
    import sys

    site_dir = tmp_path / "site"
    site_dir.mkdir()
    with open(os.path.join(REPO, "megapatch-startup.pth")) as f:
        (site_dir / "megapatch-startup.pth").write_text(f.read())
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    _without_wrapt(shadow)
    packages = [p for p in site.getsitepackages() if os.path.isdir(p)]
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(shadow)!r}, {REPO!r}]  # wrapt shadowed; megapatch from this checkout
        sys.path.extend({packages!r})  # megatron from site-packages, no .pth file run
        import megatron.core
        assert "megapatch" not in sys.modules
        import site
        site.addsitedir({str(site_dir)!r})  # site.py's own .pth processing (site.addpackage)
        print("RAN ON")
    """)
    env = environ_without_megapatch()
    env.update(FP32, PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True,
                            timeout=180, cwd=str(tmp_path))
    assert result.returncode != 0 and "RAN ON" not in result.stdout, (result.stdout, result.stderr[-3000:])
    assert "wrapt" in result.stderr and "Error processing line" not in result.stderr, result.stderr[-3000:]
