"""Issue 48 items 1-3 and audit survivor N21: the doctor predicts what the job does, not what this
environment lacks for other jobs, knows the launch, and says what the mode runs instead of a chosen
attention backend.

1. A patch whose module cannot be imported here (``megatron.rl.rl_utils`` of a Megatron-LM checkout
   without ``tensorboard``) applies only to a job that imports it: the doctor predicts a stop only for
   a job whose script imports it (outside a ``try`` that catches ImportError) or whose flags need it
   (``--perform-rl-step``), as upstream's import would stop that job; ``pretrain_gpt.py`` imports it in
   such a ``try`` and runs. Both sides run here, in a process where ``tensorboard`` is hidden.
2. ``--launch cpu-te`` (or ``MEGAPATCH_LAUNCH``, which ``cpu_launch`` sets): the Transformer Engine
   runtime answers the GPU capability check of ``--moe-grouped-gemm``; megapatch's own checks are
   listed after an upstream stop all the same. The run side, Megatron-LM's own ``validate_args``
   inside the runtime, needs TE: ``tests/test_doctor.py`` (which CI's te stage runs).
3. ``--attention-backend flash`` under ``tp_invariant``: accepted, one line in the job log and the
   same line from the doctor (the run side: ``tests/test_doctor_agrees_with_run.py``).
"""

import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import REPO, run_python
from megapatch.commands.doctor import survey
from megapatch.commands.doctor_text import render_doctor, render_status

TARBALLS = Path(os.environ.get("MEGATRON_LM_TARBALLS", Path(REPO).parent / "shared" / "megatron-lm"))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--transformer-impl", "local",
        "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion"]


def _scripts(tmp_path) -> dict:
    """core_v0.16.1's ``pretrain_gpt.py``, ``train_rl.py`` and ``megatron/training/training.py``, read
    from the pinned tarball (only these files)."""
    tarball = TARBALLS / "Megatron-LM-core_v0.16.1.tar.gz"
    if not tarball.is_file():
        pytest.skip(f"no pinned Megatron-LM sources: {tarball} is absent")
    wanted = {"Megatron-LM/pretrain_gpt.py", "Megatron-LM/train_rl.py", "Megatron-LM/megatron/training/training.py"}
    found = {}
    with tarfile.open(tarball) as archive:
        for member in archive:
            if member.name in wanted:
                path = tmp_path / Path(member.name).name
                path.write_bytes(archive.extractfile(member).read())
                found[path.name] = str(path)
    assert len(found) == 3, found
    return found


