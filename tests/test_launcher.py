"""megapatch-run: flags generated from the options, the environment it hands the command, and its
sitecustomize (activation once per process, chained to the user's own sitecustomize).

The ``pip install --target`` case (no .pth read at all) is in tests/test_install.py.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from megapatch.core import options
from megapatch.commands import launcher
from conftest import REPO, environ_without_megapatch


def _launch(args, env_extra=None, timeout=180, cwd=REPO):
    env = environ_without_megapatch()
    env["PYTHONWARNINGS"] = "ignore"
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "megapatch.commands.launcher", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_every_option_has_a_flag_that_sets_its_variable():
    parser = launcher.parser()
    flags = {a.dest: a.option_strings for a in parser._actions}
    for option in options.OPTIONS:
        flag = "--" + option.name.replace("_", "-")
        assert flag in flags[option.name], option.name
        is_bool = option.kind == "boolean"
        if is_bool:
            assert "--no-" + option.name.replace("_", "-") in flags[option.name]
            args = parser.parse_args([flag, "python"])
            assert launcher.environment(args, base={})[option.env] == "1"
            args = parser.parse_args(["--no-" + flag[2:], "python"])
            assert launcher.environment(args, base={})[option.env] == "0"
    args = parser.parse_args(["--tp-reduce-dtype", "fp32", "--logits-dtype", "float32", "torchrun",
                              "--nproc-per-node", "2", "train.py", "--tp-reduce-dtype", "x"])
    env = launcher.environment(args, base={"PYTHONPATH": "/elsewhere", "MEGAPATCH_STRICT": "0"})
    assert env["MEGAPATCH_TP_REDUCE_DTYPE"] == "fp32"
    assert env["MEGAPATCH_LOGITS_DTYPE"] == "float32"  # the child parses it as megapatch does
    assert env["MEGAPATCH_STRICT"] == "0"  # kept: no flag overrides it
    assert env["PYTHONPATH"].split(os.pathsep) == [launcher.BOOTSTRAP_DIR, "/elsewhere"]
    # the command keeps its own arguments, even ones that look like megapatch-run's
    assert args.command == ["torchrun", "--nproc-per-node", "2", "train.py", "--tp-reduce-dtype", "x"]


def test_messages_name_the_flag_that_set_a_variable():
    parser = launcher.parser()
    args = parser.parse_args(["--tp-invariant", "--tp-reduce-dtype", "fp32", "python"])
    env = launcher.environment(args, base={
        "MEGAPATCH_LOGITS_DTYPE": "fp32", options.SET_BY_ENV: "MEGAPATCH_LOGITS_DTYPE=fp32|an outer tool"})
    settings, sources = options.resolve({}, environ={**env, "MEGAPATCH_TP_REDUCE_DTYPE": "native"})
    assert sources["tp_invariant"] == "env MEGAPATCH_TP_INVARIANT set by megapatch-run --tp-invariant"
    assert sources["logits_dtype"] == "env MEGAPATCH_LOGITS_DTYPE set by an outer tool"  # kept
    # changed after the launcher set it: the variable is the source, not the flag
    assert sources["tp_reduce_dtype"] == "env MEGAPATCH_TP_REDUCE_DTYPE"
    args = parser.parse_args(["--no-tp-invariant", "python"])
    _, sources = options.resolve({}, environ=launcher.environment(args, base={}))
    assert sources["tp_invariant"] == "env MEGAPATCH_TP_INVARIANT set by megapatch-run --no-tp-invariant"


def test_a_refusal_through_the_launcher_names_its_flags():
    """Issue 19 item 7: a value set by a flag is reported as that flag, not as the variable."""
    result = _launch(["--tp-invariant", "--tp-reduce-dtype", "fp32", sys.executable, "-c",
                      "import megatron.core"])
    assert result.returncode != 0
    assert ("tp_invariant=True (from megapatch-run --tp-invariant, which sets MEGAPATCH_TP_INVARIANT=1; "
            "remove it there to change it) cannot be combined with tp_reduce_dtype='fp32' (from "
            "megapatch-run --tp-reduce-dtype fp32, which sets MEGAPATCH_TP_REDUCE_DTYPE=fp32") in result.stderr


def test_bootstrap_dir_holds_only_sitecustomize():
    """The directory goes first on sys.path of every process: it must shadow nothing else."""
    shipped = [n for n in os.listdir(launcher.BOOTSTRAP_DIR) if n != "__pycache__"]
    assert shipped == ["sitecustomize.py"]


@pytest.mark.parametrize("argv, message", [
    (["--tp-reduce-dtype", "fp16", "true"], "--tp-reduce-dtype='fp16' is not valid"),
    (["--logits-dtype", "fp16", "true"], "refused"),
    (["--tp-reduce-dtype", "fp32"], "no command given"),
])
def test_bad_arguments_are_usage_errors(argv, message):
    result = _launch(argv)
    assert result.returncode == 2
    assert "usage: megapatch-run" in result.stderr and message in result.stderr


def test_missing_command_exits_127():
    result = _launch(["--", "megapatch-no-such-command"])
    assert result.returncode == 127 and "command not found: megapatch-no-such-command" in result.stderr


def test_a_file_that_cannot_be_executed_exits_126_with_one_line(tmp_path):
    script = tmp_path / "no-shebang"
    script.write_text("echo hello\n")
    script.chmod(0o755)  # executable, but no #! line: exec fails with ENOEXEC, as in a shell
    result = _launch(["--", str(script)])
    assert result.returncode == 126, result.stderr
    assert result.stderr.strip() == f"megapatch-run: cannot run {script}: Exec format error"


def test_exit_status_and_arguments_pass_through():
    result = _launch(["--", sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(7)",
                      "--strict", "a b"])
    assert result.returncode == 7
    assert result.stdout.strip() == "['--strict', 'a b']"


def test_activates_once_where_pth_and_sitecustomize_both_run(tmp_path):
    """This environment's .pth and the launcher's sitecustomize both arm megapatch: one finder,
    one activation. The command is a shell that starts Python, as torchrun or srun would."""
    code = textwrap.dedent("""
        import sys
        triggers = sum(getattr(f, "megapatch_trigger", False) for f in sys.meta_path)
        import megapatch.core.engine as engine
        calls = []
        enable = engine.enable
        engine.enable = lambda *a, **k: (calls.append(a or k), enable(*a, **k))[1]
        import megatron.core
        import megapatch
        print("TRIGGERS", triggers, "ENABLES", len(calls), "SITECUSTOMIZE",
              sys.modules["sitecustomize"].__file__)
        print("ACTIVE", ",".join(megapatch.status().active))
    """)
    script = tmp_path / "child.py"
    script.write_text(code)
    result = _launch(["--tp-reduce-dtype", "fp32", "sh", "-c", f'"{sys.executable}" "{script}"'])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TRIGGERS 1 ENABLES 1" in result.stdout
    assert os.path.join("launcher_site", "sitecustomize.py") in result.stdout
    assert "tp_reduce.megatron_core" in result.stdout


def test_chains_to_the_users_sitecustomize(tmp_path):
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    code = ("import os, sys; print(os.environ.get('USER_SITECUSTOMIZE'), "
            "sys.modules['sitecustomize'].__file__, "
            "sum(getattr(f, 'megapatch_trigger', False) for f in sys.meta_path))")
    for flags in (["--tp-reduce-dtype", "fp32"], []):
        result = _launch(flags + ["--", sys.executable, "-c", code], {"PYTHONPATH": str(user)})
        assert result.returncode == 0, result.stderr[-3000:]
        ran, module, triggers = result.stdout.split()
        assert ran == "ran" and module == str(user / "sitecustomize.py")
        assert triggers == ("1" if flags else "0")


@pytest.mark.parametrize("missing", ["aa_not_installed", "zz_not_installed"])  # sorted before / after "sitecustomize"
def test_a_users_sitecustomize_that_fails_to_import_a_module_is_reported_as_without_the_launcher(tmp_path, missing):
    """Only the absence of a further sitecustomize is silent: an ImportError raised inside the
    user's one reaches Python's own report ("Error in sitecustomize"), whatever module it names."""
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text(f"import {missing}\n")
    # the user's directory joins only the command's path (the launcher's own Python would report it too)
    shell = f'PYTHONPATH="$PYTHONPATH:{user}" exec "{sys.executable}" -c "print(\'ran\')"'
    result = _launch(["--tp-reduce-dtype", "fp32", "--", "sh", "-c", shell])
    assert result.returncode == 0 and result.stdout.strip() == "ran", result.stderr[-3000:]
    assert result.stderr.count("Error in sitecustomize") == 1, result.stderr
    assert f"No module named '{missing}'" in result.stderr, result.stderr


def test_megapatch_importable_only_later_activates_then_or_refuses(tmp_path):
    """A zipapp (or a script's directory) joins sys.path after start-up: the launcher's hook
    retries when megatron is looked up, and refuses megatron if megapatch is still missing."""
    hidden = tmp_path / "hidden"
    (hidden / "megapatch").mkdir(parents=True)
    (hidden / "megapatch" / "__init__.py").write_text("raise ImportError('not importable yet')\n")
    later = tmp_path / "later.py"
    later.write_text(textwrap.dedent(f"""
        import sys
        print("DEFERRED", [type(f).__name__ for f in sys.meta_path].count("_Deferred"))
        sys.path.remove({str(hidden)!r})
        for name in [n for n in sys.modules if n.startswith("megapatch")]:
            del sys.modules[name]
        import megatron.core, megapatch
        print("ACTIVE", ",".join(megapatch.status().active))
    """))
    never = tmp_path / "never.py"
    never.write_text("import megatron.core\nprint('trained unpatched')\n")

    def launch(script):  # the launcher sees megapatch; the command's Python does not, at first
        shell = f'PYTHONPATH="{hidden}:$PYTHONPATH" exec "{sys.executable}" "{script}"'
        return _launch(["--tp-reduce-dtype", "fp32", "--", "sh", "-c", shell], cwd=str(tmp_path))

    result = launch(later)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DEFERRED 1" in result.stdout and "tp_reduce.megatron_core" in result.stdout
    refused = launch(never)
    assert refused.returncode != 0 and "trained unpatched" not in refused.stdout
    assert "cannot import megapatch" in refused.stderr and "MEGAPATCH_TP_REDUCE_DTYPE" in refused.stderr
