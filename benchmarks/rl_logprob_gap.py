"""The trainer-vs-rollout log-prob gap, measured as Megatron RL measures it, on CPU.

    python benchmarks/rl_logprob_gap.py [--out results/rl_logprob_gap.md]

Rollouts come from megatron-core's dynamic inference engine (``DynamicInferenceEngine``, as
Megatron RL's ``train_rl.py`` runs them; CPU stand-ins from
``megapatch.testing.stand_ins.dynamic_inference_compat``); the trainer recomputes the same tokens' log-probs
with the training forward (the whole sequence in one pass, no KV cache) and Megatron RL's
``selective_log_softmax`` arithmetic: FP32 logits -> log-sum-exp in FP32, BF16 logits ->
log_softmax in BF16. Statistics over the generated tokens, as ``megatron/rl/rl_utils.py``
(``update_inference_logprobs_group_stats``) logs them: mean and max |p_train - p_inference|, min
and max of the ratio exp(logp_train - logp_inference); plus the RMS of logp_train - logp_inference
and the greedy flip rate (a greedy rollout's token is not the trainer's argmax at that position).

The model: the demo's tiny GPT (2 layers, hidden 64, 8 heads, FFN 256, BF16, local layers) with
its planted outlier channels (``megapatch.commands.demo``), vocabulary 256, learned positions.
Prompts: PROMPTS random prompts of PROMPT_LEN tokens with the outlier token every 8th position;
GENERATE tokens each, sampled at temperature 1 from the full distribution (the log-prob
statistics) and greedily (the flip rate). Layouts (rollout TP / trainer TP): 1/1, 2/2, 1/2, and
with ``--tp4`` 2/4 and 4/4. Each mode runs in one job of max-TP gloo ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

MODES = {
    "native": {},
    "fp32 logits": dict(logits_dtype="fp32"),
    "fp32 logits + tp_reduce_dtype=fp32": dict(logits_dtype="fp32", tp_reduce_dtype="fp32"),
    "tp_invariant + fp32 logits": dict(logits_dtype="fp32", tp_invariant=True),
}
VOCAB, PROMPTS, PROMPT_LEN, GENERATE, SEED, HEADS = 256, 8, 32, 96, 1234, 8
MAX_SEQ = PROMPT_LEN + GENERATE


def _prompts():
    from megapatch.commands.demo import PERIOD

    generator = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, VOCAB - 1, (PROMPTS, PROMPT_LEN), generator=generator)
    prompts[:, 3::8] = PERIOD
    return prompts.tolist()


def _model(tp):
    from megapatch.commands.demo import _plant_outliers
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config

    model = build_tiny_gpt(tiny_gpt_config(tp=tp, num_attention_heads=HEADS), vocab_size=VOCAB,
                           seq_len=MAX_SEQ, seed=SEED).eval()
    _plant_outliers(model)
    return model


def _rollout(ctx, tp, greedy):
    from megapatch.testing.stand_ins.dynamic_inference_compat import dynamic_engine, generate

    engine = dynamic_engine(_model(tp), tp, max_sequence_length=MAX_SEQ, max_requests=PROMPTS)
    torch.manual_seed(SEED)  # the sampler draws from the default generator, the same on every rank
    return generate(engine, _prompts(), GENERATE, temperature=1.0, top_k=1 if greedy else 0)


def _train_logprobs(ctx, tp, sequences):
    """Per sequence: log-probs of tokens 1..n-1 with Megatron RL's log-softmax arithmetic, the same
    with the engine's (``DynamicInferenceContext.calculate_log_probs``: log_softmax of the logits
    upcast to FP32), and the argmax at positions 0..n-2, from the training forward."""
    from megapatch.testing import gather_tp_logits

    model = _model(tp)
    tokens = torch.tensor(sequences)
    n = tokens.shape[1]
    position_ids = torch.arange(n).unsqueeze(0).expand_as(tokens).contiguous()
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1).expand(len(sequences), 1, n, n)
    with torch.no_grad():
        logits = gather_tp_logits(model(tokens, position_ids, mask.contiguous()), ctx)[:, :-1]
    return trainer_logprobs(logits, tokens)


def trainer_logprobs(logits, tokens):
    """From the trainer's logits at positions 0..n-2 of ``tokens``: log-probs of tokens 1..n-1
    with Megatron RL's arithmetic (FP32 logits: ``x - logsumexp``; else log_softmax), the same
    with the engine's (log_softmax of the logits upcast to FP32), the argmax, and the logits dtype."""
    labels = tokens[:, 1:]
    if logits.dtype == torch.float32:
        logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    else:
        logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    engine_logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return logp.float(), logits.float().argmax(-1), str(logits.dtype), engine_logp


def _job(ctx, options, layouts):
    import megapatch
    from megapatch.testing import reinit_model_parallel
    from megapatch.testing.stand_ins.dynamic_inference_compat import dynamic_inference_workarounds

    megapatch.enable(**options)
    out = {"rollouts": {}, "train": {}}
    with dynamic_inference_workarounds():
        for tp in sorted({r for r, _ in layouts}):
            ctx = reinit_model_parallel(ctx, tp=tp)
            out["rollouts"][tp] = {g: _rollout(ctx, tp, g) for g in (False, True)}
        for tp in sorted({t for _, t in layouts}):
            ctx = reinit_model_parallel(ctx, tp=tp)
            for rollout_tp in sorted({r for r, t in layouts if t == tp}):
                for greedy, rows in out["rollouts"][rollout_tp].items():
                    prompts = _prompts()
                    sequences = [p + g for p, (g, _, _) in zip(prompts, rows)]
                    out["train"][rollout_tp, tp, greedy] = _train_logprobs(ctx, tp, sequences)
    out["active"] = list(megapatch.status().active)
    return out