# Megatron RL's module as a Megatron-LM checkout has it (its import of TensorBoard's writer first),
# beside megatron-core's namespace package; tensorboard hidden as if it were not installed
CLIENT = """
import importlib.abc, json, os, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "tensorboard":
            raise ModuleNotFoundError(f"No module named '{{name}}'", name=name)
sys.meta_path.insert(0, Hide())
stub = {stub!r}
os.makedirs(os.path.join(stub, "megatron", "rl"), exist_ok=True)
open(os.path.join(stub, "megatron", "rl", "__init__.py"), "w").close()
with open(os.path.join(stub, "megatron", "rl", "rl_utils.py"), "w") as f:
    f.write("from torch.utils.tensorboard import SummaryWriter\\n")
sys.path.insert(0, stub)
import megatron.core
from megapatch.commands.doctor import survey
from megapatch.commands.doctor_text import render_status
scripts, flags, out = {scripts!r}, {flags!r}, {{}}
def doctor(argv):
    result = survey(argv)
    rows = {{r["name"]: r for r in result["patches"]}}
    return dict(code=result["result"]["code"], message=result["result"]["message"],
                stops=result["flags"]["stops"], rl=rows["tp_invariant.rl_logprobs"])
out["flags"] = doctor(flags)
out["pretrain_gpt.py"] = doctor([scripts["pretrain_gpt.py"], *flags])
out["train_rl.py"] = doctor([scripts["train_rl.py"], *flags])
out["--perform-rl-step"] = doctor([*flags, "--perform-rl-step"])
out["status"] = render_status(survey())
# the run: megapatch on from the environment, as in the job; core_v0.16.1's training loop imports
# Megatron RL in a try (pretrain_gpt.py), train_rl.py at its top
import megapatch
training = open(scripts["training.py"]).read()
guarded = "try:\\n    from megatron.rl import rl_utils\\n    has_rl_utils = True\\nexcept ImportError:\\n    has_rl_utils = False\\n"
assert guarded in training
scope = {{}}
exec(guarded, scope)
out["run pretrain_gpt.py"] = dict(has_rl_utils=scope["has_rl_utils"], enabled=megapatch.is_enabled(),
                                  state=megapatch.status().patch("tp_invariant.rl_logprobs").state)
try:
    exec("from megatron.rl.rl_utils import SummaryWriter", {{}})
    out["run train_rl.py"] = "ran"
except ImportError as exc:
    out["run train_rl.py"] = f"{{type(exc).__name__}}: {{exc}}"
print("OUT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl-without-tensorboard")
    scripts = _scripts(tmp)
    code = CLIENT.format(stub=str(tmp / "stub"), scripts=scripts, flags=TINY)
    result = run_python(code, env={"MEGAPATCH_TP_INVARIANT": "1"}, fresh=False, timeout=600)
    assert result.returncode == 0 and "OUT" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.split("OUT", 1)[1])


def test_a_client_module_that_cannot_be_imported_here_stops_only_a_job_that_imports_it(client):
    """Issue 48 item 1: before, every doctor here ended ``tp_invariant.rl_logprobs INCOMPATIBLE cannot
    import megatron.rl.rl_utils: No module named 'tensorboard'`` ... ``the job would stop (exit 1)``."""
    for job in ("flags", "pretrain_gpt.py"):  # no script, or one that imports Megatron RL in a try
        said = client[job]
        assert (said["code"], said["stops"]) == (0, []), (job, said)
        assert said["rl"]["upstream"] != "INCOMPATIBLE" and "No module named 'tensorboard'" in said["rl"]["problems"][0]
        assert "this job does not import megatron.rl.rl_utils" in said["rl"]["why"], said["rl"]["why"]
    # the run agrees: Megatron-LM's guarded import fails, the job goes on, the patch waits for the import
    assert client["run pretrain_gpt.py"] == dict(has_rl_utils=False, enabled=True, state="pending-import")
    for job, how in (("train_rl.py", "train_rl.py (line 18)"), ("--perform-rl-step", "--perform-rl-step")):
        said = client[job]
        [stop] = said["stops"]
        assert said["code"] == 1 and stop.startswith("megatron.rl.rl_utils cannot be imported here (No module "
                                                     "named 'tensorboard'), and the job imports it: " + how), stop
        assert said["message"].startswith("with these Megatron-LM flags the job would stop before its first step: "
                                          "megatron.rl.rl_utils cannot be imported here"), said["message"]
    assert client["run train_rl.py"] == "ModuleNotFoundError: No module named 'tensorboard'"


def test_status_never_says_the_job_stops_for_a_module_only_other_jobs_import(client):
    [row] = [line for line in client["status"].splitlines() if line.startswith("tp_invariant.rl_logprobs ")]
    assert "strict: the job stops with this error" not in client["status"], row
    assert "applies only to a job that imports it" in row and "No module named 'tensorboard'" in row, row
    assert client["status"].rstrip().endswith("result: OK"), client["status"][-500:]


def test_a_scripts_imports_are_its_own_module_level_ones_outside_import_guards(tmp_path):
    from megapatch.commands.upstream_stops import job_imports, script_imports, split_script

    script = tmp_path / "job.py"
    script.write_text("import os\nfrom megatron.rl import rl_utils\ntry:\n    import guarded.mod\nexcept ImportError:\n"
                      "    pass\ntry:\n    import unguarded.mod\nfinally:\n    pass\ndef f():\n    import inside.f\n"
                      "if __name__ == '__main__':\n    from megatron.core.inference import engine as e\n")
    found = script_imports(str(script))
    assert {"os", "megatron.rl", "megatron.rl.rl_utils", "unguarded.mod", "megatron.core.inference",
            "megatron.core.inference.engine"} <= set(found), found
    assert "guarded.mod" not in found and "inside.f" not in found and found["megatron.rl.rl_utils"] == 2
    assert split_script([str(script), "--seq-length", "8"]) == (str(script), ["--seq-length", "8"])
    assert split_script(["--seq-length", "8"]) == (None, ["--seq-length", "8"])
    assert job_imports(None, ["--perform-rl-step"]) == {"megatron.rl.rl_utils": "--perform-rl-step (Megatron-LM's "
                                                                                 "training loop needs it)"}


def test_the_doctor_names_a_script_it_cannot_read(tmp_path, monkeypatch):
    """Only where a patch's module is unimportable are the script's imports read; then a missing
    script is a finding, not a traceback."""
    from megapatch.commands import doctor

    import megatron.core  # noqa: F401

    findable, failure = doctor._findable, doctor._import_failure
    monkeypatch.setattr(doctor, "_findable", lambda m: m.startswith("megatron.rl") or findable(m))
    monkeypatch.setattr(doctor, "_import_failure",
                        lambda m: "No module named 'tensorboard'" if m.startswith("megatron.rl") else failure(m))
    assert survey(TINY)["result"]["code"] == 0
    result = survey([str(tmp_path / "absent.py"), *TINY])
    assert any("reading the imports of" in p and "absent.py" in p for p in result["problems"]), result["problems"]
    assert result["result"]["code"] == 1


# -- item 2: the launch ------------------------------------------------------------------------------

MOE = TINY + ["--num-experts", "4", "--moe-grouped-gemm"]


def _no_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the launch 'here' answers the capability check")


def test_the_te_runtime_launch_answers_the_grouped_gemm_capability_check(monkeypatch):
    """Issue 48 item 2: ``cpu_launch --te`` runs ``--moe-grouped-gemm`` (its runtime answers
    ``torch.cuda.get_device_capability``); the plain CPU launch and this machine do not."""
    import megatron.core  # noqa: F401 -- activation "not observed": no finding

    _no_cuda()
    cause = "--moe-grouped-gemm without CUDA"
    for launch, stops in ((None, True), ("here", True), ("cpu", True), ("cpu-te", False), ("cuda", False)):
        result = survey(MOE, launch=launch)
        assert any(s.startswith(cause) for s in result["flags"]["stops"]) == stops, (launch, result["flags"]["stops"])
        assert result["launch"]["name"] == (launch or "here")
    [stop] = survey(MOE, launch="cpu")["flags"]["stops"]
    assert "fails in the launch cpu (megapatch.testing.ranks.cpu_launch: CPU ranks, no CUDA)" in stop, stop
    monkeypatch.setenv("MEGAPATCH_LAUNCH", "cpu-te")
    result = survey(MOE)
    assert result["flags"]["stops"] == [] and result["launch"] == {"name": "cpu-te", "from": "MEGAPATCH_LAUNCH"}
    assert "  launch: cpu-te (MEGAPATCH_LAUNCH): megapatch.testing.ranks.cpu_launch --te" in render_doctor(result)
    assert survey(MOE, launch="cpu")["flags"]["stops"]  # --launch wins over the variable
    monkeypatch.setenv("MEGAPATCH_LAUNCH", "tpu")
    result = survey(MOE)
    assert result["result"]["code"] == 1 and "MEGAPATCH_LAUNCH='tpu' is not a launch the doctor knows" in \
        "; ".join(result["problems"])


def test_the_launch_flag_of_doctor_and_status_reaches_the_survey(capsys):
    from megapatch.commands.cli import main

    import megatron.core  # noqa: F401

    assert main(["status", "--json", "--launch", "cpu-te", "--", *MOE]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["launch"] == {"name": "cpu-te", "from": "--launch"} and data["flags"]["stops"] == [], data["flags"]
    with pytest.raises(SystemExit) as usage:
        main(["doctor", "--launch", "tpu", "--", *MOE])
    assert usage.value.code == 2


def test_the_runtime_answers_the_capability_the_doctor_says_it_does():
    from megapatch.commands.upstream_stops import LAUNCHES
    from megapatch.testing.stand_ins.te_cpu_attention import COMPUTE_CAPABILITY

    assert COMPUTE_CAPABILITY[0] >= 8 and f"get_device_capability() {tuple(COMPUTE_CAPABILITY)}" in LAUNCHES["cpu-te"]


def test_megapatchs_own_checks_are_listed_after_an_upstream_stop(monkeypatch):
    """Grouped GEMM with local layers on the plain CPU launch: upstream stops it first, and the mode
    would refuse it too (the grouped_gemm package's GroupedMLP); the doctor says both."""
    import megatron.core  # noqa: F401

    _no_cuda()
    monkeypatch.setenv("MEGAPATCH_TP_INVARIANT", "1")
    result = survey(MOE + ["--disable-bias-linear"], launch="cpu")
    assert result["flags"]["stops"] and list(result["flags"]["refusals"]) == ["tp_invariant.construction"]
    assert "grouped-GEMM experts without Transformer Engine" in result["flags"]["refusals"]["tp_invariant.construction"]
    text = render_doctor(result)
    assert text.index("STOPS FIRST, upstream: --moe-grouped-gemm") < text.index("megapatch's own checks, run all "
                                                                                "the same") < text.index("REFUSED by")
    monkeypatch.delenv("MEGAPATCH_TP_INVARIANT")
    plain = survey(MOE, launch="cpu")
    assert plain["result"]["message"].endswith("--moe-grouped-gemm without CUDA; megapatch's own checks refuse "
                                               "nothing more (exit 1)"), plain["result"]


def test_the_cpu_launcher_tells_the_doctor_its_launch_and_the_variable_activates_nothing(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nfrom megapatch.commands.doctor import survey\n"
                      "result = survey(sys.argv[1:])\n"
                      "print('LAUNCH', os.environ['MEGAPATCH_LAUNCH'], result['launch'], result['flags']['stops'])\n")
    flags = ["--num-attention-heads", "4", "--transformer-impl", "local", "--num-experts", "4", "--moe-grouped-gemm"]
    launched = run_python(f"import sys; sys.argv = ['cpu_launch', {str(script)!r}, *{flags!r}]\n"
                          "from megapatch.testing.ranks import cpu_launch\ncpu_launch.main()")
    assert launched.returncode == 0, launched.stderr[-3000:]
    said = launched.stdout
    assert "LAUNCH cpu {'name': 'cpu', 'from': 'MEGAPATCH_LAUNCH'}" in said and "--moe-grouped-gemm without CUDA" in said, said
    alone = run_python("import megatron.core, megapatch; print('ENABLED', megapatch.is_enabled())",
                       env={"MEGAPATCH_LAUNCH": "cpu-te"}, fresh=False)
    assert alone.returncode == 0 and "ENABLED False" in alone.stdout, alone.stdout + alone.stderr[-2000:]
    assert "not a megapatch variable" not in alone.stderr, alone.stderr


# -- N21: the upstream stop "EP > 1 without --num-experts" -------------------------------------------

def test_expert_parallelism_without_experts_is_upstreams_stop_not_a_megapatch_refusal(monkeypatch):
    """Audit survivor N21: without that stop the doctor blamed ``tp_invariant.construction`` (its
    allgather-dispatcher refusal of EP > 1) for a job Megatron-LM's validate_args stops first."""
    import megatron.core  # noqa: F401

    monkeypatch.setenv("MEGAPATCH_TP_INVARIANT", "1")
    result = survey(TINY + ["--expert-model-parallel-size", "2"])
    cause = "--expert-model-parallel-size 2 without --num-experts"
    assert result["flags"]["stop_causes"] == [cause], result["flags"]
    assert result["result"]["message"].startswith(
        f"with these Megatron-LM flags the job would stop before its first step: {cause}"), result["result"]
    assert "Number of experts should be a multiple of expert model parallel_size" in result["flags"]["stops"][0]


# -- item 3: --attention-backend under the mode --------------------------------------------------------

def test_a_chosen_attention_backend_is_accepted_with_a_line_saying_what_runs_instead(monkeypatch):
    import megatron.core  # noqa: F401

    monkeypatch.setenv("MEGAPATCH_TP_INVARIANT", "1")
    chosen = TINY[:7] + ["4096"] + TINY[8:] + ["--num-attention-heads", "32", "--hidden-size", "1024",
                                               "--tensor-model-parallel-size", "2"]
    flags = chosen + ["--attention-backend", "flash"]
    result = survey(flags)
    assert result["result"]["code"] == 0 and result["flags"]["refusals"] == {}, result["result"]
    note = result["flags"]["notes"]["tp_invariant.construction"]
    for words in ("--attention-backend flash is accepted, but core attention runs as the mode's attention instead "
                  "of flash attention", "FP32 products over 128-query by 64-key blocks, recomputed in the backward",
                  "2 MiB at --seq-length 4096, 32 MiB a layer and sequence for the 16 heads of a TP rank",
                  "memory growing as S x 128, not S x S",
                  "docs/tp_invariant.md"):
        assert words in note, (words, note)
    assert f"  NOTE from tp_invariant.construction (the job logs it too): {note}" in render_doctor(result)
    assert survey(chosen)["flags"]["notes"] == {}  # auto, the default: nothing chosen, nothing said
    assert survey(chosen + ["--attention-backend", "auto"])["flags"]["notes"] == {}
    monkeypatch.delenv("MEGAPATCH_TP_INVARIANT")
    assert survey(flags)["flags"]["notes"] == {}  # the mode off: flash runs


def test_packed_bins_are_accepted_with_a_line_saying_what_packing_under_the_mode_gives_and_what_not(monkeypatch):
    """Issue 49: ``--rl-use-sequence-packing`` under the mode runs (each sequence attended and rotated alone,
    its gradients cut); the doctor says so and what it needs to equal an unpacked step -- the line the job
    logs at its first bin of several sequences (tests/test_tp_invariant_attention_blocks.py) -- and, for
    a model with experts, that their gradients are not cut yet."""
    import megatron.core  # noqa: F401

    from megapatch.patches.tp_invariant.attention import packing_line

    monkeypatch.setenv("MEGAPATCH_TP_INVARIANT", "1")
    result = survey(TINY + ["--rl-use-sequence-packing"])
    assert result["result"]["code"] == 0 and result["flags"]["refusals"] == {}, result["result"]
    note = result["flags"]["notes"]["tp_invariant.attention"]
    assert list(result["flags"]["notes"]) == ["tp_invariant.attention"] and note == packing_line(None)
    for words in ("attended and RoPE-rotated alone", "agree bit for bit", "--calculate-per-token-loss",
                  "context parallelism stays refused"):
        assert words in note, words
    assert "MoE" not in note
    assert f"NOTE from tp_invariant.attention (the job logs it too): {note}" in render_doctor(result)
    moe = survey(TINY + ["--rl-use-sequence-packing", "--num-experts", "4", "--moe-token-dispatcher-type",
                         "alltoall", "--disable-bias-linear"])["flags"]["notes"].get("tp_invariant.attention", "")
    assert "router and routed experts are not cut per sequence yet" in moe, moe
    assert survey(TINY)["flags"]["notes"] == {}
    refused = survey(TINY + ["--rl-use-sequence-packing", "--context-parallel-size", "2"])
    assert "--context-parallel-size" in refused["flags"]["refusals"]["tp_invariant.construction"], refused["flags"]
    monkeypatch.delenv("MEGAPATCH_TP_INVARIANT")
    assert survey(TINY + ["--rl-use-sequence-packing"])["flags"]["notes"] == {}
