"""What stops a Megatron-LM job before any megapatch check could (``megapatch doctor -- <flags>``):
Megatron-LM's default Transformer Engine layers where TE is not installed, Megatron-LM's and
megatron-core's own checks of MoE flags (grouped GEMM without CUDA, experts that the expert
parallel size does not divide, fused permutation without TE), and a module the job's script imports
that cannot be imported here (``megatron.rl.rl_utils`` without ``tensorboard``).

The launch (``megapatch doctor --launch``, else ``MEGAPATCH_LAUNCH``, which the CPU launcher sets
in its ranks) says what answers upstream's CUDA questions: see ``LAUNCHES``. Which modules a job
imports: ``job_imports`` (its script's own module-level imports, and the flags of ``CLIENT_FLAGS``)."""

from __future__ import annotations

import ast
import importlib.util
import os
from typing import Dict, List, Optional, Sequence, Tuple

from megapatch.core.options import LAUNCH_ENV

_STOPS_FIRST = " (this stops the job before any megapatch check)"

#: how the job is launched -> what answers upstream's CUDA questions there
LAUNCHES = {
    "here": "this machine: torch.cuda as it answers here",
    "cuda": "GPUs: a CUDA launch (the doctor run elsewhere, e.g. on a login node without one)",
    "cpu": "megapatch.testing.ranks.cpu_launch: CPU ranks, no CUDA",
    "cpu-te": "megapatch.testing.ranks.cpu_launch --te: CPU ranks with the labelled Transformer Engine "
              "runtime, which answers torch.cuda.is_available() and get_device_capability() (8, 0)",
}


def launch_of(given: Optional[str], environ=None) -> Tuple[str, str]:
    """``(launch, where it came from)``: ``given`` (``--launch``), else ``MEGAPATCH_LAUNCH``, else
    ``here``. Raises ValueError naming the valid values for another one."""
    environ = os.environ if environ is None else environ
    value, origin = (given, "--launch") if given else (environ.get(LAUNCH_ENV), LAUNCH_ENV)
    if value is None:
        return "here", "default"
    if value not in LAUNCHES:
        raise ValueError(f"{origin}={value!r} is not a launch the doctor knows: {', '.join(LAUNCHES)}")
    return value, origin


def _cuda_answers(launch: str) -> bool:
    """Whether upstream's ``torch.cuda`` questions (``is_available``, ``get_device_capability``)
    are answered in this launch, as a GPU of compute capability >= 8.0 would."""
    if launch == "here":
        return _cuda_available()
    return launch in ("cuda", "cpu-te")


def _upstream_stop_causes(config, launch: str = "here") -> List[tuple]:
    """``[(cause in a few words, the whole reason), ...]``: what stops the flags' job before any
    megapatch check could. Megatron-LM's default Transformer Engine layers where TE is not
    installed (the rule the run applies itself where megapatch is active:
    ``patches.cross_rank.transformer_engine_stop``), and Megatron-LM core_v0.16.1's own checks of
    MoE flags, which run before megatron-core's model-parallel state exists (``validate_args``,
    then ``TransformerConfig.__post_init__``): megapatch never gets to refuse those jobs."""
    from megapatch.patches.cross_rank.publish_settings import transformer_engine_missing, transformer_engine_stop

    found = []  # in the order upstream meets them
    experts, ep = getattr(config, "num_moe_experts", None), getattr(config, "expert_model_parallel_size", 1) or 1
    if getattr(config, "moe_grouped_gemm", False) and not _cuda_answers(launch):
        cause = "--moe-grouped-gemm without CUDA"
        where = "on a machine without CUDA" if launch == "here" else f"in the launch {launch} ({LAUNCHES[launch]})"
        found.append((cause, f"{cause}: Megatron-LM's validate_args asks torch.cuda for the GPU's compute "
                             f"capability (grouped GEMM needs >= 8.0) and fails {where}. Leave "
                             f"--moe-grouped-gemm off there, or launch with cpu_launch --te (--launch cpu-te), "
                             f"whose Transformer Engine runtime answers it"))
    if ep > 1 and (not experts or experts % ep):
        cause = (f"--num-experts {experts} is not a multiple of --expert-model-parallel-size {ep}" if experts
                 else f"--expert-model-parallel-size {ep} without --num-experts")
        found.append((cause, f"{cause}: Megatron-LM's validate_args refuses it (AssertionError: \"Number of experts "
                             f"should be a multiple of expert model parallel_size\"). Use a number of experts "
                             f"that {ep} divides, or another --expert-model-parallel-size"))
    if getattr(config, "moe_permute_fusion", False) and not _fused_permute_available():
        cause = "--moe-permute-fusion without Transformer Engine"
        found.append((cause, f"{cause}: megatron-core's TransformerConfig refuses it (ValueError: fused "
                             f"permutation is not available. Please install TE >= 2.1.0; or an ImportError "
                             f"of fused_permute where megatron-core has no such function). Leave "
                             f"--moe-permute-fusion off, or install transformer-engine >= 2.1"))
    stop = transformer_engine_stop(config)
    if stop:
        found.append((transformer_engine_missing(config), stop))
    return found


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 -- no torch, or a broken CUDA runtime: no GPU for upstream either
        return False


