"""``megapatch demo``: how much the logits of one tiny model drift when only the TP size changes,
with native BF16 reductions, fp32-accumulate, fp32 and tp-invariant (``tp_invariant=True``), on CPU
(gloo ranks, real megatron-core).

Three models (``--model``):

* ``gpt`` (the default): 2 layers, hidden 64, 8 heads, FFN 256, vocab 128, BF16; GELU MLP,
  LayerNorm, learned positions, biases;
* ``llama``: the Llama family's layer: 2 layers, hidden 128, 16 heads in 8 KV groups
  (grouped-query attention), SwiGLU FFN 192, RMSNorm, RoPE, untied output layer, no biases, vocab
  128, BF16 (every TP-split size divisible by 8, so TP 8 works and ``tp-invariant`` applies: KV
  groups >= TP);
* ``moe``: a tiny Qwen3-MoE (QK RMSNorm, 8 experts top-2, alltoall dispatcher, 8 heads in 2 KV
  groups, so TP 1/2/4), random weights only; the table adds the expert choices that changed
  against TP 1 and against the FP32 reference.

Why ``gpt`` stays the default: its figures are the documented ones (README's "Fresh machine",
docs/results.md and results/tp_invariance.md quote what plain ``megapatch demo`` prints, bit for
bit), and switching would silently change that output for everyone following those pages. Run
time does not decide it (both cost about the same: 58-66 s of CPU time for TP 1/2/4/8 on the
project's 2-core machine), nor does the finding (native and fp32-accumulate drift with TP, fp32
nearly and tp-invariant exactly invariant on both models: results/tp_invariance_llama.md).
Llama-family users, most of megapatch's users, get their architecture with ``--model llama``; once
the docs carry the Llama table, making it the default is a one-line change (``DEFAULT_MODEL``).

Two variants of the gpt and llama models:

* ``random``: the deterministic random initialisation (same full weights at every TP size);
* ``outliers``: the same model with planted "massive activations": one token (the "period")
  drives two MLP neurons of layer 0, held by different TP ranks, that write large and nearly
  cancelling values into a few hidden dimensions -- the pattern real LLMs show on such tokens,
  and the one where BF16 partial sums lose the small remainder. (In the Llama model the gate and
  the up rows of the two neurons read the period's dimension and nothing else, so the neurons stay
  quiet on other tokens.)

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

# --model: what the table, the progress line and the plot call each model, and the llama_config
# fields of the Llama one (a TP size must divide 16 heads, 8 KV groups, hidden 128, FFN 192, VOCAB:
# the same TP_SIZES)
MODELS = ("gpt", "llama", "moe")
DEFAULT_MODEL = "gpt"
TITLES = {"gpt": "tiny GPT", "llama": "tiny Llama", "moe": "tiny Qwen3-MoE"}
DESCRIPTIONS = {"gpt": "tiny GPT", "llama": "tiny Llama (SwiGLU, RMSNorm, RoPE, 16 heads / 8 KV groups)",
                "moe": "tiny Qwen3-MoE (QK RMSNorm, 8 experts top-2, alltoall dispatcher, SP at TP > 1)"}
LLAMA = dict(hidden_size=128, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=192)
DEFAULT_PLOTS = {"gpt": "tp_invariance.png", "llama": "tp_invariance_llama.png", "moe": "tp_invariance_moe.png"}
# the MoE model (megapatch.testing.scenarios.moe_tiny, 8 heads in 2 KV groups): TP up to 4; no
# planted outliers (its MLPs are experts)
MOE_TP_SIZES = (1, 2, 4)
# the Llama model's planted neurons: their gate and up weights on the period's dimension (silu(5.6)
# * 5.6 = 32 on the period, whose dimension 0 is 11.3 after RMSNorm; fc2 then writes +2035 and
# -2019 into each OUTLIER_DIM: a remainder of 16, which a BF16 partial sum rounds away)
LLAMA_GATE, LLAMA_UP = 0.5, 0.5


def _plant_outliers(model) -> None:
    """Planted massive activations, identical in the full model at every TP size: the period
    token carries dimension 0; two layer-0 neurons (the first and the last TP shard's, so on
    different ranks at TP 2/4/8) read it, and fc2 writes large, nearly cancelling values into
    OUTLIER_DIMS. A gated fc1 (SwiGLU) holds [gate_r; up_r] on rank r: each neuron's gate row and up
    row then read the period's dimension only (zero elsewhere: silu(g x0) * u x0 is ~0.1 on other
    tokens, 32 on the period)."""
    import torch
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    emb = model.embedding.word_embeddings.weight  # [vocab/TP, hidden]
    per_rank_vocab = emb.shape[0]
    mlp = model.decoder.layers[0].mlp
    fc1, fc2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight  # [(2 if gated) ffn/TP, h], [h, ffn/TP]
    shard = fc2.shape[1]
    ffn = shard * parallel_state.get_tensor_model_parallel_world_size()
    gated = model.config.gated_linear_unit
    with torch.no_grad():
        if tp_rank == PERIOD // per_rank_vocab:
            emb[PERIOD % per_rank_vocab, 0] = 4.0  # the period token carries dimension 0
        for neuron, scale in ((3, 64.0), (ffn - 3, -63.5)):  # first and last TP shard
            if neuron // shard != tp_rank:
                continue
            local = neuron % shard
            if gated:
                for row, weight in ((local, LLAMA_GATE), (shard + local, LLAMA_UP)):  # gate, up
                    fc1[row] = 0.0
                    fc1[row, 0] = weight
            else:
                fc1[local, 0] = 2.0
            for d in OUTLIER_DIMS:
                fc2[d, local] = scale


def _build(model_name: str, tp: int, **overrides):
    """The demo's model ``model_name`` at TP ``tp`` (``overrides``: config fields)."""
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    if model_name == "moe":
        from megapatch.testing.scenarios import moe_tiny

        return build_tiny_gpt(moe_tiny.qwen3_moe_config(tp, **overrides), vocab_size=VOCAB, seq_len=SEQ,
                              seed=SEED, position_embedding_type="rope")
    if model_name == "llama":
        from megapatch.testing.models.tiny_gpt import llama_config

        return build_tiny_gpt(llama_config(tp, **LLAMA, **overrides), vocab_size=VOCAB, seq_len=SEQ,
                              seed=SEED, position_embedding_type="rope")
    return build_tiny_gpt(tiny_gpt_config(tp=tp, num_attention_heads=HEADS, **overrides),
                          vocab_size=VOCAB, seq_len=SEQ, seed=SEED)


