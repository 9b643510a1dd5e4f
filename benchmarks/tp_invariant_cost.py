"""Cost of ``tp_invariant=True`` relative to native and to ``tp_reduce_dtype="fp32"``, on CPU.

    python benchmarks/tp_invariant_cost.py [--model gpt|llama] [--tp 1,2,4] [--reps 6]

``--model gpt``: a GPT (2 layers, hidden 256, 8 heads, FFN 1024, vocab 1024, BF16; 4 x 64 tokens).
``--model llama``: Llama-shaped, large enough for ratios to mean something on CPU (4 layers,
hidden 1024, 16 heads in 8 KV groups, SwiGLU FFN 2816, RMSNorm, RoPE, untied head, vocab 4096;
2 x 128 tokens). Either trains with
megatron-core's BF16 optimizer (AdamW, clipping on) on ``max(tp)`` gloo ranks; at each TP size the
three modes run interleaved, one full step each (forward, backward, optimizer step), repeated; the
first round warms up. Reported per TP size: each mode's median step time divided by native's, and
the peak heap memory one more step adds above what was in use before it (glibc ``mallinfo2``
read after every aten op of the step by a dispatch mode: activations, gradients, FP32 block
copies, collective buffers), divided by native's. At TP sizes
below the rank count the other ranks are data-parallel replicas doing the same work on the same
2 cores, so absolute times are noise; the ratios within one TP size are what this reports.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODES = ("native", "deterministic", "fp32", "tp-invariant")
MODELS = {
    "gpt": dict(config=dict(hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024), layers=2,
                vocab=1024, seq=64, batch=4, llama=False),
    "llama": dict(config=dict(hidden_size=1024, num_attention_heads=16, num_query_groups=8,
                              ffn_hidden_size=2816), layers=4, vocab=4096, seq=128, batch=2, llama=True),
}
#: where a step's time goes: aten/c10d op names (profiler self time) by component
COMPONENTS = (("GEMM", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
              ("FP32 copies and casts", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat",
                                         "aten::contiguous")),
              ("collectives", ("c10d", "gloo", "nccl", "all_gather", "all_reduce", "all_to_all",
                               "reduce_scatter", "broadcast")),
              ("tree additions and other elementwise", ("aten::add", "aten::add_")))


def _options(mode):
    """``deterministic``: native plus what Megatron-LM's --deterministic-mode does on a local-layer
    model (TransformerConfig.deterministic_mode, torch.use_deterministic_algorithms)."""
    if mode == "tp-invariant":
        return {"tp_invariant": True}
    return {"tp_reduce_dtype": "native" if mode == "deterministic" else mode}


def _component(name: str) -> str:
    for component, keys in COMPONENTS:
        if any(name == k or (not k.startswith("aten::") and k in name) for k in keys):
            return component
    return "other ops"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = ctypes.CDLL(None)
_libc.mallinfo2.restype = _Mallinfo2


def _heap_in_use() -> int:
    """Bytes glibc malloc has handed out and not taken back (torch's CPU tensors, gloo buffers)."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


class _PeakHeap(TorchDispatchMode):
    """The most heap in use after any op while the block runs, above what was in use before."""

    def __enter__(self):
        self.base = self.peak = _heap_in_use()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, _heap_in_use())
        return out

    @property
    def added(self) -> int:
        return self.peak - self.base


def _step(model, optimizer, batch):
    from megapatch.testing.models.tiny_gpt import cuda_type_names

    optimizer.zero_grad()
    loss = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
    loss.float().mean().backward()
    with cuda_type_names():
        optimizer.step()


def _build(tp, model_name, mode):
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config
    from megapatch.testing.models.tiny_gpt import llama_config

    shape = MODELS[model_name]
    fields = dict(shape["config"], num_layers=shape["layers"], deterministic_mode=mode == "deterministic")
    if shape["llama"]:
        return build_tiny_gpt(llama_config(tp, **fields), vocab_size=shape["vocab"], seq_len=shape["seq"],
                              position_embedding_type="rope")
    return build_tiny_gpt(tiny_gpt_config(tp=tp, **fields), vocab_size=shape["vocab"], seq_len=shape["seq"])


