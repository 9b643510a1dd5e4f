"""``megapatch demo``: how much the logits of one tiny GPT drift when only the TP size changes,
with native BF16 reductions, fp32-accumulate, fp32 and tp-invariant (``tp_invariant=True``), on CPU
(gloo ranks, real megatron-core).

Two variants of the embedded tiny GPT (2 layers, hidden 64, vocab 128, BF16):

* ``random``: the deterministic random initialisation (same full weights at every TP size);
* ``outliers``: the same model with planted "massive activations": one token (the "period")
  drives two MLP neurons of layer 0, held by different TP ranks, that write large and nearly
  cancelling values into a few hidden dimensions -- the pattern real LLMs show on such tokens,
  and the one where BF16 partial sums lose the small remainder.

For each variant, mode and TP size it reports, against the same mode at TP=1: KL(p_TP1 || p_TPN),
mean |delta log p| of the target tokens, max |delta logit|, the fraction of bit-identical logits;
and the mean |logit error| against an FP32 run of the same (BF16) weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from typing import Dict, List

MODES = ("native", "fp32-accumulate", "fp32", "tp-invariant")  # the last: tp_invariant=True
VOCAB, SEQ, BATCH, SEED = 128, 32, 4, 1234
HEADS = 8  # with tiny_gpt's hidden 64 and FFN 256: a TP size must divide 8, 64, 256 and VOCAB
TP_SIZES = (1, 2, 4, 8)  # the divisors of gcd(HEADS, 64, 256, VOCAB) = 8
DEFAULT_TP, QUICK_TP = "1,2,4,8", "1,2"
PERIOD = 13  # the planted token
OUTLIER_DIMS = (5, 21, 38, 50)


def _plant_outliers(model, ctx) -> None:
    """Planted massive activations, identical in the full model at every TP size."""
    import torch
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    emb = model.embedding.word_embeddings.weight  # [vocab/TP, hidden]
    per_rank_vocab = emb.shape[0]
    mlp = model.decoder.layers[0].mlp
    fc1, fc2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight  # [ffn/TP, h], [h, ffn/TP]
    shard = fc1.shape[0]
    ffn = shard * parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        if tp_rank == PERIOD // per_rank_vocab:
            emb[PERIOD % per_rank_vocab, 0] = 4.0  # the period token carries dimension 0
        for neuron, scale in ((3, 64.0), (ffn - 3, -63.5)):  # first and last TP shard
            if neuron // shard == tp_rank:
                local = neuron % shard
                fc1[local, 0] = 2.0
                for d in OUTLIER_DIMS:
                    fc2[d, local] = scale


def _logits(ctx, variant: str, tp: int):
    import torch
    from megapatch.testing import build_tiny_gpt, gather_tp_logits, tiny_gpt_config

    model = build_tiny_gpt(tiny_gpt_config(tp=tp, num_attention_heads=HEADS), vocab_size=VOCAB, seq_len=SEQ, seed=SEED)
    if variant == "outliers":
        _plant_outliers(model, ctx)
    batch = _batch()
    with torch.no_grad():
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
    return gather_tp_logits(logits, ctx).float()


def _batch():
    from megapatch.testing import make_batch

    batch = make_batch(seed=5, batch=BATCH, seq_len=SEQ, vocab=VOCAB)
    batch.tokens[:, 4] = PERIOD
    batch.tokens[:, 17] = PERIOD
    return batch


def _fp32_reference(ctx, variant: str):
    """The same BF16 weights held and run in FP32 at TP=1."""
    import torch
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    bf16 = build_tiny_gpt(tiny_gpt_config(tp=1, num_attention_heads=HEADS), vocab_size=VOCAB, seq_len=SEQ, seed=SEED)
    if variant == "outliers":
        _plant_outliers(bf16, ctx)
    config = tiny_gpt_config(tp=1, num_attention_heads=HEADS, params_dtype=torch.float32,
                             pipeline_dtype=torch.float32, bf16=False)
    model = build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ, seed=SEED)
    model.load_state_dict(bf16.state_dict())
    batch = _batch()
    with torch.no_grad():
        return model(batch.tokens, batch.position_ids, batch.attention_mask).float()


def _mode_options(mode: str) -> dict:
    """The ``megapatch.enable()`` arguments of a demo mode."""
    return {"tp_invariant": True} if mode == "tp-invariant" else {"tp_reduce_dtype": mode}


def _rank_job(ctx, tps: List[int], modes: List[str], variants: List[str]):
    import megapatch
    from megapatch.testing import reinit_model_parallel

    out: Dict = {}
    for tp in tps:
        ctx = reinit_model_parallel(ctx, tp=tp)
        for mode in modes:
            megapatch.enable(**_mode_options(mode))
            for variant in variants:
                out[(variant, mode, tp)] = _logits(ctx, variant, tp)
            megapatch.disable()
        if ctx.rank == 0:
            print(f"  TP={tp}: done", flush=True)
    ctx = reinit_model_parallel(ctx, tp=1)
    for variant in variants:
        out[(variant, "fp32-reference", 1)] = _fp32_reference(ctx, variant)
    return out if ctx.rank == 0 else None


def metrics(logits: Dict, labels, tps: List[int], modes: List[str],
            variants: List[str]) -> List[dict]:
    import torch

    rows = []
    for variant in variants:
        reference = logits[(variant, "fp32-reference", 1)]
        for mode in modes:
            base = logits[(variant, mode, 1)]
            logp_base = torch.log_softmax(base, -1)
            for tp in tps:
                here = logits[(variant, mode, tp)]
                logp = torch.log_softmax(here, -1)
                kl = (logp_base.exp() * (logp_base - logp)).sum(-1).mean().item()
                target = lambda lp: lp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
                rows.append({
                    "variant": variant, "mode": mode, "tp": tp,
                    "kl_vs_tp1": kl,
                    "mean_abs_dlogp_target": (target(logp_base) - target(logp)).abs().mean().item(),
                    "max_abs_dlogit": (here - base).abs().max().item(),
                    "bit_identical": (here == base).float().mean().item(),
                    "err_vs_fp32": (here - reference).abs().mean().item(),
                })
    return rows


def format_table(rows: List[dict]) -> str:
    header = ("variant", "mode", "TP", "KL(TP1||TPN)", "mean|dlogp|", "max|dlogit|", "bit-identical",
              "mean|err| vs FP32")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['mode']} | {r['tp']} | {r['kl_vs_tp1']:.3e} | "
                     f"{r['mean_abs_dlogp_target']:.3e} | {r['max_abs_dlogit']:.3e} | "
                     f"{100 * r['bit_identical']:.1f}% | {r['err_vs_fp32']:.3e} |")
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'megapatch[plot]')", file=sys.stderr)
        return False
    variants = sorted({r["variant"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(variants), figsize=(5.5 * len(variants), 4), squeeze=False)
    for ax, variant in zip(axes[0], variants):
        for mode, marker in zip(MODES, "osD^"):
            pts = [(r["tp"], r["max_abs_dlogit"]) for r in rows if r["variant"] == variant and r["mode"] == mode]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor-parallel size")
        ax.set_ylabel("max |logit(TP=N) - logit(TP=1)|")
        ax.set_title(f"tiny GPT ({variant})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _tp_sizes(text: str) -> List[int]:
    """argparse type of --tp: TP sizes the demo model can be split into (TP=1, the reference, is
    always run)."""
    sizes = []
    for item in text.split(","):
        try:
            size = int(item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item.strip()!r} in {text!r} is not an integer; valid TP sizes: "
                f"{', '.join(map(str, TP_SIZES))}") from None
        if size not in TP_SIZES:
            raise argparse.ArgumentTypeError(
                f"TP size {size} cannot split the demo model (8 heads, hidden 64, FFN 256, vocab "
                f"{VOCAB}); valid TP sizes: {', '.join(map(str, TP_SIZES))}")
        sizes.append(size)
    return sorted(set(sizes) | {1})


def _modes(text: str) -> List[str]:
    """argparse type of --modes."""
    chosen = []
    for item in text.split(","):
        mode = item.strip()
        if mode not in MODES:
            raise argparse.ArgumentTypeError(
                f"mode {mode!r} is not a demo mode; valid modes: {', '.join(MODES)}")
        if mode not in chosen:
            chosen.append(mode)
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=_tp_sizes, default=None, metavar="SIZES",
                        help=f"comma-separated TP sizes from {{{', '.join(map(str, TP_SIZES))}}} "
                             f"(default {DEFAULT_TP}; 1, the reference, is always run)")
    parser.add_argument("--modes", type=_modes, default=list(MODES), metavar="MODES",
                        help=f"comma-separated, from {{{', '.join(MODES)}}} (default: all)")
    parser.add_argument("--plot", default="tp_invariance.png", help="PNG path ('' for none)")
    parser.add_argument("--json", default="", help="write the table as JSON to this path")
    parser.add_argument("--quick", action="store_true",
                        help=f"TP sizes {QUICK_TP} only (2 ranks) unless --tp is given")
    parser.add_argument("--verbose", action="store_true",
                        help="show the ranks' upstream warnings (hidden and counted by default)")


_WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: ")


def count_warnings(text: str) -> int:
    """Python warnings in a captured stderr (``file:line: SomeWarning: message`` lines)."""
    return sum(1 for line in text.splitlines() if _WARNING_LINE.match(line))


def _quietly(fn, verbose: bool):
    """``(fn(), warnings hidden)``: this process's upstream warnings recorded instead of shown."""
    if verbose:
        return fn(), 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        value = fn()
    return value, len(caught)


