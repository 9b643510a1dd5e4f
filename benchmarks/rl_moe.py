"""Trainer-vs-rollout log-probs and expert choices on an MoE model, with and without router replay.

    python benchmarks/rl_moe.py [--out results/rl_moe.md]

Rollouts come from megatron-core's dynamic inference engine (as ``benchmarks/rl_logprob_gap.py``
runs them: CPU stand-ins of ``megapatch.testing.stand_ins.dynamic_inference_compat``); the trainer
recomputes the same tokens' log-probs with a full-sequence training forward at another TP / EP
layout, with Megatron RL's log-softmax arithmetic, and the statistics are Megatron RL's
(``rl_logprob_gap._stats``: mean / max |p_train - p_inf|, ratio range, RMS, greedy flips).

The model: ``megapatch.testing.scenarios.moe_tiny``'s Qwen3-MoE (2 layers, hidden 64, QK RMSNorm, 8
experts top-2, alltoall dispatcher, BF16), built with ``moe_enable_routing_replay=True`` so that
upstream's ``RouterReplay`` (``transformer/moe/router_replay.py``) sits in every router; no sequence
parallelism on either side (the engine's context is not sequence-split). The same full weights at
every layout (``moe_tiny.build_full_then_shard``).

Router replay (R3) as upstream's pieces allow it: during the rollout every router runs under
``RouterReplayAction.RECORD``; a forward hook on each router reads the engine's context at that step
(``token_to_request_idx``, ``token_to_pos_ids``, ``request_ids``) to key each recorded row of top-k
indices by (request, position): prefill and decode steps, packed as the engine packs them. The
trainer's forward then runs under ``REPLAY_FORWARD`` with ``RouterReplay.set_replay_data`` given
those indices in the trainer's token order (sequence-major). The last generated token is never fed
to the engine; its row (whose output the log-probs do not use) replays the trainer's own choice.
"Expert choices differing" compares, per (token, layer), the experts the trainer's forward used
(its own choice; with R3 the replayed one, which must equal the rollout's) with the rollout's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from rl_logprob_gap import PROMPT_LEN, _fmt, _ratio, _stats, trainer_logprobs  # noqa: E402  (_stats reads PROMPT_LEN)

MODES = {
    "native": {},
    "fp32 logits": dict(logits_dtype="fp32"),
    "fp32 logits + tp_reduce_dtype=fp32": dict(logits_dtype="fp32", tp_reduce_dtype="fp32"),
    "fp32 logits + tp_invariant": dict(logits_dtype="fp32", tp_invariant=True),
}
PROMPTS, GENERATE, SEED = 8, 40, 1234
MAX_SEQ = PROMPT_LEN + GENERATE
#: (rollout TP, (trainer TP, trainer EP)); world 2
LAYOUTS = ((1, (1, 1)), (1, (2, 1)), (2, (1, 2)), (2, (2, 1)))
READING = "## Reading"  # a hand-written section of the output file, kept when the tables are rewritten


def _prompts():
    from megapatch.testing.scenarios.moe_tiny import VOCAB

    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (PROMPTS, PROMPT_LEN), generator=generator).tolist()


def _build(ctx, tp: int, ep: int):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megapatch.testing.scenarios import moe_tiny

    config = moe_tiny.qwen3_moe_config(tp, sequence_parallel=False, moe_enable_routing_replay=True)
    model = moe_tiny.build_full_then_shard(ctx, ep, config, seed=SEED).eval()
    # upstream keeps every RouterReplay ever built; set_replay_data wants exactly this model's
    RouterReplay.global_router_replay_instances[:] = [router.router_replay for router in _routers(model)]
    return model


def _routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def _rollout(ctx, tp: int, greedy: bool):
    """The engine's generations, and each router's recorded top-k indices keyed by (request, pos)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megapatch.testing.stand_ins.dynamic_inference_compat import dynamic_engine, generate

    model = _build(ctx, tp, 1)
    engine = dynamic_engine(model, tp, max_sequence_length=MAX_SEQ, max_requests=PROMPTS)
    context = engine.context
    recorded = [dict() for _ in _routers(model)]

    def hook(layer, router, args, output):
        rows = context.active_token_count
        indices = router.router_replay.get_recorded_indices()[:rows].sort(dim=-1).values
        request_ids = context.request_ids[context.token_to_request_idx[:rows].long()].tolist()
        positions = context.token_to_pos_ids[:rows].tolist()
        for request, position, row in zip(request_ids, positions, indices):
            recorded[layer][int(request), int(position)] = row.clone()

    for layer, router in enumerate(_routers(model)):
        router.register_forward_hook(lambda m, a, o, layer=layer: hook(layer, m, a, o))
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    try:
        torch.manual_seed(SEED)
        rows = generate(engine, _prompts(), GENERATE, temperature=1.0, top_k=1 if greedy else 0)
    finally:
        RouterReplay.clear_global_router_replay_action()
    first_request = min(request for request, _ in recorded[0])
    # the i-th prompt is request first + i (generate adds them in order)
    by_prompt = [{(r - first_request, p): v for (r, p), v in layer.items()} for layer in recorded]
    return rows, by_prompt