def _logits(ctx, variant: str, tp: int, model_name: str = DEFAULT_MODEL):
    """Full logits; for the MoE model ``(logits, every layer's expert choices)``."""
    import torch
    from megapatch.testing import gather_tp_logits

    model = _build(model_name, tp)
    if variant == "outliers":
        _plant_outliers(model)
    routing = _routing(model, ctx) if model_name == "moe" else None
    batch = _batch()
    with torch.no_grad():
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
    logits = gather_tp_logits(logits, ctx).float()
    return logits if routing is None else (logits, routing)


def _routing(model, ctx):
    from megapatch.testing.scenarios.moe_tiny import _record_routing

    return _record_routing(model, ctx)


def _batch():
    from megapatch.testing import make_batch

    batch = make_batch(seed=5, batch=BATCH, seq_len=SEQ, vocab=VOCAB)
    batch.tokens[:, 4] = PERIOD
    batch.tokens[:, 17] = PERIOD
    return batch


def _fp32_reference(ctx, variant: str, model_name: str = DEFAULT_MODEL):
    """The same BF16 weights held and run in FP32 at TP=1."""
    import torch

    bf16 = _build(model_name, 1)
    if variant == "outliers":
        _plant_outliers(bf16)
    model = _build(model_name, 1, params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False)
    model.load_state_dict(bf16.state_dict())
    routing = _routing(model, ctx) if model_name == "moe" else None
    batch = _batch()
    with torch.no_grad():
        logits = model(batch.tokens, batch.position_ids, batch.attention_mask).float()
    return logits if routing is None else (logits, routing)


def _mode_options(mode: str) -> dict:
    """The ``megapatch.enable()`` arguments of a demo mode."""
    return {"tp_invariant": True} if mode == "tp-invariant" else {"tp_reduce_dtype": mode}


def _rank_job(ctx, tps: List[int], modes: List[str], variants: List[str],
              model_name: str = DEFAULT_MODEL):
    import megapatch
    from megapatch.testing import reinit_model_parallel

    out: Dict = {}
    for tp in tps:
        ctx = reinit_model_parallel(ctx, tp=tp)
        for mode in modes:
            megapatch.enable(**_mode_options(mode))
            for variant in variants:
                out[(variant, mode, tp)] = _logits(ctx, variant, tp, model_name)
            megapatch.disable()
        if ctx.rank == 0:
            print(f"  TP={tp}: done", flush=True)
    ctx = reinit_model_parallel(ctx, tp=1)
    for variant in variants:
        out[(variant, "fp32-reference", 1)] = _fp32_reference(ctx, variant, model_name)
    return out if ctx.rank == 0 else None


def metrics(logits: Dict, labels, tps: List[int], modes: List[str],
            variants: List[str]) -> List[dict]:
    import torch

    rows = []
    for variant in variants:
        reference, reference_routing = _split(logits[(variant, "fp32-reference", 1)])
        for mode in modes:
            base, base_routing = _split(logits[(variant, mode, 1)])
            logp_base = torch.log_softmax(base, -1)
            for tp in tps:
                here, routing = _split(logits[(variant, mode, tp)])
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
                if routing is not None:  # MoE: share of (token, layer) top-k sets changed
                    rows[-1]["experts_changed_vs_tp1"] = _changed(routing, base_routing)
                    rows[-1]["experts_differing_from_fp32"] = _changed(routing, reference_routing)
    return rows