def _profile(step) -> dict:
    """Self CPU time (s) of one step by component."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    found = {}
    for event in prof.key_averages():
        component = _component(event.key)
        found[component] = found.get(component, 0.0) + event.self_cpu_time_total / 1e6
    return found


def _job(ctx, tps, reps, model_name):
    import megapatch
    from megapatch.testing import make_batch, reinit_model_parallel
    from megapatch.testing.models.tiny_gpt import build_bf16_optimizer

    shape = MODELS[model_name]
    batch = make_batch(seed=5, batch=shape["batch"], seq_len=shape["seq"], vocab=shape["vocab"])
    results = {}
    for tp in tps:
        ctx = reinit_model_parallel(ctx, tp=tp)
        runs = {}
        for mode in MODES:
            megapatch.enable(**_options(mode))
            model = _build(tp, model_name, mode)
            runs[mode] = (model, build_bf16_optimizer(model, clip_grad=1.0))
            megapatch.disable()
            torch.distributed.barrier()  # every rank's settings check sees this mode, not the next

        def step(mode):
            megapatch.enable(**_options(mode))
            torch.use_deterministic_algorithms(mode == "deterministic")
            try:
                _step(*runs[mode], batch)
            finally:
                torch.use_deterministic_algorithms(False)
                megapatch.disable()

        times = {m: [] for m in MODES}
        for i in range(reps + 1):
            for mode in MODES:
                torch.distributed.barrier()
                start = time.perf_counter()
                step(mode)
                elapsed = time.perf_counter() - start
                if i:  # the first round warms up
                    times[mode].append(elapsed)
        memory, components = {}, {}
        for mode in MODES:  # one more step per mode under the heap tracker, one under the profiler
            torch.distributed.barrier()
            before = _heap_in_use()
            with _PeakHeap() as heap:
                step(mode)
            memory[mode] = (heap.added, before + heap.added)
            torch.distributed.barrier()
            components[mode] = _profile(lambda: step(mode))
        results[tp] = {m: (statistics.median(times[m]), memory[m], components[m]) for m in MODES}
    return results if ctx.rank == 0 else None


def main(argv=None):
    from megapatch.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt")
    parser.add_argument("--tp", default="1,2,4")
    parser.add_argument("--reps", type=int, default=6)
    args = parser.parse_args(argv)
    tps = [int(t) for t in args.tp.split(",")]
    shape = MODELS[args.model]
    results = run_ranks(_job, world_size=max(tps), args=(tps, args.reps, args.model), timeout=3600)[0]
    config = shape["config"]
    print(f"{args.model}: {shape['layers']} layers, hidden {config['hidden_size']}, FFN "
          f"{config['ffn_hidden_size']}, vocab {shape['vocab']}, {shape['batch']}x{shape['seq']} tokens, "
          f"BF16; one training step (forward, backward, clipped AdamW), median of {args.reps}, "
          f"{max(tps)} CPU ranks:\n")
    ratio = lambda a, b: f"{a / b:.2f}" if b > 0 else "n/a"
    print("| TP | step time native | deterministic / native | fp32 / native | tp-invariant / native | "
          "step memory native | tp-invariant / native | peak heap native | tp-invariant / native |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp, r in results.items():
        (tn, (mn, pn), _), (td, _, _), (tf, _, _), (ti, (mi, pi), _) = (
            r["native"], r["deterministic"], r["fp32"], r["tp-invariant"])
        print(f"| {tp} | {tn * 1e3:.0f} ms | {td / tn:.2f} | {tf / tn:.2f} | {ti / tn:.2f} | "
              f"{mn / 2 ** 20:.1f} MiB | {ratio(mi, mn)} | {pn / 2 ** 20:.0f} MiB | {ratio(pi, pn)} |")
    print("\nWhere one step's time goes (profiler self CPU time, rank 0, seconds: native -> tp-invariant):\n")
    names = [c for c, _ in COMPONENTS] + ["other ops"]
    print("| TP | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for tp, r in results.items():
        native, invariant = r["native"][2], r["tp-invariant"][2]
        print(f"| {tp} | " + " | ".join(f"{native.get(n, 0):.3f} -> {invariant.get(n, 0):.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()