def _train(ctx, tp: int, ep: int, sequences, replay):
    """Log-probs (Megatron RL's arithmetic), argmax, logits dtype, the engine-arithmetic log-probs,
    and the top-k sets per layer the trainer's forward routed with ([tokens, topk], sequence-major):
    its own, or the replayed ones."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megapatch.testing import gather_tp_logits

    model = _build(ctx, tp, ep)
    tokens = torch.tensor(sequences)
    batch, n = tokens.shape
    position_ids = torch.arange(n).unsqueeze(0).expand_as(tokens).contiguous()
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1).expand(batch, 1, n, n).contiguous()
    own = []
    handles = [r.register_forward_hook(lambda m, a, o: own.append(o[1].detach().clone())) for r in _routers(model)]
    with torch.no_grad():
        logits = model(tokens, position_ids, mask)  # the trainer's own routing
    for handle in handles:
        handle.remove()
    own_topk = [routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1) for routing_map in own]
    replayed = []
    if replay is not None:
        targets = []
        for layer, recorded in enumerate(replay):
            target = own_topk[layer].clone()  # rows [s * batch + b]; the last position keeps its own
            for (b, p), row in recorded.items():
                if p < n - 1:
                    target[p * batch + b] = row
            targets.append(target)
        RouterReplay.set_replay_data(targets)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            handles = [r.register_forward_hook(lambda m, a, o: replayed.append(o[1].detach().clone()))
                       for r in _routers(model)]
            with torch.no_grad():
                logits = model(tokens, position_ids, mask)
        finally:
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()
            for handle in handles:
                handle.remove()
        own_topk = [m.nonzero()[:, 1].view(m.shape[0], -1) for m in replayed]  # what the replay routed
    logits = gather_tp_logits(logits)[:, :-1]  # over megatron's current TP group
    return trainer_logprobs(logits, tokens), own_topk


def _changed_choices(own_topk, recorded, batch: int, n: int) -> float:
    """Share of (token, layer) pairs the rollout fed (positions 0..n-2) whose top-k set the
    trainer's own routing changes."""
    changed = total = 0
    for layer, rows in enumerate(recorded):
        for (b, p), row in rows.items():
            if p < n - 1:
                total += 1
                changed += int(not torch.equal(own_topk[layer][p * batch + b].sort().values, row))
    return changed / total


def _job(ctx, options):
    import megapatch
    from megapatch.core.errors import MegapatchError
    from megapatch.testing import reinit_model_parallel
    from megapatch.testing.stand_ins.dynamic_inference_compat import dynamic_inference_workarounds

    megapatch.enable(**options)
    out = {"rollouts": {}, "train": {}, "changed": {}}
    recorded = {}
    with dynamic_inference_workarounds():
        for tp in sorted({r for r, _ in LAYOUTS}):
            ctx = reinit_model_parallel(ctx, tp=tp)
            for greedy in (False, True):
                rows, rec = _rollout(ctx, tp, greedy)
                out["rollouts"].setdefault("rows", {})[tp, greedy] = rows
                recorded[tp, greedy] = rec
        for rollout_tp, (tp, ep) in LAYOUTS:
            for greedy in (False, True):
                rows = out["rollouts"]["rows"][rollout_tp, greedy]
                sequences = [p + g for p, (g, _, _) in zip(_prompts(), rows)]
                for replay in (False, True):
                    try:
                        train, own = _train(ctx, tp, ep, sequences, recorded[rollout_tp, greedy] if replay else None)
                    except MegapatchError as exc:  # tp_invariant refuses expert parallelism
                        out.setdefault("refused", {})[rollout_tp, (tp, ep)] = str(exc).split(":")[0]
                        continue
                    out["train"][rollout_tp, (tp, ep), greedy, replay] = train
                    if not greedy:
                        out["changed"][rollout_tp, (tp, ep), replay] = _changed_choices(
                            own, recorded[rollout_tp, greedy], len(sequences), len(sequences[0]))
    out["active"] = list(megapatch.status().active)
    return out


def _cell(found, rollout_tp, trainer, text) -> str:
    refused = found.get("refused", {}).get((rollout_tp, trainer))
    return f"refused ({refused})" if refused else text()


def _same_as_rollout_tp(found, rollout_tp, trainer) -> str:
    """The share of this trainer's log-probs (sampled rollouts, no replay) bit-identical to those
    of the trainer at the rollout's TP, EP 1."""
    reference = found["train"].get((rollout_tp, (rollout_tp, 1), False, False))
    if reference is None:
        return "n/a"
    here, reference = found["train"][rollout_tp, trainer, False, False][0], reference[0]  # Megatron RL's log-probs
    return f"{100 * (here == reference).float().mean().item():.1f}%"


def _layout_stats(found, rollout_tp, trainer, replay):
    """rl_logprob_gap._stats over this layout's rows, in the shape it reads."""
    view = {"rollouts": {rollout_tp: {g: found["rollouts"]["rows"][rollout_tp, g] for g in (False, True)}},
            "train": {(rollout_tp, trainer, g): found["train"][rollout_tp, trainer, g, replay] for g in (False, True)}}
    return _stats(view, rollout_tp, trainer)


