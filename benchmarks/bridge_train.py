"""A few training steps through Megatron-Bridge's own training entry (``pretrain`` with the recipe
base's mock data, ``megapatch/testing/scenarios/bridge_train.py``) on CPU ranks, per megapatch mode switched
by ``MEGAPATCH_*`` only; writes a markdown table (``--out``) that ``benchmarks/bridge_llama.py
--train-table`` appends to results/bridge.md.

    python benchmarks/bridge_train.py --out /tmp/bridge_train.md     # in a Bridge venv, ~6 min
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from llama_hf import MODEL  # noqa: E402

from megapatch.testing.scenarios import llama_hf as L  # noqa: E402
from megapatch.testing.ranks import megatron_lm_runs as mlm  # noqa: E402

ITERS = 5
SCRIPT = REPO / "megapatch" / "testing" / "scenarios" / "bridge_train.py"
NO_CE_FUSION = ("--cross-entropy-fusion", "0")
#: (column, TP, MEGAPATCH_* of the launch, script flags); two ranks each (TP 1: data parallel 2).
#: tp_invariant needs cross_entropy_loss_fusion off (Bridge's default is on; the mode refuses it)
RUNS = [
    ("TP1 native", 1, {}, ()),
    ("TP2 native", 2, {}, ()),
    ("TP2 fp32", 2, {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}, ()),
    ("TP1 native, no CE fusion", 1, {}, NO_CE_FUSION),
    ("TP2 native, no CE fusion", 2, {}, NO_CE_FUSION),
    ("TP1 tp_invariant", 1, {"MEGAPATCH_TP_INVARIANT": "1"}, NO_CE_FUSION),
    ("TP2 tp_invariant", 2, {"MEGAPATCH_TP_INVARIANT": "1"}, NO_CE_FUSION),
]
_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")


def parse(log: str) -> dict:
    """``{iteration: (lm loss, grad norm)}`` as Bridge's training_log prints them."""
    return {int(i): (loss, norm) for i, loss, norm in _LINE.findall(log)}


def launch(hf, tp: int, env: dict, iters: int = ITERS, timeout: float = 900.0, nproc: int = 2,
           extra=()) -> mlm.Run:
    """``torchrun --nproc-per-node NPROC -m megapatch.testing.ranks.cpu_launch --bridge bridge_train.py``
    (data parallel NPROC / TP)."""
    flags = ["--hf", str(hf), "--tp", str(tp), "--iters", str(iters), *extra]
    with tempfile.TemporaryDirectory(prefix="bridge-train-") as cwd:  # Bridge writes nemo_experiments/ here
        return mlm.launch(Path(cwd), flags, nproc=nproc, megapatch_env=env, timeout=timeout,
                          entry=["-m", "megapatch.testing.ranks.cpu_launch", "--bridge"], script=str(SCRIPT),
                          extra_env={"PYTHONPATH": str(REPO)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results, commands, seconds = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="bridge-train-hf-") as tmp:
        hf = Path(tmp) / "hf_llama"
        L.build_tiny_hf(hf, **MODEL)
        for column, tp, env, extra in RUNS:
            run = launch(hf, tp, env, extra=extra)
            steps = parse(run.log)
            if run.returncode != 0 or len(steps) != ITERS:
                raise SystemExit(f"{column} failed ({run.returncode}):\n{run.tail()}")
            for name in env:
                option = name[len("MEGAPATCH_"):].lower()
                if not re.search(rf"{option}=\S+ \(env {name}\)", run.log):
                    raise SystemExit(f"{column}: no 'megapatch enabled' line from {name}:\n{run.tail()}")
            results[column], seconds[column] = steps, run.seconds
            prefix = " ".join(f"{k}={v}" for k, v in env.items())
            commands[column] = (prefix + " " if prefix else "") + shlex.join(
                ["torchrun", *run.command[3:]]).replace(str(hf), "HF_DIR")
            print(f"{column}: {run.seconds:.0f} s", flush=True)
    columns = list(results)
    lines = [
        f"## Training through Bridge's own entry ({ITERS} steps of `pretrain`, mock data)",
        "",
        f"Produced by `{shlex.join(['python', 'benchmarks/bridge_train.py', *sys.argv[1:]])}`. "
        "`megapatch/testing/scenarios/bridge_train.py`: Bridge's recipe base `recipes.common._pretrain_common()` "
        "(mock GPT data) with `cfg.model` = the AutoBridge provider of the Llama above (HF weights "
        "loaded; local layer spec, CUDA fusions off, BF16), then `megatron.bridge.training.pretrain"
        ".pretrain(cfg, gpt_step.forward_step)`. Overridden for CPU: gloo, micro batch 2, global batch "
        "4, sequence 128, constant lr 1e-5, plain Adam without the distributed optimizer or "
        "overlapped communication, no checkpoints, no evaluation, no tensorboard. Two CPU ranks per "
        "run (TP1 = data parallel 2) under `torchrun -m megapatch.testing.ranks.cpu_launch --bridge` (the "
        "stand-ins of `megapatch/testing/stand_ins/bridge_compat.py` `TRAINING_WORKAROUNDS` plus the "
        "launcher's usual ones). `lm loss` / grad norm as Bridge prints them.",
        "",
        "| iteration | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for i in range(1, ITERS + 1):
        lines.append(f"| {i} | " + " | ".join(f"{results[c][i][0]} / {results[c][i][1]}" for c in columns) + " |")
    ref = results["TP1 native"]
    lines.append("| **iterations printing TP1 native's loss** | " + " | ".join(
        f"{sum(results[c][i][0] == ref[i][0] for i in ref)}/{ITERS}" for c in columns) + " |")
    inv1, inv2 = results["TP1 tp_invariant"], results["TP2 tp_invariant"]
    same = sum(inv1[i] == inv2[i] for i in inv1)
    nat = sum(results["TP1 native, no CE fusion"][i] == results["TP2 native, no CE fusion"][i] for i in inv1)
    lines += ["", f"* tp_invariant: TP2 prints TP1's loss and grad norm at {same}/{ITERS} steps "
                  f"(native TP2 vs TP1, same settings: {nat}/{ITERS}). With Bridge's default "
                  "`cross_entropy_loss_fusion=True` tp_invariant is refused at model construction "
                  "(before this change it ran and TP2 printed other losses than TP1 from step 2 on).",
              "", "Timings (wall seconds, 2 ranks on 2 cores, Bridge import included): "
              + ", ".join(f"{c} {seconds[c]:.0f}" for c in columns) + ".", "", "Commands:", ""]
    lines += [f"* {c}: `{commands[c]}`" for c in columns]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
