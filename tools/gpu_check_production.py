"""The GPU check's ``production`` section (issue 48 item 8): what each mode costs at the shapes people
train, not at a launch-bound toy size. One rank, TP 1, a Llama-shaped block stack at hidden 4096,
SwiGLU FFN 14336, 32 heads / 8 KV groups, 4 layers: a forward and backward of 4 sequences of 4096
tokens per mode (native, ``fp32``, ``fp32`` + FP32 logits, ``tp_invariant`` with its attention), then
one sequence of 16,384 tokens where it fits (an out-of-memory there is recorded, not an error).
Step time (CUDA-synchronised, median) and peak memory against native. Its dry run (CI) runs the same
code on CPU at toy shapes and checks the shapes it would run.

Imported by tools/gpu_check.py, which owns the rank set-up and the timed step.
"""

from __future__ import annotations

SHAPES = {
    # the floor: hidden 4096, FFN 14336 (SwiGLU), 32 heads / 8 KV groups, 4 layers, 4 x 4096 tokens
    "gpu": dict(model=dict(hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
                           num_layers=4, vocab=32768),
                runs=[dict(batch=4, seq=4096), dict(batch=1, seq=16384)], warmup=2, samples=5),
    "dry": dict(model=dict(hidden_size=64, ffn_hidden_size=224, num_attention_heads=8, num_query_groups=2,
                           num_layers=2, vocab=128),
                runs=[dict(batch=4, seq=32), dict(batch=1, seq=128)], warmup=1, samples=2),
}
MODES = ("native", "fp32", "fp32+logits", "tp_invariant")


def _out_of_memory(error: BaseException) -> bool:
    return "out of memory" in str(error).lower() or type(error).__name__ == "OutOfMemoryError"


def rank(ctx, device: str, shapes: dict, check):
    """Each mode's model built once, at TP 1, timed on each run shape (``check``: the tools/gpu_check
    module, whose rank set-up, model, batch and timed step this section shares)."""
    with check._rank_setup(device):
        import megapatch
        import torch

        from megapatch.testing import reinit_model_parallel

        ctx = reinit_model_parallel(ctx, tp=1)
        rows = []
        longest = max(run["seq"] for run in shapes["runs"])
        model_sizes = dict(shapes["model"], seq=longest)
        timing = dict(warmup=shapes["warmup"], samples=shapes["samples"])
        for mode in MODES:
            megapatch.enable(**check._mode(mode)) if check._mode(mode) else megapatch.disable()
            model = check._llama(1, model_sizes, device)
            for run in shapes["runs"]:
                row = dict(mode=mode, batch=run["batch"], seq=run["seq"])
                batch = check._batch(dict(model_sizes, batch=run["batch"], seq=run["seq"]), device)
                if device == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                try:
                    row["step_s"] = check._timed_step(model, batch, device, timing)
                    row["peak_bytes"] = torch.cuda.max_memory_allocated() if device == "cuda" else None
                except Exception as error:  # noqa: BLE001 -- a shape that does not fit is a figure too
                    if not _out_of_memory(error):
                        raise
                    row["did_not_fit"] = str(error).splitlines()[0][:200]
                    model.zero_grad(set_to_none=True)
                rows.append(row)
                del batch
            del model
            megapatch.disable()
            if device == "cuda":
                torch.cuda.empty_cache()
        return rows if ctx.rank == 0 else None


def production(device: str, dry_run: bool, start: str, rank_fn) -> dict:
    """The section's report: a row per (mode, run shape) with its step time and peak memory, and the
    ratios against native at the same shape. ``rank_fn(ctx, device, shapes)``: tools/gpu_check's
    picklable entry that calls ``rank`` in the rank process."""
    from megapatch.testing import run_ranks

    shapes = SHAPES["dry" if dry_run else "gpu"]
    rows = run_ranks(rank_fn, world_size=1, args=(device, shapes), init_megatron=False, timeout=1800,
                     start=start, preload="base", backend="gloo")[0]
    native = {(r["batch"], r["seq"]): r for r in rows if r["mode"] == "native"}
    for row in rows:
        base = native[(row["batch"], row["seq"])]
        if "step_s" in row and "step_s" in base:
            row["ratio_vs_native"] = row["step_s"] / base["step_s"]
            row["peak_ratio_vs_native"] = (row["peak_bytes"] / base["peak_bytes"]) if base.get("peak_bytes") else None
    first = shapes["runs"][0]
    return dict(ok=all("step_s" in r for r in rows if (r["batch"], r["seq"]) == (first["batch"], first["seq"])),
                model=shapes["model"], runs=shapes["runs"], samples=shapes["samples"], rows=rows)


def markdown(section: dict) -> list:
    model = section["model"]
    lines = [f"Model: hidden {model['hidden_size']}, FFN {model['ffn_hidden_size']} (SwiGLU), "
             f"{model['num_attention_heads']} heads / {model['num_query_groups']} KV groups, "
             f"{model['num_layers']} layers, vocabulary {model['vocab']}; TP 1, one forward and backward, "
             f"median of {section['samples']} timed steps.", "",
             "| mode | sequences x tokens | step (s) | vs native | peak memory (GiB) | vs native |",
             "|---|---|---|---|---|---|"]
    for r in section["rows"]:
        shape = f"{r['batch']} x {r['seq']}"
        if "did_not_fit" in r:
            lines.append(f"| {r['mode']} | {shape} | did not fit: {r['did_not_fit']} | | | |")
            continue
        peak = f"{r['peak_bytes'] / 2 ** 30:.2f}" if r.get("peak_bytes") else "n/a (CPU)"
        ratio = r.get("ratio_vs_native")
        peak_ratio = r.get("peak_ratio_vs_native")
        lines.append(f"| {r['mode']} | {shape} | {r['step_s']:.4f} | {f'{ratio:.3f}' if ratio else ''} | {peak} | "
                     f"{f'{peak_ratio:.3f}' if peak_ratio else ''} |")
    return lines
