"""`megapatch doctor` / `megapatch status`: versions, per-patch compatibility, what the environment
would do; always a report, never a traceback."""

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import run_python

from megapatch.core import engine
from megapatch.commands.doctor import diagnose, survey
from megapatch.commands.doctor_text import render_doctor

DOCTOR = "import sys; from megapatch.commands.cli import main; sys.exit(main({argv!r}))"
# An upstream whose surface changed: `_reduce`'s parameters renamed, in place before megatron.core
# finishes importing (so before megapatch's startup hook can see the original).
RENAMED_REDUCE = """
import sys, wrapt
def rename(mappings):
    original = mappings._reduce
    def _reduce(tensor, process_group):
        return original(tensor, process_group)
    mappings._reduce = _reduce
wrapt.register_post_import_hook(rename, "megatron.core.tensor_parallel.mappings")
from megapatch.commands.cli import main
sys.exit(main({argv!r}))
"""


def _cli(argv, env=None, code=DOCTOR):
    return run_python(code.format(argv=list(argv)), env=env, fresh=False)  # not about interpreter start


def test_doctor_reports_versions_and_patches():
    result = _cli(["doctor"])
    assert result.returncode == 0, result.stdout + result.stderr
    for word in ("python", "torch", "megatron-core", "transformer-engine", "wrapt",
                 "tp_reduce.megatron_core", "compatible", "no MEGAPATCH_* variable set", "result: OK"):
        assert word in result.stdout


def test_doctor_console_script_and_module_entry_point():
    exe = shutil.which("megapatch", path=os.path.dirname(sys.executable))
    assert exe, "console script `megapatch` not installed next to this python"
    via_script = subprocess.run([exe, "doctor"], capture_output=True, text=True, timeout=120)
    via_module = run_python("import runpy; runpy.run_module('megapatch', run_name='__main__')")
    assert via_script.returncode == 0, via_script.stderr
    assert "result: OK" in via_script.stdout
    assert via_module.returncode == 2  # no sub-command: argparse usage error


def test_doctor_says_what_the_environment_enables():
    result = _cli(["doctor"], env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("tp_reduce.megatron_core"))
    assert " yes " in line and "compatible" in line and "backend:" in line
    assert "activation: enabled" in result.stdout  # the startup hook ran, as in a job


def test_doctor_exit_2_on_invalid_environment():
    result = _cli(["doctor"], env={"MEGAPATCH_LOGITS_DTYPE": "fp16"})
    assert result.returncode == 2
    assert "MEGAPATCH_LOGITS_DTYPE='fp16' is refused" in result.stdout
    # still a full report: versions and every patch's upstream verdict
    assert "megatron-core" in result.stdout and "tp_reduce.megatron_core" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_doctor_reports_and_exits_1_when_strict_activation_meets_a_changed_upstream():
    """The case doctor exists for: strict (default) settings, an upstream whose surface changed.
    The job's activation raises; doctor must show it as a finding, with every row, and exit 1."""
    result = _cli(["doctor"], env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}, code=RENAMED_REDUCE)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "Traceback" not in out + result.stderr
    for name in [p.name for p in engine.patches()]:
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    for word in ("megatron-core", "torch", "wrapt", "environment: MEGAPATCH_TP_REDUCE_DTYPE=fp32",
                 "env MEGAPATCH_TP_REDUCE_DTYPE"):
        assert word in out
    assert "activation: failed" in out and "UpstreamSurfaceError" in out
    row = next(l for l in out.splitlines() if l.startswith("tp_reduce.megatron_core "))
    assert "INCOMPATIBLE" in row and "mappings._reduce takes (tensor, process_group)" in row
    assert "result: requested patch(es) cannot apply: tp_reduce.megatron_core" in out


def test_doctor_json_and_status_json_on_a_changed_upstream():
    for command in ("doctor", "status"):
        result = _cli([command, "--json"], env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}, code=RENAMED_REDUCE)
        assert result.returncode == 1, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert report["result"]["code"] == 1
        assert report["activation"]["state"] == "failed"
        rows = {r["name"]: r for r in report["patches"]}
        assert set(rows) == {p.name for p in engine.patches()}
        assert rows["tp_reduce.megatron_core"]["upstream"] == "INCOMPATIBLE"
        assert rows["tp_reduce.megatron_core"]["requested"] is True
        assert rows["tp_reduce.megatron_core"]["would_install"] is False
        assert report["versions"]["megatron-core"]


