"""What real runs switch on, under ``tp_invariant``, through Megatron-LM's own ``pretrain_gpt.py``
on CPU ranks: sequence parallelism and the distributed optimizer (DP 1 and 2), per TP size, with and
without the mode. For each configuration and TP size: the printed losses and grad norms, a hash of
every per-token loss of rank 0 (each micro-batch), and the grad norms as clipping reads them (full
precision, the probe's record). Writes ``results/tp_invariant_megatron_lm.md``.

    python benchmarks/tp_invariant_megatron_lm.py [--megatron-lm DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megapatch.testing.ranks import megatron_lm_runs as mlm  # noqa: E402

PROBE = str(REPO / "tests" / "scripts" / "megatron_lm_probe.py")
ITERS = 6
# vocab 511 (+1 EOD) pads to 512 rows at TP 1, 2 and 4: the same initial model at every TP size
FLAGS = dict(iters=ITERS, hidden=64, layers=2, vocab=511, lr=3e-3)
LLAMA = ("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "4", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--no-bias-swiglu-fusion")
MODES = {"native": {}, "tp_invariant": {"MEGAPATCH_TP_INVARIANT": "1"}}
# (configuration, extra flags, data-parallel size, TP sizes); TP=1 never has SP (Megatron-LM turns it
# off); native runs at the first two TP sizes only (enough to show the drift)
CONFIGS = (
    ("GELU GPT, --sequence-parallel", (), 1, (1, 2, 4)),
    ("Llama flags, --sequence-parallel", LLAMA, 1, (1, 2, 4)),
    ("GELU GPT, --use-distributed-optimizer", ("--use-distributed-optimizer",), 1, (1, 2, 4)),
    ("GELU GPT, --use-distributed-optimizer, DP=2", ("--use-distributed-optimizer",), 2, (1, 2)),
    ("Llama flags, --sequence-parallel --use-distributed-optimizer, DP=2",
     LLAMA + ("--use-distributed-optimizer",), 2, (1, 2)),
)


def _sp(config: str, tp: int):
    return ("--sequence-parallel",) if "--sequence-parallel" in config and tp > 1 else ()


def _run(checkout: Path, work: Path, label: str, flags, nproc: int, env):
    probe_dir = work / label
    probe_dir.mkdir(parents=True)
    run = mlm.launch(checkout, flags, nproc=nproc, megapatch_env=env, entry=[PROBE], timeout=900,
                     extra_env={"MEGATRON_LM_PROBE_DIR": str(probe_dir)})
    if run.returncode != 0 or len(run.losses) != ITERS:
        raise SystemExit(f"{label} failed:\n{run.tail()}")
    losses = [json.loads(line)["loss"] for line in (probe_dir / "rank0.jsonl").read_text().splitlines()]
    norms = [float.fromhex(json.loads(line)["grad_norm"])
             for line in (probe_dir / "norms-rank0.jsonl").read_text().splitlines()]
    printed = [run.losses[i] for i in sorted(run.losses)]
    digest = hashlib.sha256("".join(losses).encode()).hexdigest()[:12]
    return {"printed": printed, "norms": norms, "tokens": digest, "seconds": run.seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (default: the pinned core_v0.16.1 tarball)")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "tp_invariant_megatron_lm.md")
    args = parser.parse_args()
    rows = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        checkout = args.megatron_lm or mlm.pinned_checkout(Path(tmp) / "src")
        for n, (config, extra, dp, tps) in enumerate(CONFIGS):
            for mode, env in MODES.items():
                found = {}
                for tp in tps if mode == "tp_invariant" else tps[:2]:
                    heads = 8 if extra[:1] == LLAMA[:1] else 4  # 8 heads in 4 KV groups: whole groups at TP 4
                    flags = mlm.tiny_gpt_flags(tp=tp, heads=heads, **FLAGS, extra=extra + _sp(config, tp))
                    found[tp] = _run(checkout, Path(tmp) / "runs", f"c{n}-{mode}-tp{tp}", flags, tp * dp, env)
                    print(f"{config} | {mode} | TP {tp}: {found[tp]['printed']}", flush=True)
                base = found[tps[0]]
                for tp, r in found.items():
                    same = "--" if tp == tps[0] else (
                        "yes" if (r["tokens"], r["norms"], r["printed"]) == (base["tokens"], base["norms"], base["printed"])
                        else "no")
                    rows.append(f"| {config} | {mode} | {tp} x DP {dp} | {r['tokens']} | "
                                f"{' '.join(r['printed'])} | {' '.join(f'{x:.9g}' for x in r['norms'])} | {same} |")
    seconds = time.monotonic() - start
    text = f"""# tp_invariant through Megatron-LM's `pretrain_gpt.py`: sequence parallelism, distributed optimizer

Command: `python benchmarks/tp_invariant_megatron_lm.py` ({seconds:.0f} s on the 2-core CPU machine;
megatron-core 0.16.1, Megatron-LM core_v0.16.1's unmodified `pretrain_gpt.py` under
`torchrun -m megapatch.testing.ranks.cpu_launch` with the test probe `tests/scripts/megatron_lm_probe.py`,
megapatch switched on by `MEGAPATCH_TP_INVARIANT=1` only).

Model: 2 layers, hidden 64, 4 heads (GELU), vocabulary 511 (+ EOD: 512 rows at TP 1, 2 and 4, the same
initial model), sequence 32, micro-batch 2, global batch 4, BF16, Adam, `--clip-grad 1.0`, {ITERS}
iterations, `--transformer-impl local`; GELU GPT (LayerNorm, biases, learned positions) or the Llama
flags (SwiGLU, RMSNorm, RoPE, 8 heads in 4 KV groups, untied output layer, no biases). TP=1 runs without
sequence parallelism (Megatron-LM turns it off at TP=1). With `--sequence-parallel` the norms are
the CPU launcher's labelled stand-in for apex's sequence-parallel `FusedLayerNorm` (a torch norm
whose parameters are marked `sequence_parallel`, `megapatch.testing.stand_ins.cpu_compat`).

Columns: per-token losses = the first 12 hex digits of a hash over the SHA-256 of rank 0's per-token
losses at every micro-batch; printed = the losses Megatron-LM prints (iterations 1-{ITERS}); grad
norms = as clipping reads them, full precision; "same as TP {{first}}" = per-token losses, printed losses
and grad norms all identical to the first TP size of that configuration and mode.

| configuration | mode | TP x DP | per-token losses | printed losses | grad norms | same as the first TP size |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Reading: under `tp_invariant` every TP size gives the same bits as TP=1 -- with sequence
parallelism (GELU and Llama), with the distributed optimizer at DP 1 and DP 2, and with both;
natively, TP sizes differ from the first iteration's per-token losses on. These are bitwise
agreement across TP sizes, not accuracy: the mode does not bring BF16 closer to an FP32 reference
(see README's Llama table). With DP = 2 the data-parallel reduce-scatter adds two values (a + b is the
same in any order); DP >= 3 is not shown (docs/tp_invariant.md).
"""
    args.out.write_text(text)
    print(f"wrote {args.out} ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
