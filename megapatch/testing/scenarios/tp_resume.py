"""Change the TP size in the middle of a run: Megatron-LM's ``pretrain_gpt.py`` trains at one TP
size and saves a ``torch_dist`` checkpoint, then resumes from it at other TP sizes (optimizer state
included); the runs are compared as tensors, not as printed digits.

* losses: the per-token losses reaching megatron's cross entropy, hashed by the test probe
  (``tests/scripts/megatron_lm_probe.py``) at every micro-batch of every iteration;
* parameters and optimizer state: the final checkpoint of each run read back as full tensors
  (``torch.distributed.checkpoint``'s ``dcp_to_torch_save``: a torch_dist checkpoint stores global
  shapes, whatever TP size wrote it);
* grad norms and losses as Megatron-LM prints them.

Nothing here imports torch at module level; each run is a ``torchrun`` job
(:mod:`megapatch.testing.ranks.megatron_lm_runs`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from megapatch.testing.ranks import megatron_lm_runs as mlm

#: a GELU GPT with LayerNorm; vocab 255 + EOD pads to 256 rows at TP 1, 2 and 4
#: (``--make-vocab-size-divisible-by 32``: 32 x TP divides 256), so every TP size loads the same
#: embedding shape from the checkpoint
MODEL = dict(hidden=64, layers=2, vocab=255, lr=3e-3)
EXTRA = ("--make-vocab-size-divisible-by", "32", "--ckpt-format", "torch_dist")
_GRAD_NORM = re.compile(r"iteration\s+(\d+)/.*?grad norm: ([0-9.eE+-]+)")


@dataclasses.dataclass
class ResumeRun:
    label: str
    tp: int
    run: mlm.Run
    losses: Dict[int, str]       # printed, by iteration
    grad_norms: Dict[int, str]   # printed, by iteration
    loss_hashes: List[str]       # per-token losses, one hash per micro-batch (rank 0's record)
    checkpoint: Path             # the final iteration's checkpoint directory

    def tensors(self):
        return checkpoint_tensors(self.checkpoint)


def flags(tp: int, iters: int, extra: Sequence[str] = ()) -> List[str]:
    return mlm.tiny_gpt_flags(tp=tp, iters=iters, **MODEL, extra=[*EXTRA, *extra])


def _launch(checkout: Path, workdir: Path, label: str, tp, iters: int, env: Mapping[str, str],
            save: Path, load: Optional[Path], save_interval: int, probe: str, timeout: float,
            flags_extra: Sequence[str] = (), layout: Optional["Layout"] = None) -> ResumeRun:
    probe_dir = workdir / "probes" / label
    probe_dir.mkdir(parents=True)
    extra = [*flags_extra, "--save", str(save), "--save-interval", str(save_interval)]
    if load is not None:
        extra += ["--load", str(load)]
    layout = layout or Layout()
    run = mlm.launch(checkout, layout.flags(tp, iters, extra), nproc=layout.nproc(tp), megapatch_env=env,
                     entry=[probe], timeout=timeout, extra_env={"MEGATRON_LM_PROBE_DIR": str(probe_dir)})
    (workdir / f"{label}.log").write_text(run.log)
    if run.returncode != 0:
        raise RuntimeError(f"{label}: {' '.join(run.command)} exited {run.returncode}\n{run.tail()}")
    records = [json.loads(line) for line in (probe_dir / "rank0.jsonl").read_text().splitlines()]
    norms = {int(i): v for i, v in _GRAD_NORM.findall(run.log)}
    return ResumeRun(label, tp, run, run.losses, norms, [r["loss"] for r in records],
                     save / f"iter_{iters:07d}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a run's parallel layout becomes flags and ranks: by default a TP size (the GELU GPT of
    ``MODEL`` on TP ranks); a caller's ``flags_for(layout, iters, extra)`` and ``nproc_for(layout)``
    for other layouts and models (a MoE's ``(tp, ep)`` at a fixed data-parallel size)."""

    flags_for: Optional[object] = None
    nproc_for: Optional[object] = None

    def flags(self, layout, iters: int, extra: Sequence[str]) -> List[str]:
        return flags(layout, iters, extra) if self.flags_for is None else self.flags_for(layout, iters, extra)

    def nproc(self, layout) -> int:
        return layout if self.nproc_for is None else self.nproc_for(layout)


def _name(layout) -> str:
    return "x".join(map(str, layout)) if isinstance(layout, tuple) else str(layout)


def experiment(checkout: Path, workdir: Path, env: Mapping[str, str], *, probe: str,
               train_tp=2, resume_tps: Sequence = (2, 4, 1), save_at: int = 3,
               iters: int = 6, timeout: float = 600.0, label: str = "run",
               start: Optional[Path] = None, extra: Sequence[str] = (),
               layout: Optional[Layout] = None) -> Dict[str, ResumeRun]:
    """``full``: ``iters`` iterations at ``train_tp``, saving at ``save_at`` and at the end;
    ``resume<t>``: from that run's ``save_at`` checkpoint (or ``start``, a directory holding one)
    to ``iters`` at TP ``t`` (a ``layout``'s layout: ``resume1x2`` for ``(1, 2)``). ``extra``: more
    ``pretrain_gpt.py`` flags for every run (e.g. ``--use-distributed-optimizer``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    runs: Dict[str, ResumeRun] = {}
    if start is None:
        full = workdir / f"{label}-full"
        runs["full"] = _launch(checkout, workdir, f"{label}-full", train_tp, iters, env, full, None,
                               save_at, probe, timeout, extra, layout)
        start = full
    for tp in resume_tps:
        directory = workdir / f"{label}-resume{_name(tp)}"
        shutil.copytree(start / f"iter_{save_at:07d}", directory / f"iter_{save_at:07d}")
        (directory / "latest_checkpointed_iteration.txt").write_text(str(save_at))
        runs[f"resume{_name(tp)}"] = _launch(checkout, workdir, f"{label}-resume{_name(tp)}", tp, iters, env,
                                             directory, directory, iters, probe, timeout, extra, layout)
    return runs


def checkpoint_tensors(directory: Path) -> Dict[str, "object"]:
    """Every tensor of a torch_dist checkpoint at its global shape (model and optimizer state)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(directory), str(path))
        state = torch.load(path, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def differences(a: Mapping[str, "object"], b: Mapping[str, "object"]) -> Dict[str, float]:
    """``{key: max |a - b|}`` for every tensor that is not bit-identical (shapes must agree)."""
    import torch

    if set(a) != set(b):
        raise ValueError(f"the checkpoints hold different tensors: {sorted(set(a) ^ set(b))[:5]}")
    found = {}
    for key in sorted(a):
        if a[key].shape != b[key].shape:
            raise ValueError(f"{key}: shape {tuple(a[key].shape)} vs {tuple(b[key].shape)}")
        if not torch.equal(a[key], b[key]):
            found[key] = (a[key].double() - b[key].double()).abs().max().item()
    return found