def _split(entry):
    return entry if isinstance(entry, tuple) else (entry, None)


def _changed(routing, reference) -> float:
    changed = sum(int((a != b).any(-1).sum()) for a, b in zip(routing, reference))
    return changed / sum(r.shape[0] for r in reference)


def format_table(rows: List[dict]) -> str:
    moe = any("experts_changed_vs_tp1" in r for r in rows)
    header = ("variant", "mode", "TP", "KL(TP1||TPN)", "mean|dlogp|", "max|dlogit|", "bit-identical",
              "mean|err| vs FP32") + (("experts changed vs TP1", "experts differing from FP32") if moe else ())
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['mode']} | {r['tp']} | {r['kl_vs_tp1']:.3e} | "
                     f"{r['mean_abs_dlogp_target']:.3e} | {r['max_abs_dlogit']:.3e} | "
                     f"{100 * r['bit_identical']:.1f}% | {r['err_vs_fp32']:.3e} |"
                     + (f" {100 * r['experts_changed_vs_tp1']:.2f}% | {100 * r['experts_differing_from_fp32']:.2f}% |"
                        if moe else ""))
    return "\n".join(lines)


def plot(rows: List[dict], path: str, title: str = TITLES[DEFAULT_MODEL]) -> bool:
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
        ax.set_title(f"{title} ({variant})")
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
                f"TP size {size} cannot split the demo models (gpt: 8 heads, hidden 64, FFN 256; "
                f"llama: 16 heads, 8 KV groups, hidden 128, FFN 192; vocab {VOCAB}); valid TP "
                f"sizes: {', '.join(map(str, TP_SIZES))}")
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
    parser.add_argument("--model", choices=MODELS, default=DEFAULT_MODEL,
                        help="gpt: GELU, LayerNorm, learned positions, biases (default; the "
                             "documented figures); llama: SwiGLU, RMSNorm, RoPE, grouped-query "
                             "attention, untied output layer, no biases; moe: Qwen3-MoE-shaped, "
                             "8 experts top-2, QK RMSNorm, TP up to 4, expert choices reported")
    parser.add_argument("--tp", type=_tp_sizes, default=None, metavar="SIZES",
                        help=f"comma-separated TP sizes from {{{', '.join(map(str, TP_SIZES))}}} "
                             f"(default {DEFAULT_TP}; 1, the reference, is always run)")
    parser.add_argument("--modes", type=_modes, default=list(MODES), metavar="MODES",
                        help=f"comma-separated, from {{{', '.join(MODES)}}} (default: all)")
    parser.add_argument("--plot", default=None,
                        help="PNG path ('' for none; default tp_invariance.png, with --model llama "
                             "tp_invariance_llama.png)")
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

    model_name = getattr(args, "model", DEFAULT_MODEL)
    tps = args.tp or _tp_sizes(QUICK_TP if args.quick else DEFAULT_TP)
    modes = list(args.modes)
    variants = ["random", "outliers"]
    if model_name == "moe":
        refused = _moe_refusal(args, tps)
        if refused:
            print(f"megapatch demo: {refused}", file=sys.stderr)
            return 2
        tps = [tp for tp in tps if tp in MOE_TP_SIZES] if args.tp is None else tps
        variants = ["random"]
    world = max(tps)
    plot_path = DEFAULT_PLOTS[model_name] if args.plot is None else args.plot
    started = time.time()
    print(f"megapatch demo: {DESCRIPTIONS[model_name]}, TP sizes {tps}, modes {modes}, on {world} "
          f"CPU ranks (gloo)...", flush=True)
    stderr_dir = None if args.verbose else tempfile.mkdtemp(prefix="megapatch-demo-")
    try:
        try:
            logits = run_ranks(_rank_job, world_size=world, tp=1, args=(tps, modes, variants, model_name),
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
    if plot_path:
        written, more = _quietly(lambda: plot(rows, plot_path, TITLES[model_name]), args.verbose)
        parent_hidden += more
        if written:
            print(f"\nplot written to {os.path.abspath(plot_path)}")
    hidden += parent_hidden
    print(f"\n({time.time() - started:.0f} s" + (f"; {hidden} upstream warnings hidden, --verbose to show)"
                                               if hidden else ")"))
    return 0


def _moe_refusal(args, tps: List[int]):
    """Why ``--model moe`` cannot run what was asked (None: it can)."""
    wrong = [tp for tp in tps if tp not in MOE_TP_SIZES]
    if args.tp is not None and wrong:
        return (f"--tp {','.join(map(str, wrong))}: the moe model (8 heads in 2 KV groups) splits at TP "
                f"{', '.join(map(str, MOE_TP_SIZES))} only")
    return None


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
