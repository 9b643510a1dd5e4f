"""The same training steps at other parallel layouts: Megatron-LM's ``pretrain_gpt.py`` trains one
global batch per step at several (TP, DP, PP, micro-batch size) layouts, saving a ``torch_dist``
checkpoint at the end; the runs are compared in their printed losses and grad norms, the
full-precision grad norms the test probe records, and every tensor of the final checkpoint
(parameters, FP32 main parameters, Adam moments) read back at its global shape
(``tp_resume.differences``).

Nothing here imports torch at module level; each run is a ``torchrun`` job.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from megapatch.testing.ranks import megatron_lm_runs as mlm
from megapatch.testing.scenarios import tp_resume

#: a Llama-shaped GPT (SwiGLU, RMSNorm, RoPE, GQA, untied head); vocab 255 + EOD pads to 256 rows
#: at TP 1, 2 and 4
LLAMA = ("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "4", "--num-attention-heads", "8",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--no-bias-swiglu-fusion",
         "--make-vocab-size-divisible-by", "32", "--ckpt-format", "torch_dist", "--clip-grad", "0.05")
MODEL = dict(hidden=64, layers=4, vocab=255, lr=3e-3, seq=32)
#: with ``LLAMA``: a Qwen3-MoE-shaped layer (8 experts top-2, QK RMSNorm, aux and z losses, alltoall)
MOE = ("--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--qk-layernorm",
       "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-z-loss-coeff", "1e-3",
       "--moe-token-dispatcher-type", "alltoall")
_GRAD_NORM = re.compile(r"iteration\s+(\d+)/.*?grad norm: ([0-9.eE+-]+)")


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    dp: int = 1
    pp: int = 1
    mbs: int = 1

    @property
    def label(self) -> str:
        return f"tp{self.tp}-dp{self.dp}-pp{self.pp}-mbs{self.mbs}"

    @property
    def nproc(self) -> int:
        return self.tp * self.dp * self.pp


@dataclasses.dataclass
class LayoutRun:
    layout: Layout
    run: mlm.Run
    losses: Dict[int, str]        # printed, by iteration
    grad_norms: Dict[int, str]    # printed, by iteration
    exact_norms: List[str]        # the probe's full-precision norms (hex), one per step
    checkpoint: Path

    def tensors(self):
        return tp_resume.checkpoint_tensors(self.checkpoint)


def flags(layout: Layout, iters: int, global_batch: int, extra: Sequence[str] = (),
          llama: Sequence[str] = LLAMA) -> List[str]:
    return mlm.tiny_gpt_flags(tp=layout.tp, pp=layout.pp, micro_batch=layout.mbs, global_batch=global_batch,
                              iters=iters, **MODEL, extra=[*llama, *extra])


def train(checkout: Path, workdir: Path, layout: Layout, env: Mapping[str, str], *, probe: str,
          iters: int = 3, global_batch: int = 12, extra: Sequence[str] = (), label: str = "",
          load: Optional[Path] = None, save_interval: Optional[int] = None,
          timeout: float = 600.0, llama: Sequence[str] = LLAMA, launcher: Sequence[str] = ()) -> LayoutRun:
    """One job at ``layout``, saving its final checkpoint (and every ``save_interval`` iterations);
    ``load``: a checkpoint directory to resume from (copied first, so runs never share one); ``llama``: the
    model flags (default: the Llama flags above); ``launcher``: the CPU launcher's own options
    (``--te``: Transformer Engine's kernels on CPU)."""
    name = f"{label or 'run'}-{layout.label}"
    save = workdir / name
    probe_dir = workdir / "probes" / name
    probe_dir.mkdir(parents=True)
    more = [*extra, "--save", str(save), "--save-interval", str(save_interval or iters)]
    if load is not None:
        shutil.copytree(load, save, dirs_exist_ok=True)
        more += ["--load", str(save)]
    run = mlm.launch(checkout, flags(layout, iters, global_batch, more, llama), nproc=layout.nproc,
                     megapatch_env=env, entry=[probe, *launcher], timeout=timeout,
                     extra_env={"MEGATRON_LM_PROBE_DIR": str(probe_dir)})
    (workdir / f"{name}.log").write_text(run.log)
    if run.returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(run.command)} exited {run.returncode}\n{run.tail()}")
    norms_file = probe_dir / "norms-rank0.jsonl"
    exact = ([json.loads(line)["grad_norm"] for line in norms_file.read_text().splitlines()]
             if norms_file.is_file() else [])
    return LayoutRun(layout, run, run.losses, {int(i): v for i, v in _GRAD_NORM.findall(run.log)}, exact,
                     save / f"iter_{iters:07d}")


def experiment(checkout: Path, workdir: Path, env: Mapping[str, str], layouts: Sequence[Layout], *,
               probe: str, base: Layout = Layout(), save_at: int = 1, iters: int = 3,
               global_batch: int = 12, extra: Sequence[str] = (), label: str = "run",
               start: Optional[Path] = None, timeout: float = 600.0,
               llama: Sequence[str] = LLAMA, launcher: Sequence[str] = ()) -> Dict[str, LayoutRun]:
    """``full``: ``iters`` iterations at ``base``, saving at ``save_at`` (Megatron-LM seeds each
    pipeline stage's initial weights differently, so layouts are compared from one checkpoint);
    ``<layout label>``: resumed from that checkpoint (or ``start``) to ``iters`` at each layout."""
    workdir.mkdir(parents=True, exist_ok=True)
    runs: Dict[str, LayoutRun] = {}
    if start is None:
        runs["full"] = train(checkout, workdir, base, env, probe=probe, iters=iters, global_batch=global_batch,
                             extra=extra, label=f"{label}-full", save_interval=save_at, timeout=timeout,
                             llama=llama, launcher=launcher)
        start = runs["full"].checkpoint.parent
    for layout in layouts:
        source = workdir / f"{label}-start-{layout.label}"
        shutil.copytree(start / f"iter_{save_at:07d}", source / f"iter_{save_at:07d}")
        (source / "latest_checkpointed_iteration.txt").write_text(str(save_at))
        runs[layout.label] = train(checkout, workdir, layout, env, probe=probe, iters=iters,
                                   global_batch=global_batch, extra=extra, label=label, load=source,
                                   timeout=timeout, llama=llama, launcher=launcher)
    return runs