def run_demo(args) -> int:
    from megapatch.testing import RankFailure, run_ranks

    tps = args.tp or _tp_sizes(QUICK_TP if args.quick else DEFAULT_TP)
    modes = list(args.modes)
    variants = ["random", "outliers"]
    world = max(tps)
    started = time.time()
    print(f"megapatch demo: tiny GPT, TP sizes {tps}, modes {modes}, on {world} CPU ranks (gloo)...",
          flush=True)
    stderr_dir = None if args.verbose else tempfile.mkdtemp(prefix="megapatch-demo-")
    try:
        try:
            logits = run_ranks(_rank_job, world_size=world, tp=1, args=(tps, modes, variants),
                               timeout=900, stderr_dir=stderr_dir)[0]
        except RankFailure as exc:
            print(f"megapatch demo failed: {exc}", file=sys.stderr)
            for rank, text in _rank_logs(stderr_dir):
                print(f"--- rank {rank} stderr (last lines) ---\n" + "\n".join(text.splitlines()[-20:]),
                      file=sys.stderr)
            return 1
        hidden = sum(count_warnings(text) for _rank, text in _rank_logs(stderr_dir))
    finally:
        if stderr_dir:
            shutil.rmtree(stderr_dir, ignore_errors=True)
    labels, parent_hidden = _quietly(lambda: _batch().labels, args.verbose)
    rows = metrics(logits, labels, tps, modes, variants)
    print()
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
        print(f"\ntable written to {args.json}")
    if args.plot:
        written, more = _quietly(lambda: plot(rows, args.plot), args.verbose)
        parent_hidden += more
        if written:
            print(f"\nplot written to {os.path.abspath(args.plot)}")
    hidden += parent_hidden
    print(f"\n({time.time() - started:.0f} s" + (f"; {hidden} upstream warnings hidden, --verbose to show)"
                                               if hidden else ")"))
    return 0


def _rank_logs(stderr_dir):
    if not stderr_dir:
        return []
    logs = []
    for name in sorted(os.listdir(stderr_dir)):
        match = re.fullmatch(r"rank(\d+)\.stderr", name)
        if match:
            with open(os.path.join(stderr_dir, name), errors="replace") as fh:
                logs.append((int(match.group(1)), fh.read()))
    return sorted(logs)
