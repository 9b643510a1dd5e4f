"""A Hugging Face Llama through Megatron-LM's own converter and loader at TP 1/2/4/8, in every
megapatch mode, against transformers' own FP32 forward of the same weights. Writes
``results/llama_hf.md`` with the commands.

    python benchmarks/llama_hf.py                  # pinned core_v0.16.1 tarball, ~5 min on 2 cores
    python benchmarks/llama_hf.py --tp 1,2 --out /tmp/llama_hf.md

Needs the ``llama`` and ``megatron-lm`` extras. One multi-rank job at a time (CPU ranks, gloo,
``torchrun -m megapatch.testing.ranks.cpu_launch``); each TP size is one job that loads the converted
checkpoint once and runs the same token batch forward in every mode (``megapatch.enable`` /
``disable`` between forwards: megapatch's wrappers read the settings at call time).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megapatch.testing.scenarios import llama_hf as L  # noqa: E402
from megapatch.testing.ranks import megatron_lm_runs as mlm  # noqa: E402

# 16 heads / 8 KV groups (GQA), every width divisible by 8: TP 8 runs; vocab 1024 is padded to
# 1024 at every TP size <= 8, so TP sizes share one output layer
MODEL = dict(hidden=256, heads=16, kv_heads=8, ffn=768, layers=4, vocab=1024)
QWEN = dict(hidden=128, heads=4, kv_heads=2, ffn=384, layers=2, vocab=1024)
BATCH, SEQ = 4, 128
BF16_MODES = [m for m in L.MODES]
TRAIN_ITERS = 20
# (column, TP, MEGAPATCH_* of the launch): pretrain_gpt.py from the converted checkpoints
TRAIN_RUNS = [
    ("TP1 native", 1, {}),
    ("TP1 logits fp32", 1, {"MEGAPATCH_LOGITS_DTYPE": "fp32"}),
    ("TP2 native", 2, {}),
    ("TP2 fp32", 2, {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}),
    ("TP2 fp32-accumulate", 2, {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32-accumulate"}),
    ("TP2 logits fp32", 2, {"MEGAPATCH_LOGITS_DTYPE": "fp32"}),
    ("TP2 fp32 + logits fp32", 2, {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_LOGITS_DTYPE": "fp32"}),
    ("TP1 tp_invariant", 1, {"MEGAPATCH_TP_INVARIANT": "1"}),
    ("TP2 tp_invariant", 2, {"MEGAPATCH_TP_INVARIANT": "1"}),
    ("TP4 native", 4, {}),
    ("TP4 fp32", 4, {"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}),
]


def _shell(command) -> str:
    args = list(command[1:])
    if args[:2] == ["-m", "torch.distributed.run"]:
        args = ["torchrun", *args[2:]]
    else:
        args = ["python", *args]
    return shlex.join(args)


def _check(run, what):
    if run.returncode != 0:
        raise SystemExit(f"{what} failed ({run.returncode}):\n{run.tail()}")
    return run


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}" if abs(x) >= 1e-3 else f"{x:.2e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tarballs", default=os.environ.get(
        "MEGATRON_LM_TARBALLS", str(REPO.parent / "shared" / "megatron-lm")))
    parser.add_argument("--checkout", default=os.environ.get(mlm.USER_CHECKOUT_ENV))
    parser.add_argument("--tp", default="1,2,4,8")
    parser.add_argument("--out", default=str(REPO / "results" / "llama_hf.md"))
    parser.add_argument("--no-training", action="store_true",
                        help="skip the pretrain_gpt.py loss table")
    args = parser.parse_args()
    tps = [int(t) for t in args.tp.split(",")]
    if tps[0] != 1:
        raise SystemExit("--tp must start with 1 (the drift reference)")
    missing = L.missing_dependencies()
    if missing:
        raise SystemExit(f"needs {', '.join(missing)}: pip install '.[{L.EXTRA_NAME}]'")
    import torch

    timings, commands = {}, {}
    with tempfile.TemporaryDirectory(prefix="llama-hf-") as tmp:
        tmp = Path(tmp)
        if args.checkout:
            checkout, source = Path(args.checkout), f"checkout {args.checkout}"
        else:
            tarball = Path(args.tarballs) / mlm.TARBALLS["core_v0.16.1"]
            checkout, source = mlm.unpack(tarball, tmp / "mlm"), f"Megatron-LM core_v0.16.1 ({tarball.name})"
        hf = tmp / "hf_llama"
        config = L.build_tiny_hf(hf, **MODEL)
        tokens = L.tokens(BATCH, SEQ, config["vocab_size"])
        torch.save(tokens, tmp / "tokens.pt")
        ref32, ref16 = L.hf_logits(hf, tokens, "fp32"), L.hf_logits(hf, tokens, "bf16")

        results, fp32_check = {}, {}
        for tp in tps:
            ckpt = tmp / f"ckpt_tp{tp}"
            run = _check(L.convert(checkout, hf, ckpt, tp, timeout=600), f"conversion TP{tp}")
            timings[f"convert TP{tp}"] = run.seconds
            commands[f"convert TP{tp}"] = _shell(run.command)
            out = tmp / f"bf16_tp{tp}.pt"
            flags = L.megatron_flags(config, ckpt, tp, SEQ, tokenizer_dir=hf)
            run = _check(L.forward(checkout, flags, tp=tp, tokens_path=tmp / "tokens.pt", out_path=out,
                                   modes=BF16_MODES, vocab=config["vocab_size"], timeout=900),
                         f"forward TP{tp}")
            timings[f"forward TP{tp} (6 modes)"] = run.seconds
            commands[f"forward TP{tp}"] = _shell(run.command)
            results[tp] = torch.load(out)
            print(f"TP{tp}: converted and ran", flush=True)
            if tp in (1, 2):
                out = tmp / f"fp32_tp{tp}.pt"
                flags = L.megatron_flags(config, ckpt, tp, SEQ, bf16=False, tokenizer_dir=hf)
                _check(L.forward(checkout, flags, tp=tp, tokens_path=tmp / "tokens.pt", out_path=out,
                                 modes=("native",), vocab=config["vocab_size"]), f"FP32 forward TP{tp}")
                fp32_check[f"Llama TP{tp}"] = L.compare(torch.load(out)["native"]["logits"], ref32)

        losses = {} if args.no_training else _training(checkout, config, tmp, tps, commands, timings)

        # Qwen2.5-shaped (QKV bias, rms_norm_eps 1e-6, rope_theta 1e6): conversion check only
        qhf = tmp / "hf_qwen2"
        qconfig = L.build_tiny_hf(qhf, arch="qwen2", rms_norm_eps=1e-6, rope_theta=1e6, **QWEN)
        qref = L.hf_logits(qhf, tokens, "fp32")
        for tp in (1, 2):
            ckpt = tmp / f"qwen_tp{tp}"
            run = _check(L.convert(checkout, qhf, ckpt, tp, "qwen2.5"), f"Qwen conversion TP{tp}")
            commands[f"convert Qwen2.5 TP{tp}"] = _shell(run.command)
            out = tmp / f"qwen_fp32_tp{tp}.pt"
            flags = L.megatron_flags(qconfig, ckpt, tp, SEQ, bf16=False, tokenizer_dir=qhf)
            _check(L.forward(checkout, flags, tp=tp, tokens_path=tmp / "tokens.pt", out_path=out,
                             modes=("native",), vocab=qconfig["vocab_size"]), f"Qwen FP32 forward TP{tp}")
            fp32_check[f"Qwen2.5 TP{tp}"] = L.compare(torch.load(out)["native"]["logits"], qref)

    _write(args, tps, source, results, ref32, ref16, fp32_check, timings, commands, losses)


def _training(checkout, config, tmp, tps, commands, timings):
    """``pretrain_gpt.py`` for TRAIN_ITERS iterations from the converted checkpoints, one launch per
    row, megapatch switched by ``MEGAPATCH_*`` only."""
    losses = {}
    for column, tp, env in TRAIN_RUNS:
        if tp not in tps:
            continue
        flags = L.pretrain_flags(config, tmp / f"ckpt_tp{tp}", tp, SEQ, iters=TRAIN_ITERS)
        run = mlm.launch(checkout, flags, nproc=tp, megapatch_env=env, timeout=1200)
        if run.returncode != 0 or len(run.losses) != TRAIN_ITERS:
            raise SystemExit(f"training {column} failed ({run.returncode}):\n{run.tail()}")
        for name, value in env.items():
            option = name[len("MEGAPATCH_"):].lower()
            if not re.search(rf"{option}=\S+ \(env {name}\)", run.log):
                raise SystemExit(f"training {column}: the job log does not show megapatch enabled:\n{run.tail()}")
        losses[column] = run.losses
        prefix = " ".join(f"{k}={v}" for k, v in sorted(env.items()))
        commands[f"train {column}"] = (prefix + " " if prefix else "") + _shell(run.command)
        timings[f"train {column}"] = run.seconds
        print(f"training {column}: {run.seconds:.0f} s", flush=True)
    return losses


def _loss_table(losses):
    columns = list(losses)
    reference = losses[columns[0]]
    lines = ["| iteration | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for i in sorted(reference):
        lines.append(f"| {i} | " + " | ".join(losses[c].get(i, "–") for c in columns) + " |")
    lines.append(f"| **mean abs(loss - {columns[0]})** | " + " | ".join(
        f"{mlm.mean_abs_difference(losses[c], reference):.3e}" for c in columns) + " |")
    lines.append(f"| **max abs(loss - {columns[0]})** | " + " | ".join(
        f"{max(abs(float(losses[c][i]) - float(reference[i])) for i in reference):.3e}" for c in columns) + " |")
    lines.append(f"| **iterations printing {columns[0]}'s loss** | " + " | ".join(
        f"{sum(losses[c][i] == reference[i] for i in reference)}/{len(reference)}" for c in columns) + " |")
    return lines


def _write(args, tps, source, results, ref32, ref16, fp32_check, timings, commands, losses) -> None:
    refused = {(m, tp): results[tp][m]["refused"] for m in BF16_MODES for tp in tps
               if "refused" in results[tp][m]}
    modes = [m for m in BF16_MODES if (m, 1) not in refused]
    ran = [(m, tp) for m in modes for tp in tps if (m, tp) not in refused]
    drift = {(m, tp): L.drift(results[tp][m]["logits"], results[1][m]["logits"])
             for m, tp in ran if tp != 1}
    error = {(m, tp): L.compare(results[tp][m]["logits"], ref32) for m, tp in ran}
    hf_bf16 = L.compare(ref16, ref32)
    env = L.env_summary()
    lines = [
        "# A Hugging Face Llama through Megatron-LM's converter and loader: TP drift and error "
        "against transformers, per megapatch mode",
        "",
        f"Produced by `{shlex.join(['python', 'benchmarks/llama_hf.py', *sys.argv[1:]])}` on CPU ranks "
        f"(gloo), {source}; " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".",
        "",
        "**Model.** `megapatch.testing.scenarios.llama_hf.build_tiny_hf`: a transformers `LlamaForCausalLM`, "
        + ", ".join(f"{k} {v}" for k, v in MODEL.items())
        + ", untied output layer, no biases, seeded random weights (norm gains 1 + 0.1 N(0,1)), saved "
        "in BF16 with `save_pretrained` (safetensors) with a word-level fast tokenizer built locally. "
        f"**Planted outlier channels** (massive activations): token {L.DELIMITER} (the delimiter) carries "
        f"{L.DELIMITER_SCALE} in hidden dimension 0; layer 0's MLP neurons {L.OUTLIER_NEURON} and "
        f"ffn-{L.OUTLIER_NEURON} (first and last TP shard at every TP size) read it through gate_proj "
        f"and up_proj and write +{L.OUTLIER_SCALE} and -{L.OUTLIER_SCALE}*(1-1/128) times their "
        f"activation through down_proj into hidden dimensions {list(L.OUTLIER_DIMS)}: large, nearly "
        "cancelling partial sums that meet in linear_fc2's TP all-reduce. "
        f"Batch {BATCH} x {SEQ} seeded tokens, the delimiter every 16 positions.",
        "",
        "**Path.** Megatron-LM's own `tools/checkpoint/convert.py --loader llama_mistral "
        "--checkpoint-type hf --model-size llama3 --saver core --saver-transformer-impl local` "
        "(under `megapatch.testing.ranks.convert_launch`: CPU stand-ins, listed in "
        "`megapatch/testing/stand_ins/convert_compat.py`) writes one checkpoint per TP size; each is loaded with "
        "Megatron-LM's `initialize_megatron` / `get_model` / `load_checkpoint(strict=True)` and the "
        "Llama flags (`--swiglu --normalization RMSNorm --position-embedding-type rope "
        "--group-query-attention --num-query-groups G --untie-embeddings-and-output-weights "
        "--disable-bias-linear`, `--bf16`, plus the CPU flags), then run forward once per mode in one "
        "job per TP size (`megapatch.enable(...)` / `disable()` between forwards).",
        "",
        "**Definitions.** Logits are trimmed to the true vocabulary and compared in float64. "
        "KL(TP1‖TPn) = mean over positions of Σ_v p₁(v)(log p₁(v) − log pₙ(v)), p = softmax of the "
        "logits, TP1 of the same mode as reference. max |Δlogit| against TP1; bit-identical = share "
        "of logits equal to TP1's bit for bit; flips = share of positions whose greedy (argmax) next "
        "token differs from TP1's. Against transformers' FP32 forward of the same (BF16-stored) "
        "weights: relative L2 = ‖x − ref‖ / ‖ref‖ over all logits; mean relative error = "
        f"mean |x − ref| / (|ref| + {L.MEAN_REL_EPS:g}) over all logits (element-wise, dominated by "
        "logits near zero); argmax agree = share of positions with the same top-1 token.",
        "",
        "## Conversion check (FP32 Megatron forward vs transformers FP32)",
        "",
        "| model | rel L2 | max abs | argmax agree |",
        "|---|---|---|---|",
    ]
    for name, e in fp32_check.items():
        lines.append(f"| {name} | {_fmt(e['rel_l2'])} | {_fmt(e['max_abs'])} | {e['argmax_agree']:.4f} |")
    lines += [
        "",
        "Summation-order noise: the converter maps the weights exactly (Qwen2.5: `--model-size "
        "qwen2.5`, QKV biases, `rms_norm_eps` 1e-6 and `rope_theta` 1e6 passed as flags at load).",
        "",
        "## Drift across TP sizes (BF16, same mode at TP1 as reference)",
        "",
        "| mode | TP | KL(TP1‖TPn) | max \\|Δlogit\\| | bit-identical | greedy flips |",
        "|---|---|---|---|---|---|",
    ]
    for m in BF16_MODES:
        for tp in tps[1:]:
            if (m, tp) in refused:
                lines.append(f"| {m} | {tp} | refused: {refused[(m, tp)]} | | | |")
            elif (m, tp) in drift:
                d = drift[(m, tp)]
                lines.append(f"| {m} | {tp} | {_fmt(d['kl'])} | {_fmt(d['max_abs'])} | "
                             f"{d['identical']:.4f} | {d['flips']:.4f} |")
            elif (m, 1) in refused:
                lines.append(f"| {m} | {tp} | not compared: TP1 refused ({refused[(m, 1)]}) | | | |")
    lines += [
        "",
        "## Error against transformers' FP32 forward (BF16 runs)",
        "",
        "| run | TP | rel L2 | mean rel error | max abs | argmax agree | logits dtype |",
        "|---|---|---|---|---|---|---|",
        f"| transformers BF16 | – | {_fmt(hf_bf16['rel_l2'])} | {_fmt(hf_bf16['mean_rel'])} | "
        f"{_fmt(hf_bf16['max_abs'])} | {hf_bf16['argmax_agree']:.4f} | torch.bfloat16 |",
    ]
    for m in modes:
        for tp in tps:
            if (m, tp) not in error:
                continue
            e = error[(m, tp)]
            lines.append(f"| Megatron {m} | {tp} | {_fmt(e['rel_l2'])} | {_fmt(e['mean_rel'])} | "
                         f"{_fmt(e['max_abs'])} | {e['argmax_agree']:.4f} | {results[tp][m]['logits_dtype']} |")
    if losses:
        lines += [
            "", f"## Training from the converted checkpoints ({TRAIN_ITERS} iterations of `pretrain_gpt.py`)", "",
            "Megatron-LM's own `pretrain_gpt.py` under `megapatch.testing.ranks.cpu_launch`, loading the "
            "converted checkpoint (`--load CKPT --finetune --no-load-optim --no-load-rng`: the converter "
            "saves no optimizer state), the Llama flags, BF16, NullTokenizer with the checkpoint's "
            "vocabulary (1023 + EOD = 1024 rows at every TP size), mock data, constant lr 1e-5, micro "
            "batch 2, global batch 4, seed 1234, no dropout; megapatch switched per launch by "
            "`MEGAPATCH_*` only. `lm loss` as Megatron-LM prints it (7 significant digits).", "",
        ] + _loss_table(losses)
    lines += ["", "## Reading", ""] + _reading(tps, modes, drift, error, hf_bf16, refused)
    if losses:
        lines.append(_training_reading(losses))
    lines += [
        "",
        "## What a user of the converter meets (core_v0.16.1)",
        "",
        "* transformers must be 4.31 <= v < 5 (`loader_llama_mistral.py:46-48` asserts minor >= 31, "
        "so every 5.x fails) and accelerate must be installed (`device_map=\"cpu\"`, `:392`); the "
        "tokenizer must be a fast one saved with the checkpoint (`tokenizer.json`; `:563`). The "
        "`llama` extra pins this.",
        "* `--saver-transformer-impl local` is needed without Transformer Engine; the checkpoint is "
        "written in `torch` format (`saver_base.py:245`).",
        "* `convert.py` exits 0 when its saver process dies (`convert.py:160-166`, e.g. a TP size "
        "that does not divide the heads); `python -m megapatch.testing.ranks.convert_launch` exits 1 then.",
        "* Not carried into the checkpoint's args (`loader_llama_mistral.py:280-315`): `rope_theta` "
        "(pass `--rotary-base`, Llama 3: 500000, Qwen2.5: 1000000), llama3-type `rope_scaling` "
        "(pass `--use-rope-scaling --rope-scaling-factor F`), `rms_norm_eps` (the loader writes "
        "`args.norm_epsilon`, Megatron's dest is `layernorm_epsilon`: pass `--norm-epsilon`). "
        "`--use-checkpoint-args` force-copies `rotary_base` from the checkpoint (10000), so pass the "
        "flags without it. The vocabulary is padded to a multiple of 128 x TP by repeating the last "
        "row: trim logits to the true vocabulary.",
        "* A mode megapatch refuses for a configuration is recorded with its refusal message.",
        "",
        "## Timings (wall seconds, 2-core CPU)",
        "",
    ] + [f"* {k}: {v:.0f}" for k, v in timings.items()] + [
        "",
        "## Commands (run from the Megatron-LM checkout; paths were temporary)",
        "",
    ] + [f"* {k}: `{v}`" for k, v in commands.items()]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _training_reading(losses) -> str:
    columns = list(losses)
    reference = losses[columns[0]]
    gaps = {c: mlm.mean_abs_difference(losses[c], reference) for c in columns[1:]}
    text = ("* **Training.** Mean |loss − " + columns[0] + "| over the iterations: "
            + "; ".join(f"{c} {v:.2e}" for c, v in gaps.items()) + ".")
    if "TP1 tp_invariant" in losses and "TP2 tp_invariant" in losses:
        a, b = losses["TP1 tp_invariant"], losses["TP2 tp_invariant"]
        same = sum(a[i] == b.get(i) for i in a)
        text += (f" tp_invariant: TP2 prints TP1's loss at {same}/{len(a)} iterations "
                 f"(native TP2 vs TP1 native: {sum(reference[i] == losses['TP2 native'].get(i) for i in reference)}"
                 f"/{len(reference)}).") if "TP2 native" in losses else ""
    if "TP1 logits fp32" in gaps:
        scale = gaps["TP1 logits fp32"]
        tp_gaps = {c: v for c, v in gaps.items() if not c.startswith("TP1") and "tp_invariant" not in c}
        inside = [c for c, v in tp_gaps.items() if v < 2 * scale]
        text += (f" For scale: changing only the logits dtype at TP1 moves the losses by {scale:.2e}, "
                 "the size of BF16 rounding in a training step. ")
        text += ("Every TP>1 gap is within twice that, so 20 iterations from the converted "
                 "checkpoint do not separate the modes: the forward drift above is the sharper measure."
                 if len(inside) == len(tp_gaps) else
                 "TP>1 gaps beyond twice that: " + ", ".join(c for c in tp_gaps if c not in inside) + ".")
    return text


def _reading(tps, modes, drift, error, hf_bf16, refused):
    out = []
    rel = {m: [error[(m, tp)]["rel_l2"] for tp in tps if (m, tp) in error] for m in modes}
    lo = min(min(v) for v in rel.values())
    hi = max(max(v) for v in rel.values())
    tp1 = {m: error[(m, 1)]["rel_l2"] for m in modes}
    higher = [tp for tp in tps[1:] if error[("native", tp)]["rel_l2"] > 1.05 * tp1["native"]]
    out.append(
        "* **Accuracy.** Against transformers' FP32 forward of the same weights, every BF16 Megatron "
        f"run has a relative L2 error between {_fmt(lo)} and {_fmt(hi)} (TP {'/'.join(map(str, tps))}); "
        f"transformers' own BF16 forward has {_fmt(hf_bf16['rel_l2'])}. At TP1 every mode has "
        + ", ".join(f"{_fmt(v)}" for v in sorted(set(tp1.values())))
        + ": that error comes from running the model in BF16, and no mode goes below it. "
        f"Native at TP1..{tps[-1]}: " + ", ".join(_fmt(x) for x in rel["native"]) + "; fp32: "
        + ", ".join(_fmt(x) for x in rel["fp32"]) + ". "
        + ((f"At TP {'/'.join(map(str, higher))} native adds error on top of TP1's (the planted "
            "outliers' nearly cancelling partial sums lose their remainder in the BF16 all-reduce); "
            "fp32 reductions remove that addition and keep the error at TP1's level. They do not "
            "make Megatron more accurate than a TP1 BF16 run (or transformers' BF16 forward).")
           if higher else
           "The FP32 reductions do not bring Megatron closer to the FP32 reference than TP1's BF16 error.")
        + " The element-wise mean relative error is "
        + ", ".join(_fmt(error[(m, tps[-1])]["mean_rel"]) for m in ("native", "fp32"))
        + f" (native, fp32 at TP{tps[-1]}) and {_fmt(hf_bf16['mean_rel'])} for transformers BF16: a "
        "metric dominated by logits near zero, large for any BF16 run.")
    if len(tps) > 1:
        parts = []
        for tp in tps[1:]:
            native = drift[("native", tp)]["kl"]
            for m in ("fp32", "fp32+logits-fp32", "fp32-accumulate", "logits-fp32", "tp-invariant"):
                if (m, tp) not in drift:
                    continue
                d = drift[(m, tp)]
                parts.append(f"{m} TP{tp}: " + ("bit-identical logits" if d["identical"] == 1.0 else
                                                "KL 0" if d["kl"] == 0 else f"{native / d['kl']:.1f}x"))
        out.append(
            "* **Agreement between TP sizes.** KL(TP1‖TPn) of native divided by each mode's "
            "(larger = the mode agrees better with its TP1): " + "; ".join(parts) + ". Greedy flips "
            "against TP1, native: " + ", ".join(
                f"TP{tp} {drift[('native', tp)]['flips']:.4f}" for tp in tps[1:]) + "; fp32 + FP32 "
            "logits: " + ", ".join(f"TP{tp} {drift[('fp32+logits-fp32', tp)]['flips']:.4f}"
                                   for tp in tps[1:]) + ".")
        if 2 in tps:
            same = drift[("fp32-accumulate", 2)] == drift[("native", 2)]
            out.append("* `fp32-accumulate` at TP2 " + ("equals native (a two-rank sum rounds once "
                       "either way)." if same else "differs from native."))
    for (m, tp), message in refused.items():
        out.append(f"* `{m}` at TP{tp}: refused (`{message}`).")
    return out


if __name__ == "__main__":
    main()