def test_doctor_exit_1_when_the_startup_hook_never_runs():
    """Variables set, but nothing activates megapatch (no .pth processed, as with pip --target):
    FP32 was asked for and the job would silently run native."""
    code = ("import os, sys; os.environ['MEGAPATCH_TP_REDUCE_DTYPE'] = 'fp32'\n"
            "from megapatch.commands.cli import main; sys.exit(main(['doctor']))")
    result = run_python(code)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "activation: not-run" in result.stdout and "megapatch-run" in result.stdout


def test_doctor_exit_1_when_a_requested_patch_cannot_apply(monkeypatch):
    from megatron.core.tensor_parallel import mappings

    def _reduce(tensor, process_group):
        return tensor

    monkeypatch.setattr(mappings, "_reduce", _reduce)
    monkeypatch.setenv("MEGAPATCH_TP_REDUCE_DTYPE", "fp32")
    code, text = diagnose()
    assert code == 1
    assert "INCOMPATIBLE" in text and "mappings._reduce takes (tensor, process_group)" in text
    monkeypatch.delenv("MEGAPATCH_TP_REDUCE_DTYPE")
    code, _ = diagnose()
    assert code == 0  # not requested: reported, but not a failure


def _with_patch_replaced(monkeypatch, name, **changes):
    patches = tuple(dataclasses.replace(p, **changes) if p.name == name else p for p in engine.patches())
    monkeypatch.setattr(engine, "_patches", patches)


def _boom(*_args):
    raise RuntimeError("upstream __init__ is not a plain function")


def test_an_exception_from_a_probe_becomes_a_row(monkeypatch):
    _with_patch_replaced(monkeypatch, "tp_reduce.megatron_core", probe=_boom)
    monkeypatch.setenv("MEGAPATCH_TP_REDUCE_DTYPE", "fp32")
    code, text = diagnose()
    row = next(l for l in text.splitlines() if l.startswith("tp_reduce.megatron_core "))
    # doctor's own guard says ERROR; an engine that turns a raising probe into a reason says INCOMPATIBLE
    assert ("ERROR" in row or "INCOMPATIBLE" in row), row
    assert "RuntimeError: upstream __init__ is not a plain function" in row
    assert code == 1
    assert any(l.startswith("logits.fp32_lm_head ") for l in text.splitlines())  # the others still reported


def test_an_exception_from_a_backend_probe_or_applies_becomes_a_row(monkeypatch):
    _with_patch_replaced(monkeypatch, "tp_reduce.megatron_core", backend=_boom)
    _with_patch_replaced(monkeypatch, "logits.fp32_lm_head", applies=_boom)
    result = survey()
    rows = {r["name"]: r for r in result["patches"]}
    assert rows["tp_reduce.megatron_core"]["upstream"] == "ERROR"
    assert "backend probe raised RuntimeError" in rows["tp_reduce.megatron_core"]["problems"][0]
    assert "applies raised RuntimeError" in rows["logits.fp32_lm_head"]["problems"][0]
    assert result["result"]["code"] == 0  # nothing requested: the failures are shown, not fatal