def _fused_permute_available() -> bool:
    """Whether megatron-core's MoE utilities have Transformer Engine's fused permutation (upstream's
    own record where it can be imported, else whether TE can be found)."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception:  # noqa: BLE001 -- no megatron here: TE is what upstream would need
        return importlib.util.find_spec("transformer_engine") is not None
    return all(getattr(moe_utils, name, None) is not None for name in ("fused_permute", "fused_unpermute"))


def _stop_lines(causes: List[tuple]) -> List[str]:
    return [f"{stop}{_STOPS_FIRST}" for _, stop in causes]


def _upstream_stops(config) -> List[str]:
    """What stops the flags' job before any megapatch check could, each reason in full."""
    return _stop_lines(_upstream_stop_causes(config))



# -- the modules a job imports, and those that cannot be imported here ---------------------------

#: Megatron-LM flags whose job imports a client's module whatever its script: core_v0.16.1's training
#: loop asserts ``has_rl_utils`` with ``--perform-rl-step`` ("RL cannot run without the megatron.rl package")
CLIENT_FLAGS = {"--perform-rl-step": ("megatron.rl.rl_utils",)}


def split_script(argv: Sequence[str]) -> Tuple[Optional[str], List[str]]:
    """``(script, flags)``: a command line may start with the job's script (``train_rl.py --flags``,
    as after ``torchrun``): a first argument ending in ``.py`` that is not a flag."""
    argv = list(argv)
    if argv and argv[0].endswith(".py") and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return None, argv


def _catches_import_errors(handler: ast.ExceptHandler) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return handler.type is None or any(isinstance(k, ast.Name) and k.id in names for k in kinds)


def _imports_at_start(body, found: Dict[str, int]) -> None:
    for node in body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.setdefault(node.module, node.lineno)
            for alias in node.names:  # ``from megatron.rl import rl_utils`` imports the submodule
                found.setdefault(f"{node.module}.{alias.name}", node.lineno)
        elif isinstance(node, ast.Try):  # a guarded import (``except ImportError``) does not stop the job
            if not any(_catches_import_errors(h) for h in node.handlers):
                _imports_at_start(node.body, found)
            _imports_at_start(node.orelse + node.finalbody, found)
        elif isinstance(node, (ast.If, ast.With, ast.For, ast.While, ast.ClassDef)):
            _imports_at_start(node.body + getattr(node, "orelse", []), found)


def script_imports(path: str) -> Dict[str, int]:
    """``{module: line}``: what the script imports as it starts -- its own module-level imports (in
    ``if``/``with`` blocks and class bodies too), not those inside functions or in a ``try`` whose
    ``except`` catches ImportError, and not those of the modules it imports."""
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), filename=path)
    found: Dict[str, int] = {}
    _imports_at_start(tree.body, found)
    return found


def job_imports(script: Optional[str], argv: Sequence[str]) -> Dict[str, str]:
    """``{module: how the job imports it}`` from its script (``script_imports``) and its flags
    (``CLIENT_FLAGS``). Raises OSError/SyntaxError for a script that cannot be read."""
    found: Dict[str, str] = {}
    if script is not None:
        name = os.path.basename(script)
        found.update({module: f"{name} (line {line})" for module, line in script_imports(script).items()})
    given = set(a.split("=", 1)[0] for a in argv)
    for flag, modules in CLIENT_FLAGS.items():
        if flag in given:
            for module in modules:
                found.setdefault(module, f"{flag} (Megatron-LM's training loop needs it)")
    return found


def imported_by(module: str, imports: Dict[str, str]) -> Optional[str]:
    """How the job imports ``module`` (itself, or a module inside it), or None."""
    for name, how in imports.items():
        if name == module or name.startswith(module + "."):
            return how
    return None


def client_stops(rows: List[dict], imports: Dict[str, str]) -> List[tuple]:
    """A patch whose module cannot be imported here (the doctor's rows with ``unimportable``: the
    reason) applies only to a job that imports that module (``imports``: ``job_imports``): that job
    stops at the import, upstream; any other runs without the patch. Says which in each row's
    ``why``; returns ``[(cause, reason), ...]``, one per module the job imports."""
    found: Dict[str, tuple] = {}
    for row in rows:
        module, error = row["hook"], row["unimportable"]
        how = imported_by(module, imports)
        if how is None:
            row["why"] = (f"this job does not import {module} (its script's own imports, its flags), which "
                          f"cannot be imported here ({error}): the patch does not apply to it")
            continue
        row["why"] = f"this job imports {module} ({how}), which cannot be imported here: it stops there, upstream"
        cause = f"{module} cannot be imported here"
        found.setdefault(module, (cause, f"{cause} ({error}), and the job imports it: {how}. It stops at that "
                                         f"import, upstream (ImportError). Install what the import lacks, or run "
                                         f"a script that does not import it"))
    return list(found.values())