def _stats(found, rollout_tp, train_tp):
    """Megatron RL's statistics over the generated tokens, the RMS gap, the flip rate, and the
    prompt (prefill) tokens' gap."""
    rows = found["rollouts"][rollout_tp][False]
    train_logp, _, train_dtype, engine_logp = found["train"][rollout_tp, train_tp, False]
    start = PROMPT_LEN - 1  # train_logp[:, i] scores token i + 1
    inference = torch.tensor([lp for _, lp, _ in rows], dtype=torch.float64)
    train = train_logp[:, start:].double()
    diff = train - inference
    abs_p = (train.exp() - inference.exp()).abs()
    ratio = diff.exp()
    prompt_inf = torch.tensor([lp for _, _, lp in rows], dtype=torch.float64)
    prompt_diff = train_logp[:, :start].double() - prompt_inf
    greedy_rows = found["rollouts"][rollout_tp][True]
    train_argmax = found["train"][rollout_tp, train_tp, True][1]
    same_arithmetic = engine_logp[:, start:].double() - inference
    greedy_tokens = torch.tensor([g for g, _, _ in greedy_rows])
    flips = (train_argmax[:, start:] != greedy_tokens).double()
    return dict(
        mean_abs_p=abs_p.mean().item(), max_abs_p=abs_p.max().item(),
        min_ratio=ratio.min().item(), max_ratio=ratio.max().item(),
        rms=diff.pow(2).mean().sqrt().item(), identical=(diff == 0).double().mean().item(),
        same_identical=(same_arithmetic == 0).double().mean().item(),
        same_max=same_arithmetic.abs().max().item(),
        flip=flips.mean().item(), prefill_max=prompt_diff.abs().max().item(),
        prefill_identical=(prompt_diff == 0).double().mean().item(),
        tokens=diff.numel(), train_dtype=train_dtype)


def _fmt(x):
    if x == 0:
        return "0"
    return f"{x:.2e}" if abs(x) < 1e-2 or abs(x) >= 1e3 else f"{x:.4f}"


def _ratio(lo, hi):
    return f"{lo:.4f} / {hi:.4f}" if (lo, hi) != (1.0, 1.0) else "1 / 1"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/rl_logprob_gap.md")
    parser.add_argument("--tp4", action="store_true", help="add rollout TP2 / trainer TP4 and 4/4 (4 ranks)")
    args = parser.parse_args(argv)
    from megapatch.testing import run_ranks

    layouts = [(1, 1), (2, 2), (1, 2)] + ([(4, 4), (2, 4)] if args.tp4 else [])
    world = max(t for _, t in layouts)
    started = time.time()
    results = {}
    for mode, options in MODES.items():
        t0 = time.time()
        results[mode] = run_ranks(_job, world_size=world, args=(options, layouts), timeout=1800)[0]
        print(f"{mode}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    elapsed = time.time() - started
    table = {mode: {layout: _stats(found, *layout) for layout in layouts} for mode, found in results.items()}
    text = _report(table, layouts, results, argv, elapsed)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


def _report(table, layouts, results, argv, elapsed):
    import megatron.core

    command = " ".join(["python benchmarks/rl_logprob_gap.py"] + list(argv or sys.argv[1:]))
    heads = [f"rollout TP{r} / trainer TP{t}" for r, t in layouts]
    lines = [
        "# Trainer vs rollout log-probs (Megatron RL's statistics), dynamic inference engine, CPU",
        "",
        "```",
        command,
        "```",
        "",
        f"megatron-core {megatron.core.__version__}, torch {torch.__version__}; {len(MODES)} jobs, "
        f"{elapsed:.0f} s in all on this machine. Model: tiny GPT (2 layers, hidden 64, 8 heads, FFN 256, "
        f"vocab {VOCAB}, BF16, local layers) with planted outlier channels; {PROMPTS} prompts x "
        f"{PROMPT_LEN} tokens, {GENERATE} tokens generated each ({PROMPTS * GENERATE} per cell), "
        f"sampled at temperature 1 (statistics) and greedily (flip rate).",
        "",
    ]
    metrics = [
        ("mean abs(p_train - p_inf)", lambda s: _fmt(s["mean_abs_p"])),
        ("max abs(p_train - p_inf)", lambda s: _fmt(s["max_abs_p"])),
        ("min / max ratio pi_train/pi_inf", lambda s: _ratio(s["min_ratio"], s["max_ratio"])),
        ("RMS logp_train - logp_inf", lambda s: _fmt(s["rms"])),
        ("bit-identical log-probs", lambda s: f"{100 * s['identical']:.1f}%"),
        ("bit-identical log-probs, trainer with the engine's log-softmax arithmetic",
         lambda s: f"{100 * s['same_identical']:.1f}%"),
        ("max abs dlogp, trainer with the engine's log-softmax arithmetic", lambda s: _fmt(s["same_max"])),
        ("greedy flip rate", lambda s: f"{100 * s['flip']:.2f}%"),
        ("prompt tokens (prefill): max abs dlogp", lambda s: _fmt(s["prefill_max"])),
    ]
    for title, cell in metrics:
        lines += [f"**{title}**", "", "| mode | " + " | ".join(heads) + " |",
                  "|---|" + "---|" * len(heads)]
        for mode, row in table.items():
            lines.append(f"| {mode} | " + " | ".join(cell(row[layout]) for layout in layouts) + " |")
        lines.append("")
    lines += ["Trainer logits dtype per mode: " + ", ".join(
        f"{mode}: {row[layouts[0]]['train_dtype']}" for mode, row in table.items()) + ".", ""]
    lines += ["Patches active per mode: " + "; ".join(
        f"{mode}: {', '.join(found['active']) or 'none'}" for mode, found in results.items()) + ".", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