def test_status_says_what_the_environment_would_do():
    result = _cli(["status"], env={"MEGAPATCH_LOGITS_DTYPE": "fp32",
                                   "MEGAPATCH_SKIP_PATCHES": "logits.fp32_inference"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = next(l for l in lines if l.startswith("patch "))
    for column in ("requested", "opted-out", "upstream", "would install"):
        assert column in header
    assert any(l.startswith("logits_dtype") and "env MEGAPATCH_LOGITS_DTYPE" in l for l in lines)
    lm_head = next(l for l in lines if l.startswith("logits.fp32_lm_head "))
    assert lm_head.split()[1:5] == ["yes", "no", "compatible", "yes"]
    inference = next(l for l in lines if l.startswith("logits.fp32_inference "))
    assert inference.split()[1:5] == ["yes", "yes", "compatible", "no"] and "opted out" in inference
    tp = next(l for l in lines if l.startswith("tp_reduce.megatron_core "))
    assert tp.split()[1] == "no" and "not requested" in tp
    # megatron.rl ships with a Megatron-LM checkout, not megatron-core: no verdict without it, no stop
    rl = next(l for l in lines if l.startswith("logits.fp32_rl_logprobs "))
    assert "INCOMPATIBLE" not in rl and "megatron.rl is not importable here" in rl, rl


def test_status_and_doctor_do_not_print_the_activation_line():
    """They import megatron as a job would, which activates megapatch from the environment: its
    rank-0 line ``megapatch enabled: ...`` would read as if the command switched something on."""
    for command in (["status"], ["doctor"], ["status", "--json"]):
        result = _cli(command, env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"})
        assert result.returncode == 0, result.stdout + result.stderr
        assert "megapatch enabled" not in result.stdout + result.stderr, command


# -- megapatch doctor -- <Megatron-LM flags> ---------------------------------------------------------

LOCAL = ["--tensor-model-parallel-size", "2", "--num-attention-heads", "8", "--transformer-impl", "local",
         "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion"]


def test_doctor_with_flags_the_mode_covers_says_so():
    result = _cli(["doctor", "--", *LOCAL], env={"MEGAPATCH_TP_INVARIANT": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no requested patch refuses them" in result.stdout
    assert "Megatron-LM flags: " + " ".join(LOCAL) in result.stdout


def test_doctor_with_flags_names_every_refusal_its_flag_and_the_source():
    flags = LOCAL[:6] + ["--sequence-parallel", "--use-distributed-optimizer",
                         "--num-distributed-optimizer-instances", "2",
                         "--group-query-attention", "--num-query-groups", "1"]  # Megatron-LM's fusions on by default
    result = _cli(["doctor", "--", *flags], env={"MEGAPATCH_TP_INVARIANT": "1"})
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    for expected in ("--sequence-parallel", "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion",
                     "--num-query-groups", "--num-distributed-optimizer-instances", "from env MEGAPATCH_TP_INVARIANT"):
        assert expected in out, expected
    assert "would be refused before its first step by tp_invariant.construction, " \
           "tp_invariant.distributed_optimizer" in out
    # the same flags without the mode: nothing is requested, nothing refuses
    assert _cli(["doctor", "--", *flags]).returncode == 0
    # and the JSON document carries the same verdict
    data = json.loads(_cli(["status", "--json", "--", *flags], env={"MEGAPATCH_TP_INVARIANT": "1"}).stdout)
    assert sorted(data["flags"]["refusals"]) == ["tp_invariant.construction", "tp_invariant.distributed_optimizer"]


@pytest.mark.te(required=False)
def test_doctor_says_where_transformer_engine_layers_stop_and_refuses_arguments_without_the_separator():
    """Megatron-LM's default layers are Transformer Engine's: the mode covers them where TE is installed
    (tp_invariant.transformer_engine; tests/test_tp_invariant_transformer_engine.py in CI's te stage);
    here, without TE, the job stops upstream first and no megapatch patch is said to refuse it."""
    result = _cli(["doctor", "--", "--num-attention-heads", "8", "--no-gradient-accumulation-fusion",
                   "--no-bias-gelu-fusion"], env={"MEGAPATCH_TP_INVARIANT": "1"})
    assert "no requested patch refuses them" in result.stdout, result.stdout
    if importlib.util.find_spec("transformer_engine") is None:
        assert result.returncode == 1 and "Transformer Engine is not installed" in result.stdout, result.stdout
        assert "tp_invariant.transformer_engine     no         n/a" in result.stdout, result.stdout
    else:  # the mode covers those TE layers
        assert result.returncode == 0 and "result: OK" in result.stdout, result.stdout
        assert "tp_invariant.transformer_engine     yes        compatible" in result.stdout, result.stdout
    usage = _cli(["doctor", "--sequence-parallel"])
    assert usage.returncode == 2 and "unrecognized arguments: --sequence-parallel" in usage.stderr, usage.stderr
    stray = _cli(["doctor", "pretrain_gpt.py"])
    assert stray.returncode == 2 and "after --" in stray.stderr, stray.stderr


def test_flags_translate_to_the_config_fields_megatron_lm_builds():
    from megapatch.commands.megatron_lm_flags import config_from_flags

    config = config_from_flags(["--swiglu", "--no-bias-gelu-fusion", "--num-attention-heads=16",
                                "--group-query-attention", "--num-query-groups", "4", "--num-experts", "8"])
    assert config.bias_activation_fusion  # --swiglu reads --no-bias-swiglu-fusion, not the GELU flag
    assert (config.num_attention_heads, config.num_query_groups, config.num_moe_experts) == (16, 4, 8)
    assert config_from_flags(["--num-query-groups", "4"]).num_query_groups is None  # needs --group-query-attention
    assert not config_from_flags(["--swiglu", "--no-bias-swiglu-fusion"]).bias_activation_fusion


# a module megapatch (or its patches) needs is absent: hidden from the import system as if uninstalled
WITHOUT = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named '{{name}}'", name=name)
sys.meta_path.insert(0, Hide())
from megapatch.commands.cli import main
sys.exit(main({argv!r}))
"""


def test_status_json_without_wrapt_or_torch_names_the_missing_module():
    """--json prints a JSON document and no traceback; the message names the real cause (it once
    said "an invalid MEGAPATCH_* value" with torch missing, and printed a traceback without wrapt)."""
    for module in ("wrapt", "torch"):
        result = run_python(WITHOUT.format(module=module, argv=["status", "--json"]))
        assert result.returncode == 1, (module, result.stdout, result.stderr)
        assert "Traceback" not in result.stdout + result.stderr, (module, result.stderr[-2000:])
        message = json.loads(result.stdout)["result"]["message"]
        assert f"No module named '{module}'" in message and "MEGAPATCH_" not in message, message


# -- issue 28: the flags' refusals name their real cause; survivors of the fresh mutation sample ------

def _flags_survey(monkeypatch, flags, **env):
    """``megapatch doctor -- <flags>`` in this process, with ``env`` as the job's MEGAPATCH_*
    variables. megatron.core is imported first: activation from the environment is then "not
    observed" (no startup hook ran here), which is no finding, and the verdict is the flags'."""
    import megatron.core  # noqa: F401

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return survey(list(flags))


def test_a_flag_given_twice_counts_at_its_last_occurrence_as_argparse_takes_it():
    from megapatch.commands.megatron_lm_flags import config_from_flags

    config = config_from_flags(["--tensor-model-parallel-size", "4", "--transformer-impl=transformer_engine",
                                "--num-attention-heads=16", "--tensor-model-parallel-size=2",
                                "--transformer-impl", "local", "--num-attention-heads", "8"])
    assert (config.tensor_model_parallel_size, config.transformer_impl, config.num_attention_heads) == (2, "local", 8)
    # the padded vocabulary follows the last TP size and --vocab-size: 304 + 1 EOD up to a multiple of 4 x 2
    config = config_from_flags(["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--vocab-size", "304",
                                "--make-vocab-size-divisible-by", "4", "--tensor-model-parallel-size", "8",
                                "--tensor-model-parallel-size", "2"])
    assert config.padded_vocab_size == 312


def test_the_preflight_leaves_out_patches_the_user_opted_out_of(monkeypatch):
    """MEGAPATCH_SKIP_PATCHES=logits.fp32_lm_head: that patch's model check never runs in the job,
    so the doctor must not refuse the model's own BF16 logit dtype in its name (a false refusal)."""
    flags = ["--output-logit-dtype", "bf16", "--transformer-impl", "local"]
    refused = _flags_survey(monkeypatch, flags, MEGAPATCH_LOGITS_DTYPE="fp32")
    assert list(refused["flags"]["refusals"]) == ["logits.fp32_lm_head"]  # the check can refuse
    assert refused["result"]["code"] == 1
    skipped = _flags_survey(monkeypatch, flags, MEGAPATCH_SKIP_PATCHES="logits.fp32_lm_head")
    assert skipped["settings"]["skip_patches"] == ("logits.fp32_lm_head",)
    assert skipped["flags"]["refusals"] == {} and skipped["result"]["code"] == 0, skipped["result"]


TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--transformer-impl", "local",
        "--no-gradient-accumulation-fusion"]


def test_the_padded_vocabulary_refusal_names_it_and_the_flags_that_padded_it(monkeypatch):
    flags = TINY + ["--no-bias-gelu-fusion", "--vocab-size", "513", "--make-vocab-size-divisible-by", "2",
                    "--tensor-model-parallel-size", "2"]
    result = _flags_survey(monkeypatch, flags, MEGAPATCH_TP_INVARIANT="1")
    assert result["result"]["code"] == 1 and result["flags"]["config"]["padded_vocab_size"] == 516
    [reason] = result["flags"]["refusals"].values()
    for part in ("does not support the padded vocabulary of 516 entries: Megatron-LM pads --vocab-size 513 "
                 "+ 1 EOD token (NullTokenizer) up to a multiple of --make-vocab-size-divisible-by 2 x TP 2 = 4",
                 "the width W=8 (the default tp_invariant_width=8) does not divide 516",
                 "set --make-vocab-size-divisible-by to a multiple of 4"):
        assert part in reason, reason
    # 513 + 1 pads to 768 with the default --make-vocab-size-divisible-by 128: accepted
    assert _flags_survey(monkeypatch, flags[:-4] + ["--tensor-model-parallel-size", "2"])["result"]["code"] == 0


def test_the_fused_activation_refusal_names_the_one_flag_of_the_models_activation(monkeypatch):
    swiglu = _flags_survey(monkeypatch, TINY + ["--swiglu", "--no-bias-gelu-fusion"],  # the GELU flag does nothing here
                           MEGAPATCH_TP_INVARIANT="1")
    [reason] = swiglu["flags"]["refusals"].values()
    assert "bias_activation_fusion=True (Megatron-LM: on by default; --no-bias-swiglu-fusion)" in reason, reason
    assert "gelu" not in reason
    gelu = survey(TINY + ["--no-bias-swiglu-fusion"])
    [reason] = gelu["flags"]["refusals"].values()
    assert "bias_activation_fusion=True (Megatron-LM: on by default; --no-bias-gelu-fusion)" in reason, reason
    assert "swiglu" not in reason
    assert survey(TINY + ["--swiglu", "--no-bias-swiglu-fusion"])["result"]["code"] == 0


def test_transformer_engine_missing_is_said_first_before_any_megapatch_reason(monkeypatch):
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    # the fused bias-GELU (on by default) is what the mode refuses here: its TE layers are covered
    flags = [f for f in TINY if f not in ("--transformer-impl", "local")]
    result = _flags_survey(monkeypatch, flags, MEGAPATCH_TP_INVARIANT="1")
    assert result["result"]["code"] == 1
    assert result["result"]["message"].startswith(
        "with these Megatron-LM flags the job would stop before its first step: Transformer Engine is not "
        "installed; megapatch would then refuse it too (tp_invariant.construction)"), result["result"]
    [stop] = result["flags"]["stops"]
    assert stop.startswith("Transformer Engine is not installed") and "--transformer-impl local" in stop
    lines = render_doctor(result).splitlines()
    first = next(i for i, line in enumerate(lines) if "STOPS FIRST" in line or "REFUSED" in line)
    assert "STOPS FIRST, upstream: Transformer Engine is not installed" in lines[first], lines[first:]
    # without the mode nothing megapatch refuses; the job still stops, and the doctor says so
    monkeypatch.delenv("MEGAPATCH_TP_INVARIANT")
    plain = survey(flags)
    assert plain["flags"]["refusals"] == {} and plain["flags"]["stops"] and plain["result"]["code"] == 1
    assert survey(TINY + ["--no-bias-gelu-fusion"])["flags"]["stops"] == []  # --transformer-impl local


# -- issue 28 item 8: survivors of the third fresh mutation sample (seed 30) -------------------------

def test_a_flag_left_without_its_value_at_the_end_is_ignored_not_an_index_error():
    """A command line cut short (``... --tensor-model-parallel-size``): the flag's earlier value, or its
    default, counts; reading the flags must not raise (argparse itself would stop at that flag with
    a usage error, which is the job's to report)."""
    from megapatch.commands.megatron_lm_flags import config_from_flags

    config = config_from_flags(["--tensor-model-parallel-size", "2", "--hidden-size", "64",
                                "--tensor-model-parallel-size"])
    assert (config.tensor_model_parallel_size, config.hidden_size) == (2, 64)
    assert config_from_flags(["--num-attention-heads", "8", "--hidden-size"]).hidden_size is None


def test_the_doctor_prints_the_stack_line_of_an_installed_megatron_bridge_in_and_outside_its_range(monkeypatch):
    """Megatron-Bridge present (no test venv here has it): its line names the version and the range
    megapatch was run under, with the untested-stack warning only outside that range."""
    from megapatch.core import upstream_versions

    real = upstream_versions.version_of
    for version, warned in (("0.6.2", False), ("0.7.0", True)):
        monkeypatch.setattr(upstream_versions, "version_of",
                            lambda package, v=version: v if package == "megatron-bridge" else real(package))
        result = survey()
        assert result["stacks"]["megatron-bridge"]["version"] == version
        [line] = [l for l in render_doctor(result).splitlines() if l.startswith("megatron-bridge ")]
        assert line.startswith(f"megatron-bridge {version} (megapatch was run under >=0.6.2,<0.6.3)"), line
        assert ("; WARNING: megatron-bridge 0.7.0 is outside the versions megapatch was run under" in line) == warned, line


def test_the_after_import_line_names_every_patch_state_but_inactive():
    """What the startup hook did, as a job would see it: the active patches and the one opted out,
    none of the patches left inactive (their options were not asked for)."""
    result = _cli(["doctor"], env={"MEGAPATCH_TP_REDUCE_DTYPE": "fp32",
                                   "MEGAPATCH_SKIP_PATCHES": "tp_reduce.transformer_engine"})
    assert result.returncode == 0, result.stdout + result.stderr
    [line] = [l for l in result.stdout.splitlines() if l.startswith("  after import: ")]
    assert "tp_reduce.megatron_core active" in line and "tp_reduce.transformer_engine opted-out" in line, line
    assert "inactive" not in line and "logits." not in line, line


# -- issue 48 item 2: the launch, the doctor against Megatron-LM's validate_args ------------------------

VALIDATE = """
import json, sys
sys.path.insert(0, ".")
from megatron.training import arguments
from megatron.training.arguments import parse_args, validate_args
arguments.get_device_arch_version = lambda: 0  # as a launch sets it (megatron_lm_compat)
FLAGS = json.loads({flags!r})
def validate():
    sys.argv = ["pretrain_gpt.py", *FLAGS]
    a = parse_args(ignore_unknown_args=True)
    a.world_size = 1
    try:
        validate_args(a, {{}})
        return "ran"
    except Exception as exc:
        return f"stopped: {{type(exc).__name__}}: {{exc}}"
said = {{"cpu": validate()}}
if {with_te!r}:
    import torch  # noqa: F401 -- before TE, as cpu_launch --te does
    from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime
    with te_cpu_runtime():
        said["cpu-te"] = validate()
print("SAID" + json.dumps(said))
"""


@pytest.mark.te
def test_megatron_lms_validate_args_agrees_with_the_doctor_on_each_launch(tmp_path_factory, monkeypatch):
    """Issue 48 item 2, the run side: Megatron-LM core_v0.16.1's own ``validate_args`` on grouped-GEMM
    flags stops outside the TE runtime (no CUDA) and passes inside it (``cpu_launch --te``, whose
    runtime answers the compute capability), as the doctor says for ``--launch cpu`` and ``cpu-te``
    (the doctor's side alone: tests/test_doctor_job_view.py)."""
    import torch

    from conftest import pinned_megatron_lm
    from megapatch.testing.ranks import megatron_lm_runs as mlm

    import megatron.core  # noqa: F401

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: upstream's check passes in every launch")

    checkout = pinned_megatron_lm(tmp_path_factory)
    flags = mlm.tiny_gpt_flags(extra=("--num-experts", "4", "--moe-grouped-gemm"))
    ran = subprocess.run([sys.executable, "-c", VALIDATE.format(flags=json.dumps(flags), with_te=True)],
                         cwd=str(checkout), capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0 and "SAID" in ran.stdout, ran.stderr[-3000:]
    said = json.loads(ran.stdout.split("SAID", 1)[1])
    for launch in ("cpu", "cpu-te"):
        stops = [s for s in survey(flags, launch=launch)["flags"]["stops"] if s.startswith("--moe-grouped-gemm")]
        assert (said[launch] == "ran") == (not stops), (launch, said, stops)
    assert said == {"cpu": said["cpu"], "cpu-te": "ran"} and said["cpu"].startswith("stopped"), said