def main(argv=None):
    from megapatch.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/rl_moe.md")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES):
        parser.error(f"--modes {args.modes!r}: choose among {', '.join(MODES)}")
    started = time.time()
    results = {mode: run_ranks(_job, world_size=2, args=(MODES[mode],), timeout=3600)[0] for mode in modes}
    elapsed = time.time() - started
    replay_missed = {(mode, layout): share for mode, found in results.items()
                     for (*layout, replay), share in found["changed"].items() if replay and share}
    if replay_missed:  # R3 must route every token as the rollout did, or its rows mean nothing
        raise SystemExit(f"router replay did not take: expert choices still differ {replay_missed}")
    text = _report(results, argv, elapsed)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    reading = ""  # the hand-written reading below the tables is kept across reruns
    if os.path.exists(args.out):
        with open(args.out) as f:
            kept = f.read()
        reading = kept[kept.index(READING):] if READING in kept else ""
    with open(args.out, "w") as f:
        f.write(text + ("\n" + reading if reading else ""))
    print(text)


def _report(results, argv, elapsed):
    import megatron.core

    command = " ".join(["python benchmarks/rl_moe.py"] + list(argv or sys.argv[1:]))
    heads = [f"rollout TP{r} / trainer TP{t} EP{e}" for r, (t, e) in LAYOUTS]
    lines = ["# RL on an MoE model: trainer vs rollout log-probs and expert choices, with and without "
             "router replay (CPU)", "", "```", command, "```", "",
             f"megatron-core {megatron.core.__version__}, torch {torch.__version__}; {elapsed:.0f} s on this "
             f"machine. {PROMPTS} prompts x {PROMPT_LEN} tokens, {GENERATE} generated each "
             f"({PROMPTS * GENERATE} per cell), sampled at temperature 1 (statistics) and greedily (flip rate). "
             "How replay is recorded and applied: the docstring of benchmarks/rl_moe.py.", ""]
    lines += ["**expert choices differing between the trainer's forward and the rollout** (share of (token, "
              "layer) pairs; with R3 the check that the replay took: it must be 0)", "",
              "| mode | replay | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(heads)]
    for mode, found in results.items():
        for replay in (False, True):
            lines.append(f"| {mode} | {'R3' if replay else 'none'} | " + " | ".join(
                _cell(found, r, t, lambda: f"{100 * found['changed'][r, t, replay]:.2f}%") for r, t in LAYOUTS) + " |")
    lines.append("")
    metrics = [("RMS logp_train - logp_inf", lambda s: _fmt(s["rms"])),
               ("max abs(p_train - p_inf)", lambda s: _fmt(s["max_abs_p"])),
               ("min / max ratio pi_train/pi_inf", lambda s: _ratio(s["min_ratio"], s["max_ratio"])),
               ("bit-identical log-probs", lambda s: f"{100 * s['identical']:.1f}%"),
               ("greedy flip rate", lambda s: f"{100 * s['flip']:.2f}%")]
    for title, cell in metrics:
        lines += [f"**{title}**", "", "| mode | replay | " + " | ".join(heads) + " |",
                  "|---|---|" + "---|" * len(heads)]
        for mode, found in results.items():
            for replay in (False, True):
                lines.append(f"| {mode} | {'R3' if replay else 'none'} | " + " | ".join(
                    _cell(found, r, t, lambda: cell(_layout_stats(found, r, t, replay))) for r, t in LAYOUTS) + " |")
        lines.append("")
    lines += ["**trainer log-probs bit-identical to the trainer's at the rollout's TP** (EP 1; the share of "
              "log-probs, sampled rollouts; what tp_invariant promises across the trainer's TP size)", "",
              "| mode | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for mode, found in results.items():
        lines.append(f"| {mode} | " + " | ".join(_cell(found, r, t, lambda: _same_as_rollout_tp(found, r, t))
                                                 for r, t in LAYOUTS) + " |")
    lines.append("")
    lines += ["**the dynamic engine's rollouts at TP 2 against TP 1** (generated tokens identical, and the share "
              "of their log-probs bit-identical; sampled and greedy rollouts)", "",
              "| mode | rollouts with identical tokens | log-probs identical |", "|---|---|---|"]
    for mode, found in results.items():
        rows = found["rollouts"]["rows"]
        same_tokens, same_logp = [], []
        for greedy in (False, True):
            for a, b in zip(rows[1, greedy], rows[2, greedy]):
                same_tokens.append(a[0] == b[0])
                same_logp += [x == y for x, y in zip(a[1], b[1])] if a[0] == b[0] else [False] * len(a[1])
        lines.append(f"| {mode} | {sum(same_tokens)} / {len(same_tokens)} | "
                     f"{100 * sum(same_logp) / max(len(same_logp), 1):.1f}% |")
    lines.append("")
    lines += ["Patches active per mode: " + "; ".join(
        f"{mode}: {', '.join(found['active']) or 'none'}" for mode, found in results.items()) + ".", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
