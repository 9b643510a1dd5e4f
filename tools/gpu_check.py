"""The GPU check: what megapatch's numerics do on a CUDA GPU, in one run sized for one H200 and
about 8 minutes, ready for the first GPU minutes the project gets.

    python tools/gpu_check.py --out DIR              # one CUDA GPU; DIR/gpu_check.json, DIR/gpu_check.md
    python tools/gpu_check.py --dry-run --out DIR    # the same code on CPU at toy sizes (CI: it cannot rot)

On the device machine (its own torch, no network) the wheels travel with the run: see
docs/results.md ("The GPU check") for the one command. Sections, each with its own verdict (a
section that fails records its error and the others still run):

1. ``block_gemm``: the property tp_invariant rests on under cuBLAS: a block GEMM (BF16 operands
   copied contiguous, one FP32-output GEMM per block: ``block_tree.operand``/``product``) gives the
   same bits whichever tensor the block was cut from (the full weight, a TP 2 or TP 4 shard), for
   blocks of N and of K, at several shapes and cut positions. Also recorded, not required: whether
   plain strided views (no copy) give the same bits.
2. ``tp_invariant``: a Llama-shaped model (SwiGLU, RMSNorm, RoPE, GQA) at TP 1/2/4 with the ranks
   sharing the one GPU (NCCL refuses that: gloo on CPU copies of the CUDA tensors, a labelled
   stand-in, ``megapatch.testing.stand_ins.one_gpu_collectives``; the arithmetic is the GPU's):
   logits, loss, every gradient bit-identical under the mode; native is expected to differ.
3. ``batch_invariance``: whether a row's bits depend on how many rows share the GEMM (what a
   rollout at decode batch sizes against the trainer's batch puts at stake; TE #2986): the mode's
   block GEMM and plain BF16 ``torch.matmul`` at 1, 7, 64 and 4096 rows, each row compared with the
   same row inside the 4096-row product. Also, from section 2's ranks: at TP 1, the model's logits
   for one sequence run alone and for a prefix of it, against the same positions in the trainer's
   batch (the training forward at other shapes; the dynamic engine's decode kernels are not run).
   Reported, not required: what the mode promises is TP invariance, not batch invariance.
4. ``fp32_llama``: a Llama of hidden size 1024 at TP 1/2/4 per mode (native, fp32, fp32 + FP32
   logits, tp_invariant) with planted massive activations: KL(TP1||TPN), max |delta logit|, error against the same
   weights run in FP32 (FP32 reductions make TP sizes agree; they do not bring BF16 below TP=1's
   BF16 error), and the cost at TP=1 against native: step time (CUDA events, median) and peak memory
   (the reductions' wire cost needs NCCL over several GPUs and is not measured here).
5. ``te_layers``: a Llama-shaped model from megatron-core's Transformer Engine spec at TP 1/2/4 on the
   one GPU, natively (TE's own kernels and attention backend), under ``fp32`` and under
   ``tp_invariant``: bit-identical to TP 1 per mode (required for tp_invariant), KL(TP1||TPN), and step
   time and peak memory at TP 1 against native TE. Skipped where TE is not installed; its dry run runs
   in CI's te stage (TE's kernels through the labelled CPU runtime).
6. ``production``: the cost of each mode at the shapes people train (hidden 4096, SwiGLU FFN 14336,
   32 heads / 8 KV groups, 4 layers, 4 x 4096 tokens, TP 1; then one sequence of 16,384 tokens where
   it fits): step time and peak memory against native (``tools/gpu_check_production.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_check_production  # noqa: E402 -- the production-shape section, beside this file

SIZES = {
    "gpu": dict(shapes=[(64, 1024, 4096), (256, 4096, 11008), (17, 1536, 3072), (512, 2048, 32000)],
                rows=dict(counts=(1, 7, 64, 4096), kn=[(1024, 4096), (4096, 1024), (2048, 32000)]),
                invariant=dict(hidden_size=512, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=1024,
                               num_layers=2, vocab=4096, seq=128, batch=2),
                llama=dict(hidden_size=1024, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=2816,
                           num_layers=2, vocab=32768, seq=512, batch=2),
                timing=dict(warmup=5, samples=30, batch=8)),
    "dry": dict(shapes=[(8, 64, 128), (5, 96, 64)],
                rows=dict(counts=(1, 7, 64), kn=[(64, 128)]),
                invariant=dict(hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128,
                               num_layers=2, vocab=128, seq=16, batch=2),
                llama=dict(hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128,
                           num_layers=2, vocab=128, seq=32, batch=2),
                timing=dict(warmup=1, samples=2, batch=2)),
}
TPS = (1, 2, 4)
LLAMA_MODES = ("native", "fp32", "fp32+logits", "tp_invariant")
W = 8  # tp_invariant's width: blocks per dimension


# --- 1. block GEMM bit stability ------------------------------------------------------------------


def block_gemm(device: str, shapes) -> dict:
    import torch

    from megapatch.numerics.block_tree import operand, product

    cases, differing, views_differing = 0, [], 0
    gen = torch.Generator(device=device).manual_seed(0)
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        w = torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16)
        for tp in (2, 4):
            nb, kb = n // W, k // W
            for i in range(W // tp):  # the blocks rank 0 holds at this TP size
                rows = slice(i * nb, (i + 1) * nb)
                shard = w[: n // tp]  # TP shard along N (column-parallel)
                full = product(operand(x), operand(w[rows]).t())
                cases += 1
                if not torch.equal(full, product(operand(x), operand(shard[rows]).t())):
                    differing.append(dict(shape=[m, k, n], tp=tp, block=i, dim="N"))
                cols = slice(i * kb, (i + 1) * kb)
                kshard_x, kshard_w = x[:, : k // tp], w[:, : k // tp]  # TP shard along K (row-parallel)
                full = product(operand(x[:, cols]), operand(w[:, cols]).t())
                cases += 1
                if not torch.equal(full, product(operand(kshard_x[:, cols]), operand(kshard_w[:, cols]).t())):
                    differing.append(dict(shape=[m, k, n], tp=tp, block=i, dim="K"))
                raw = x[:, cols].float() @ w[:, cols].float().t()
                views_differing += not torch.equal(raw, kshard_x[:, cols].float() @ kshard_w[:, cols].float().t())
    return dict(ok=not differing, cases=cases, differing=differing,
                plain_views_differing=views_differing,
                gemm="torch.mm(out_dtype=float32)" if device == "cuda" else "FP32 copies (CPU)")


# --- 3. batch invariance: a row's bits against the number of rows ----------------------------------


def batch_invariance(device: str, rows: dict) -> dict:
    import torch

    from megapatch.numerics.block_tree import operand, product

    most = max(rows["counts"])
    gen = torch.Generator(device=device).manual_seed(1)
    found = []
    for k, n in rows["kn"]:
        x = torch.randn(most, k, device=device, generator=gen).to(torch.bfloat16)
        w = torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16)
        # the mode's units of work: a block of N (column-parallel, full K) and a block of K (row-parallel)
        n_block = lambda rows: product(operand(x[:rows]), operand(w[: n // W]).t())  # noqa: E731
        k_block = lambda rows: product(operand(x[:rows, : k // W]), operand(w[:, : k // W]).t())  # noqa: E731
        n_all, k_all, plain_all = n_block(most), k_block(most), x @ w.t()
        for count in rows["counts"][:-1]:
            found.append(dict(k=k, n=n, rows=count, n_block_same=torch.equal(n_block(count), n_all[:count]),
                              k_block_same=torch.equal(k_block(count), k_all[:count]),
                              plain_same=torch.equal(x[:count] @ w.t(), plain_all[:count])))
    return dict(ok=True, reference_rows=most, cases=found)


# --- ranks on one device ----------------------------------------------------------------------------


def _rank_setup(device: str):
    """A context to run a rank in, entered before megatron or megapatch is imported (they bind
    collectives at import): collectives on host copies (the labelled one-GPU stand-in); on CPU (dry
    run) staged through copies too, with the CPU stand-ins megatron needs there."""
    from megapatch.testing.stand_ins.one_gpu_collectives import collectives_through_host

    staged = (lambda t: t.is_cuda) if device == "cuda" else (lambda t: True)
    guard = contextlib.ExitStack()
    guard.enter_context(collectives_through_host(staged))
    if device == "cpu":  # running megatron on CPU needs the CPU stand-ins (the harness's, entered here
        from megapatch.testing import cpu_workarounds  # after the collectives are routed)

        guard.enter_context(cpu_workarounds())
    return guard


def _llama(tp: int, sizes: dict, device: str, fp32: bool = False, outliers: bool = False, te: bool = False):
    import torch

    from megapatch.testing import build_tiny_gpt
    from megapatch.testing.models.tiny_gpt import llama_config

    fields = {k: sizes[k] for k in ("hidden_size", "num_attention_heads", "num_query_groups",
                                    "ffn_hidden_size", "num_layers")}
    if fp32:
        fields.update(params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False)
    spec = None
    if te:  # megatron-core's Transformer Engine spec (Megatron-LM's default layers)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec()
    model = build_tiny_gpt(llama_config(tp, **fields), vocab_size=sizes["vocab"], seq_len=sizes["seq"],
                           seed=1234, position_embedding_type="rope", layer_spec=spec)
    if outliers:
        from megapatch.commands.demo import _plant_outliers

        _plant_outliers(model)
    if device == "cuda":  # the RNG tracker was seeded through the CPU stand-in at construction
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    return model.to(device)


def _batch(sizes: dict, device: str, seed: int = 5):
    from megapatch.testing import make_batch

    batch = make_batch(seed=seed, batch=sizes["batch"], seq_len=sizes["seq"], vocab=sizes["vocab"])
    batch.tokens[:, 4] = 13  # the demo's planted "period" token
    return [t.to(device) for t in batch]


def _invariant_rank(ctx, device: str, sizes: dict):
    with _rank_setup(device):
        import megapatch
        import torch

        from megapatch.testing import reinit_model_parallel
        from megapatch.testing.models.tiny_gpt import gather_full_grads, gather_tp_logits

        found = {}
        for mode in ("invariant", "native"):
            for tp in TPS:
                ctx = reinit_model_parallel(ctx, tp=tp)
                megapatch.enable(tp_invariant=True) if mode == "invariant" else megapatch.disable()
                model = _llama(tp, sizes, device)
                tokens, position_ids, labels, mask = _batch(sizes, device)
                logits = model(tokens, position_ids, mask)
                loss = model(tokens, position_ids, mask, labels=labels)
                loss.float().sum().backward()
                grads = gather_full_grads(model, ctx)
                if tp == 1:  # the trainer's batch against one sequence alone and a prefix of it
                    half = tokens.shape[1] // 2
                    with torch.no_grad():
                        alone = model(tokens[:1], position_ids[:1], mask[:1])
                        prefix = model(tokens[:, :half], position_ids[:, :half], mask[:, :, :half, :half])
                    assert logits.shape[:2] == tokens.shape, logits.shape  # [batch, sequence, vocab]
                    found[(mode, "shapes")] = dict(alone_same=torch.equal(alone, logits[:1]),
                                                   prefix_same=torch.equal(prefix, logits[:, :half]))
                found[(mode, tp)] = dict(logits=gather_tp_logits(logits, ctx).float().cpu(),
                                         loss=loss.detach().float().cpu(),
                                         grads={k: v.cpu() for k, v in grads.items()})
                megapatch.disable()
        return found if ctx.rank == 0 else None


def tp_invariant(device: str, sizes: dict, start: str) -> dict:
    import torch

    from megapatch.testing import run_ranks

    found = run_ranks(_invariant_rank, world_size=max(TPS), args=(device, sizes), init_megatron=False,
                      timeout=900, start=start, preload="base", backend="gloo")[0]

    def same(a, b):
        return (torch.equal(a["logits"], b["logits"]) and torch.equal(a["loss"], b["loss"])
                and a["grads"].keys() == b["grads"].keys()
                and all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"]))

    invariant = {tp: same(found[("invariant", 1)], found[("invariant", tp)]) for tp in TPS[1:]}
    native = {tp: same(found[("native", 1)], found[("native", tp)]) for tp in TPS[1:]}
    return dict(ok=all(invariant.values()), invariant_bit_identical_to_tp1=invariant,
                native_bit_identical_to_tp1=native, tensors_compared=2 + len(found[("invariant", 1)]["grads"]),
                tp1_other_shapes={mode: found[(mode, "shapes")] for mode in ("invariant", "native")})


# --- 4. FP32 reductions and FP32 logits on a Llama of hidden size 1024 ------------------------------


def _mode(mode: str) -> dict:
    return {"native": {}, "fp32": dict(tp_reduce_dtype="fp32"),
            "fp32+logits": dict(tp_reduce_dtype="fp32", logits_dtype="fp32"),
            "tp_invariant": dict(tp_invariant=True)}[mode]


def _timed_step(model, batch, device, timing) -> float:
    import torch

    tokens, position_ids, labels, mask = batch

    def step():
        model.zero_grad(set_to_none=True)
        model(tokens, position_ids, mask, labels=labels).float().mean().backward()

    for _ in range(timing["warmup"]):
        step()
    samples = []
    for _ in range(timing["samples"]):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _llama_rank(ctx, device: str, sizes: dict, timing: dict):
    with _rank_setup(device):
        import megapatch
        import torch

        from megapatch.testing import reinit_model_parallel
        from megapatch.testing.models.tiny_gpt import gather_tp_logits

        out = {"logits": {}, "cost": {}}
        batch = _batch(sizes, device)
        timed = _batch(dict(sizes, batch=timing["batch"]), device)  # enough tokens that the step is not launch-bound
        for tp in TPS:
            ctx = reinit_model_parallel(ctx, tp=tp)
            for mode in LLAMA_MODES:
                megapatch.enable(**_mode(mode)) if _mode(mode) else megapatch.disable()
                model = _llama(tp, sizes, device, outliers=True)
                with torch.no_grad():
                    logits = model(batch[0], batch[1], batch[3])
                out["logits"][(mode, tp)] = gather_tp_logits(logits, ctx).float().cpu()
                if tp == 1:  # the cost of each mode against native, one rank doing the work
                    if device == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    seconds = _timed_step(model, timed, device, timing)
                    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
                    out["cost"][mode] = dict(step_s=seconds, peak_bytes=peak)
                del model
                megapatch.disable()
        ctx = reinit_model_parallel(ctx, tp=1)
        bf16 = _llama(1, sizes, device, outliers=True)
        reference = _llama(1, sizes, device, fp32=True)
        reference.load_state_dict(bf16.state_dict())
        with torch.no_grad():
            out["reference"] = reference(batch[0], batch[1], batch[3]).float().cpu()
        return out if ctx.rank == 0 else None


def fp32_llama(device: str, sizes: dict, timing: dict, start: str) -> dict:
    import torch

    from megapatch.testing import run_ranks

    out = run_ranks(_llama_rank, world_size=max(TPS), args=(device, sizes, timing), init_megatron=False,
                    timeout=900, start=start, preload="base", backend="gloo")[0]
    rows = []
    reference = out["reference"]
    for mode in LLAMA_MODES:
        base = out["logits"][(mode, 1)]
        logp_base = torch.log_softmax(base, -1)
        for tp in TPS:
            here = out["logits"][(mode, tp)]
            logp = torch.log_softmax(here, -1)
            rows.append(dict(mode=mode, tp=tp, kl_vs_tp1=(logp_base.exp() * (logp_base - logp)).sum(-1).mean().item(),
                             max_abs_dlogit=(here - base).abs().max().item(),
                             rel_l2_vs_fp32=((here - reference).norm() / reference.norm()).item()))
    native = out["cost"]["native"]
    cost = {mode: dict(step_s=c["step_s"], ratio_vs_native=c["step_s"] / native["step_s"],
                       peak_bytes=c["peak_bytes"],
                       peak_ratio_vs_native=(c["peak_bytes"] / native["peak_bytes"]) if native["peak_bytes"] else None)
            for mode, c in out["cost"].items()}
    kl = {row["mode"]: row["kl_vs_tp1"] for row in rows if row["tp"] == max(TPS)}
    return dict(ok=(kl["fp32"] < kl["native"] or kl["native"] == 0) and kl["tp_invariant"] == 0, rows=rows, cost_at_tp1=cost,
                cost_batch=timing["batch"], cost_samples=timing["samples"],
                model={k: sizes[k] for k in ("hidden_size", "num_attention_heads", "num_query_groups",
                                             "ffn_hidden_size", "num_layers", "vocab", "seq", "batch")})


# --- 5. Transformer Engine layers under each mode -----------------------------------------------------

TE_MODES = ("native", "fp32", "tp_invariant")


def _te_rank(ctx, device: str, sizes: dict, timing: dict):
    with _rank_setup(device):
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            return {"skipped": "Transformer Engine is not installed"} if ctx.rank == 0 else None
        import megapatch
        import torch

        from megapatch.testing import reinit_model_parallel
        from megapatch.testing.models.tiny_gpt import gather_full_grads, gather_tp_logits

        with contextlib.ExitStack() as guard:
            if device == "cpu":  # the dry run: TE's kernels through the labelled CPU runtime
                from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

                guard.enter_context(te_cpu_runtime())
            out = {"runs": {}, "cost": {}}
            batch = _batch(sizes, device)
            timed = _batch(dict(sizes, batch=timing["batch"]), device)
            for tp in TPS:
                ctx = reinit_model_parallel(ctx, tp=tp)
                for mode in TE_MODES:
                    megapatch.enable(**_mode(mode)) if _mode(mode) else megapatch.disable()
                    model = _llama(tp, sizes, device, te=True)
                    tokens, position_ids, labels, mask = batch
                    with torch.no_grad():
                        logits = model(tokens, position_ids, mask)
                    loss = model(tokens, position_ids, mask, labels=labels)
                    loss.float().sum().backward()
                    out["runs"][(mode, tp)] = dict(logits=gather_tp_logits(logits, ctx).float().cpu(),
                                                   loss=loss.detach().float().cpu(),
                                                   grads={k: v.cpu() for k, v in gather_full_grads(model, ctx).items()})
                    if tp == 1:
                        if device == "cuda":
                            torch.cuda.reset_peak_memory_stats()
                        seconds = _timed_step(model, timed, device, timing)
                        peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
                        out["cost"][mode] = dict(step_s=seconds, peak_bytes=peak)
                    out.setdefault("modules", sorted({type(m).__name__ for m in model.modules()
                                                      if type(m).__module__.startswith("megatron.core.extensions")}))
                    del model
                    megapatch.disable()
        return out if ctx.rank == 0 else None


def te_layers(device: str, sizes: dict, timing: dict, start: str) -> dict:
    """A Llama-shaped model built from megatron-core's TE spec (``TELayerNormColumnParallelLinear``,
    ``TERowParallelLinear``, ``TEDotProductAttention``) at TP 1/2/4 on the one GPU (collectives through
    the host: the labelled one-GPU stand-in), natively (TE's own kernels and attention backend), under
    ``fp32`` (TE's GEMMs with FP32 row-parallel accumulators) and under ``tp_invariant`` (TE's
    parameters, the mode's arithmetic): logits, loss and gradients against TP 1, and the cost of each
    mode at TP 1 against native TE."""
    import torch

    from megapatch.testing import run_ranks

    out = run_ranks(_te_rank, world_size=max(TPS), args=(device, sizes, timing), init_megatron=False,
                    timeout=900, start=start, preload="base", backend="gloo")[0]
    if "skipped" in out:
        return dict(ok=True, skipped=out["skipped"])
    runs, rows = out["runs"], []
    for mode in TE_MODES:
        base = runs[(mode, 1)]
        logp_base = torch.log_softmax(base["logits"], -1)
        for tp in TPS:
            here = runs[(mode, tp)]
            logp = torch.log_softmax(here["logits"], -1)
            same = (torch.equal(here["logits"], base["logits"]) and torch.equal(here["loss"], base["loss"])
                    and all(torch.equal(here["grads"][k], base["grads"][k]) for k in base["grads"]))
            rows.append(dict(mode=mode, tp=tp, kl_vs_tp1=(logp_base.exp() * (logp_base - logp)).sum(-1).mean().item(),
                             max_abs_dlogit=(here["logits"] - base["logits"]).abs().max().item(),
                             bit_identical_to_tp1=same))
    native = out["cost"]["native"]
    cost = {mode: dict(step_s=c["step_s"], ratio_vs_native=c["step_s"] / native["step_s"], peak_bytes=c["peak_bytes"],
                       peak_ratio_vs_native=(c["peak_bytes"] / native["peak_bytes"]) if native["peak_bytes"] else None)
            for mode, c in out["cost"].items()}
    at = {(r["mode"], r["tp"]): r for r in rows}
    invariant = all(at[("tp_invariant", tp)]["bit_identical_to_tp1"] for tp in TPS)
    kl_max = {mode: at[(mode, max(TPS))]["kl_vs_tp1"] for mode in ("native", "fp32")}
    return dict(ok=invariant and (kl_max["fp32"] < kl_max["native"] or kl_max["native"] == 0), rows=rows,
                cost_at_tp1=cost, modules=out["modules"], cost_batch=timing["batch"], cost_samples=timing["samples"])


# --- report ----------------------------------------------------------------------------------------


def environment(device: str) -> dict:
    import torch

    env = dict(python=platform.python_version(), torch=torch.__version__, device=device,
               mm_out_dtype=hasattr(torch.ops.aten.mm, "dtype"))
    try:
        import megatron.core

        env["megatron_core"] = megatron.core.__version__
    except Exception as exc:  # noqa: BLE001
        env["megatron_core"] = f"not importable: {exc}"
    if device == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    return env


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU check ({'dry run on CPU' if report['dry_run'] else env.get('gpu', 'GPU')})", "",
             f"Command: `{report['command']}`; {report['seconds']:.0f} s; python {env['python']}, torch "
             f"{env['torch']}, megatron-core {env['megatron_core']}" + (f", CUDA {env['cuda']}" if "cuda" in env else ""),
             ""]
    for name, section in report["sections"].items():
        verdict = "error" if "error" in section else ("ok" if section.get("ok") else "FAILED")
        lines.append(f"## {name}: {verdict}")
        lines.append("")
        if "error" in section:
            lines += ["```", section["error"][-3000:], "```", ""]
            continue
        if name == "block_gemm":
            lines.append(f"{section['cases']} block products ({section['gemm']}), cut from the full tensor and "
                         f"from TP 2/4 shards: {len(section['differing'])} differ. Plain strided views "
                         f"without the copy: {section['plain_views_differing']} differ.")
        elif name == "tp_invariant":
            lines.append(f"tp_invariant, TP 2/4 against TP 1 (logits, loss, {section['tensors_compared'] - 2} "
                         f"gradients): {section['invariant_bit_identical_to_tp1']}; native: "
                         f"{section['native_bit_identical_to_tp1']} (expected to differ).")
            lines.append("")
            lines.append("At TP 1, the logits of one sequence run alone and of a prefix (half the sequence), against "
                         "the same positions in the batch (bit-identical?): "
                         + "; ".join(f"{mode}: alone {v['alone_same']}, prefix {v['prefix_same']}"
                                     for mode, v in section["tp1_other_shapes"].items())
                         + ". Reported, not promised: the mode promises TP invariance.")
        elif name == "batch_invariance":
            lines += [f"Each row of a BF16 GEMM at R rows against the same row inside the {section['reference_rows']}"
                      "-row product (bit-identical?). Reported, not promised: the mode promises TP invariance, "
                      "not batch invariance.", "",
                      "| K | N | rows | the mode's block of N (K whole) | the mode's block of K | plain BF16 matmul |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {c['k']} | {c['n']} | {c['rows']} | {c['n_block_same']} | {c['k_block_same']} | "
                      f"{c['plain_same']} |"
                      for c in section["cases"]]
        elif name == "fp32_llama":
            lines += [f"Model: {section['model']}. FP32 reductions make TP sizes agree; they do not bring "
                      "BF16 below TP=1's BF16 error (the rel. L2 column at TP=1); only tp_invariant promises the "
                      "same bits at every TP size.", "",
                      "| mode | TP | KL(TP1‖TPN) | max abs dlogit | rel. L2 vs FP32 |", "|---|---|---|---|---|"]
            lines += [f"| {r['mode']} | {r['tp']} | {r['kl_vs_tp1']:.3e} | {r['max_abs_dlogit']:.3e} | "
                      f"{r['rel_l2_vs_fp32']:.4f} |" for r in section["rows"]]
            lines += _cost_lines(section, f"Cost at TP 1: one forward and backward of {section['cost_batch']} "
                                          f"sequences of {section['model']['seq']} tokens")
        elif name == "production":
            lines += gpu_check_production.markdown(section)
        elif name == "te_layers" and "skipped" in section:
            lines.append(f"Skipped: {section['skipped']}.")
        elif name == "te_layers":
            lines += [f"TE modules: {', '.join(section['modules'])}. Only tp_invariant promises the same bits at "
                      "every TP size; fp32 makes TP sizes agree more closely, it does not bring BF16 below TP=1's "
                      "BF16 error.", "",
                      "| mode | TP | bit-identical to TP 1 | KL(TP1‖TPN) | max abs dlogit |", "|---|---|---|---|---|"]
            lines += [f"| {r['mode']} | {r['tp']} | {r['bit_identical_to_tp1']} | {r['kl_vs_tp1']:.3e} | "
                      f"{r['max_abs_dlogit']:.3e} |" for r in section["rows"]]
            lines += _cost_lines(section, f"Cost at TP 1 against native TE: one forward and backward of "
                                          f"{section['cost_batch']} sequences")
        lines.append("")
    return "\n".join(lines)


def _production_rank(ctx, device: str, shapes: dict):
    """The production section's rank (tools/gpu_check_production.py), with this module's helpers."""
    return gpu_check_production.rank(ctx, device, shapes, sys.modules[__name__])


def _cost_lines(section: dict, what: str) -> list:
    """A section's cost table at TP 1: step time and peak memory of each mode against native."""
    lines = ["", f"{what}, median of {section['cost_samples']} timed steps.", "",
             "| mode (TP=1) | step (s) | vs native | peak memory vs native |", "|---|---|---|---|"]
    for mode, c in section["cost_at_tp1"].items():
        peak = f"{c['peak_ratio_vs_native']:.3f}" if c["peak_ratio_vs_native"] else "n/a (CPU)"
        lines.append(f"| {mode} | {c['step_s']:.4f} | {c['ratio_vs_native']:.3f} | {peak} |")
    return lines


def _write(out: str, report: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
        f.write(markdown(report))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy sizes (CI)")
    parser.add_argument("--out", default=".", help="directory for gpu_check.json and gpu_check.md")
    parser.add_argument("--sections", default="block_gemm,batch_invariance,tp_invariant,fp32_llama,te_layers,production")
    parser.add_argument("--start", default=None, help="run_ranks start method (server or spawn)")
    args = parser.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    sizes = SIZES["dry" if args.dry_run else "gpu"]
    # on a GPU the ranks are fresh interpreters: a child forked from a process whose imports touched
    # CUDA could not use it (the rank server refuses to start if its preload did, but spawn is certain)
    args.start = args.start or ("server" if args.dry_run else "spawn")
    started = time.monotonic()
    runners = {"block_gemm": lambda: block_gemm(device, sizes["shapes"]),
               "batch_invariance": lambda: batch_invariance(device, sizes["rows"]),
               "tp_invariant": lambda: tp_invariant(device, sizes["invariant"], args.start),
               "fp32_llama": lambda: fp32_llama(device, sizes["llama"], sizes["timing"], args.start),
               "te_layers": lambda: te_layers(device, sizes["invariant"], sizes["timing"], args.start),
               "production": lambda: gpu_check_production.production(device, args.dry_run, args.start,
                                                                     _production_rank)}
    sections = {}
    command = " ".join(["python", "tools/gpu_check.py", *(argv or sys.argv[1:])])
    for name in args.sections.split(","):
        t0 = time.monotonic()
        try:
            sections[name] = runners[name]()
        except Exception:  # noqa: BLE001 -- recorded; the other sections still run
            sections[name] = dict(ok=False, error=traceback.format_exc())
        sections[name]["seconds"] = time.monotonic() - t0
        print(f"gpu_check: {name}: {'ok' if sections[name].get('ok') else 'FAILED'} "
              f"({sections[name]['seconds']:.0f} s)", flush=True)
        # written after every section: a run stopped at its time limit still leaves what it measured
        _write(args.out, dict(dry_run=args.dry_run, command=command, seconds=time.monotonic() - started,
                              environment=environment(device), sections=sections))
    print(f"gpu_check: wrote {args.out}/gpu_check.json and gpu_check.md", flush=True)
    return 0 if all(s.get("ok") for s in sections.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
