"""The Llama of ``benchmarks/llama_hf.py`` (same builder, same seed, same weights) through
Megatron-Bridge's ``AutoBridge`` at TP 1 and 2 on CPU ranks, one job per megapatch mode switched
by ``MEGAPATCH_*`` in the job's environment only; the TP-drift table next to the Megatron-LM
converter's (read from ``results/llama_hf.md``), the error against transformers' own FP32 forward,
and (``--train``) Bridge's own training entry (``benchmarks/bridge_train.py``'s table is added).

    python benchmarks/bridge_llama.py --out results/bridge.md       # in a Bridge venv, ~8 min on 2 cores

Needs Megatron-Bridge (docs/stack.md section 6 installs it: its own Python 3.12 venv).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megapatch.testing.scenarios import llama_hf as L  # noqa: E402
from megapatch.testing.ranks.rank_results import RankFailure  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from llama_hf import BATCH, MODEL, SEQ, _fmt  # noqa: E402  (the converter benchmark's model and batch)


def mode_env(mode: str) -> dict:
    """``MEGAPATCH_*`` for one of :data:`megapatch.testing.scenarios.llama_hf.MODES`."""
    from megapatch.core.options import OPTIONS_BY_NAME

    return {OPTIONS_BY_NAME[k].env: ("1" if v is True else str(v)) for k, v in L.MODES[mode].items()}


def weights_digest(hf_dir) -> str:
    """sha256 over the saved tensors (names sorted, values as float32): the same weights in two
    environments give the same digest."""
    from safetensors.torch import load_file

    state = load_file(str(Path(hf_dir) / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].float().numpy().tobytes())
    return digest.hexdigest()


def converter_drift(path: Path) -> dict:
    """``{mode: (kl, identical, flips)}`` of the TP2 rows of results/llama_hf.md's drift table."""
    rows = {}
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        m = re.match(r"\| (\S+) \| 2 \| ([^|]+) \| [^|]+ \| ([0-9.]+) \| ([0-9.]+) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3), m.group(4))
    return rows


#: provider fields a mode needs on top of the CPU settings: tp_invariant refuses Bridge's default
#: fused cross entropy (its sum over the TP ranks is outside the fixed tree)
MODE_PROVIDER = {"tp-invariant": {"cross_entropy_loss_fusion": False}}


def run_mode(hf, tokens_path, env, bf16=True, overrides=None):
    from megapatch.testing import run_ranks
    from megapatch.testing.scenarios.bridge_llama import forward_tp1_tp2

    start = time.monotonic()
    out = run_ranks(forward_tp1_tp2, 2, tp=1, args=(str(hf), str(tokens_path), MODEL["vocab"], bf16, overrides),
                    env=env, timeout=1200)[0]
    out["seconds"] = time.monotonic() - start
    for name, value in env.items():  # the ranks' megapatch took the mode from the environment
        option = name[len("MEGAPATCH_"):].lower()
        if out["sources"].get(option) != f"env {name}":
            raise SystemExit(f"{env}: megapatch on the ranks did not take {option} from {name}: "
                             f"{out['sources']}")
    if env and not out["enabled"]:
        raise SystemExit(f"{env}: megapatch was not enabled on the ranks")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "results" / "bridge.md"))
    parser.add_argument("--modes", default=",".join(L.MODES))
    parser.add_argument("--train-table", help="markdown written by benchmarks/bridge_train.py, appended")
    args = parser.parse_args()
    import importlib.metadata as md

    import torch

    modes = [m for m in args.modes.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="bridge-llama-") as tmp:
        tmp = Path(tmp)
        hf = tmp / "hf_llama"
        config = L.build_tiny_hf(hf, **MODEL)
        digest = weights_digest(hf)
        tokens = L.tokens(BATCH, SEQ, config["vocab_size"])
        torch.save(tokens, tmp / "tokens.pt")
        ref32, ref16 = L.hf_logits(hf, tokens, "fp32"), L.hf_logits(hf, tokens, "bf16")
        fp32 = run_mode(hf, tmp / "tokens.pt", {}, bf16=False)
        print(f"FP32 conversion check: {fp32['seconds']:.0f} s", flush=True)
        results = {}
        refused = {}
        for mode in modes:
            try:
                results[mode] = run_mode(hf, tmp / "tokens.pt", mode_env(mode), overrides=MODE_PROVIDER.get(mode))
            except RankFailure as failure:  # a refusal megapatch raised on a rank is recorded
                if "UnsupportedConfigurationError" not in str(failure):
                    raise
                refused[mode] = str(failure).strip().splitlines()[-1]
                print(f"{mode}: refused: {refused[mode]}", flush=True)
                continue
            print(f"{mode}: {results[mode]['seconds']:.0f} s", flush=True)
    modes = [m for m in modes if m in results]

    env = L.env_summary()
    env["megatron-bridge"] = md.version("megatron-bridge")
    conv = converter_drift(REPO / "results" / "llama_hf.md")
    lines = [
        "# Megatron-Bridge: a Hugging Face Llama through AutoBridge, TP drift per megapatch mode, "
        "and training through Bridge's own entry",
        "",
        f"Produced by `{shlex.join(['python', 'benchmarks/bridge_llama.py', *sys.argv[1:]])}` on CPU "
        "ranks (gloo), " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".",
        "",
        "**Model and batch.** The ones of [llama_hf.md](llama_hf.md): `build_tiny_hf(" + ", ".join(
            f"{k}={v}" for k, v in MODEL.items()) + ")` (seed 1234, planted outlier channels), "
        f"batch {BATCH} x {SEQ}. Weights digest (sha256 over the saved tensors, "
        f"`benchmarks/bridge_llama.py:weights_digest`): `{digest}`.",
        "",
        "**Path.** `AutoBridge.from_hf_pretrained(dir)` -> `to_megatron_provider(load_weights=True)` "
        "(Bridge's `LlamaBridge` mapping and its HF weight loading) -> the CPU settings of "
        "`megapatch.testing.scenarios.bridge_llama.configure_provider` (TP size, megatron-core's local layer "
        "spec: Bridge's default spec is Transformer Engine's; the CUDA fusions off; BF16) -> "
        "`provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)`; for "
        "tp-invariant also `cross_entropy_loss_fusion=False` (Bridge's default is on, and the mode "
        "refuses the fused cross entropy at construction). One job of "
        "two gloo ranks per mode: TP 1 (data parallel 2), then TP 2 after re-initialising megatron's "
        "parallel state. megapatch is switched by `MEGAPATCH_*` in the job's environment only (the "
        "ranks never call `enable()`; each run checks that the ranks' settings came from those "
        "variables). Bridge is imported without Transformer Engine through the scoped import "
        "stand-in `megapatch/testing/stand_ins/bridge_compat.py` (docs/stack.md section 6 says what it "
        "replaces). Metrics as defined in llama_hf.md.",
        "",
        "## Conversion check (FP32 forward through Bridge vs transformers FP32)",
        "",
        "| run | rel L2 | max abs | argmax agree |",
        "|---|---|---|---|",
    ]
    for tp in (1, 2):
        e = L.compare(fp32[f"tp{tp}"], ref32)
        lines.append(f"| Bridge FP32 TP{tp} | {_fmt(e['rel_l2'])} | {_fmt(e['max_abs'])} | "
                     f"{e['argmax_agree']:.4f} |")
    lines += [
        "",
        "## Drift TP1 -> TP2 (BF16, same mode at TP1 as reference), next to the converter's",
        "",
        "The converter columns are read from [llama_hf.md](llama_hf.md) (Megatron-LM core_v0.16.1's "
        "`convert.py` and loader, megatron-core 0.16.1, Python 3.11), when this table was written.",
        "",
        "| mode | KL(TP1‖TP2) | max \\|Δlogit\\| | bit-identical | greedy flips | converter KL | "
        "converter bit-identical | converter flips |",
        "|---|---|---|---|---|---|---|---|",
    ]
    drift = {m: L.drift(results[m]["tp2"], results[m]["tp1"]) for m in modes}
    for m, message in refused.items():
        lines.append(f"| {m} | refused: {message} | | | | | | |")
    for m in modes:
        d = drift[m]
        c = conv.get(m, ("–", "–", "–"))
        lines.append(f"| {m} | {_fmt(d['kl'])} | {_fmt(d['max_abs'])} | {d['identical']:.4f} | "
                     f"{d['flips']:.4f} | {c[0]} | {c[1]} | {c[2]} |")
    hf16 = L.compare(ref16, ref32)
    lines += [
        "",
        "## Error against transformers' FP32 forward (BF16 runs)",
        "",
        "| run | TP | rel L2 | max abs | argmax agree | logits dtype |",
        "|---|---|---|---|---|---|",
        f"| transformers BF16 | – | {_fmt(hf16['rel_l2'])} | {_fmt(hf16['max_abs'])} | "
        f"{hf16['argmax_agree']:.4f} | torch.bfloat16 |",
    ]
    for m in modes:
        for tp in (1, 2):
            e = L.compare(results[m][f"tp{tp}"], ref32)
            lines.append(f"| Bridge {m} | {tp} | {_fmt(e['rel_l2'])} | {_fmt(e['max_abs'])} | "
                         f"{e['argmax_agree']:.4f} | {results[m]['logits_dtype'][tp]} |")
    native = drift.get("native")
    reading = []
    if native:
        parts = []
        for m in modes:
            if m == "native":
                continue
            d = drift[m]
            parts.append(f"{m}: " + ("bit-identical logits" if d["identical"] == 1.0 else
                                     f"{native['kl'] / d['kl']:.1f}x" if d["kl"] else "KL 0"))
        reading.append("* **Agreement between TP sizes.** KL(TP1‖TP2) of native divided by each "
                       "mode's (larger = TP2 agrees better with TP1): " + "; ".join(parts) + ".")
    tp1 = {m: L.compare(results[m]["tp1"], ref32)["rel_l2"] for m in modes}
    reading.append(
        "* **Accuracy.** At TP1 the BF16 runs' relative L2 error against transformers' FP32 forward "
        "is " + ", ".join(f"{m} {_fmt(v)}" for m, v in tp1.items()) + f" (transformers' own BF16: "
        f"{_fmt(hf16['rel_l2'])}). FP32 reductions make TP sizes agree; they do not bring a BF16 "
        "model closer to the FP32 reference than its TP1 BF16 error. FP32 logits change the dtype "
        "of the output layer's result, not the BF16 activations feeding it.")
    if conv:
        reading.append(
            "* **Against the converter path.** Same builder, seed and batch as llama_hf.md; another "
            "megatron-core (the one above vs 0.16.1) and other loading code (Bridge's mapping vs "
            "Megatron-LM's converter). Per mode, the TP2 drift of the two paths is of the same size "
            "(columns side by side above); tp-invariant is bit-identical on both.")
    timings = [f"* FP32 conversion check job: {fp32['seconds']:.0f} s"] + [
        f"* {m} job (Bridge import, two builds, two forwards): {results[m]['seconds']:.0f} s" for m in modes]
    lines += ["", "## Reading", ""] + reading + ["", "## Timings (wall seconds, 2-core CPU)", ""] + timings
    if args.train_table and Path(args.train_table).exists():
        lines += ["", Path(args.train_table).read_text().rstrip()]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
