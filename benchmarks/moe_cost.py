"""Cost of ``tp_reduce_dtype="fp32"`` (and ``fp32-accumulate``), or of ``tp_invariant=True``, on a
mixture-of-experts model, on CPU.

    python benchmarks/moe_cost.py [--tp 1,2] [--dispatcher alltoall] [--reps 10]
    python benchmarks/moe_cost.py --modes native,tp_invariant [--tp 1,2,4] [--reps 10]

The model: ``megapatch.testing.scenarios.moe_tiny``'s Qwen3-MoE shape made larger so that ratios
mean something on CPU: 2 layers, hidden 512, 8 heads in 4 KV groups, QK RMSNorm, 8 experts top-2
with SwiGLU FFN 512 each, RoPE, untied head, vocab 1024, BF16; 2 x 128 tokens; sequence
parallelism and expert TP = TP at TP > 1. One training step (forward, backward, megatron-core's
BF16 optimizer: AdamW, clipping on) per mode, the modes interleaved and repeated on ``max(tp)``
gloo ranks, each round starting with another mode; the first round warms up. Reported per TP
size: each mode's median step time divided by native's, and the median peak of tensor storage
one step creates and holds at once (``_PeakTensorBytes``, in rounds of their own), divided by
native's. At TP sizes below the rank count the other ranks are data-parallel replicas on the same
2 cores: absolute times are noise, the ratios within one TP size are what this reports (three
identically built native models measured this way: time ratios within 0.91-1.05 at 4 rounds,
memory ratios 1.00). With ``tp_invariant`` among the modes, one more step per mode runs under
torch's profiler: where rank 0's time goes (``tp_invariant_cost``'s components).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from tp_invariant_cost import COMPONENTS, _profile, _step  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402


class _PeakTensorBytes(TorchDispatchMode):
    """The most bytes of tensor storage that ops create while the block runs and that are alive
    at once (activations, gradients, optimizer temporaries; not what existed before). Counted
    per storage and released when torch frees it (a finalizer on the storage's Python object,
    which torch keeps as long as the storage lives), so the figure does not depend on how the
    allocator lays memory out; glibc's heap counters (``tp_invariant_cost._PeakHeap``) gave three
    identically built native models different figures here."""

    def __enter__(self):
        self.live, self.now, self.peak = set(), 0, 0
        return super().__enter__()

    def _release(self, key, size):
        self.live.discard(key)
        self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in inputs:  # in-place ops and views: not new
                    self.live.add(key)
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._release, key, storage.nbytes())
        self.peak = max(self.peak, self.now)
        return out

    @property
    def added(self) -> int:
        return self.peak

ALL_MODES = {"native": {}, "fp32-accumulate": {"tp_reduce_dtype": "fp32-accumulate"},
             "fp32": {"tp_reduce_dtype": "fp32"}, "tp_invariant": {"tp_invariant": True}}
SHAPE = dict(hidden_size=512, num_attention_heads=8, num_query_groups=4, moe_ffn_hidden_size=512,
             ffn_hidden_size=512, num_layers=2)
VOCAB, SEQ, BATCH = 1024, 128, 2


def _build(tp: int, dispatcher: str):
    from megapatch.testing.models.tiny_gpt import build_tiny_gpt
    from megapatch.testing.scenarios.moe_tiny import qwen3_moe_config

    return build_tiny_gpt(qwen3_moe_config(tp, dispatcher, **SHAPE), vocab_size=VOCAB, seq_len=SEQ,
                          position_embedding_type="rope")


def _job(ctx, tps, reps, dispatcher, modes):
    import megapatch
    from megapatch.testing import make_batch, reinit_model_parallel
    from megapatch.testing.models.tiny_gpt import build_bf16_optimizer

    MODES = {m: ALL_MODES[m] for m in modes}
    batch = make_batch(seed=5, batch=BATCH, seq_len=SEQ, vocab=VOCAB)
    results = {}
    for tp in tps:
        ctx = reinit_model_parallel(ctx, tp=tp, expert_tensor_parallel_size=tp)
        runs = {}
        for mode, options in MODES.items():
            if options:
                megapatch.enable(**options)
            model = _build(tp, dispatcher)
            runs[mode] = (model, build_bf16_optimizer(model, clip_grad=1.0))
            megapatch.disable()
            torch.distributed.barrier()

        @contextlib.contextmanager
        def switched(mode):  # enable()/disable() stay outside what is measured
            if MODES[mode]:
                megapatch.enable(**MODES[mode])
            try:
                yield
            finally:
                megapatch.disable()

        names = list(MODES)
        times = {m: [] for m in MODES}
        memory = {m: [] for m in MODES}
        for i in range(reps + 1):  # each round starts with another mode: no mode always runs first
            for mode in names[i % len(names):] + names[:i % len(names)]:
                with switched(mode):
                    torch.distributed.barrier()
                    start = time.perf_counter()
                    _step(*runs[mode], batch)
                    elapsed = time.perf_counter() - start
                if i:
                    times[mode].append(elapsed)
        for i in range(reps):  # the heap measured apart from the timed steps (the hook slows every op)
            for mode in names[i % len(names):] + names[:i % len(names)]:
                with switched(mode):
                    torch.distributed.barrier()
                    with _PeakTensorBytes() as heap:
                        _step(*runs[mode], batch)
                memory[mode].append(heap.added)
        results[tp] = {m: (statistics.median(times[m]), (statistics.median(memory[m]), None)) for m in MODES}
        if "tp_invariant" in MODES:
            for mode in MODES:
                with switched(mode):
                    torch.distributed.barrier()
                    results[tp][f"{mode} profile"] = _profile(lambda: _step(*runs[mode], batch))
    return results if ctx.rank == 0 else None


def main(argv=None):
    from megapatch.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--dispatcher", default="alltoall", choices=("alltoall", "allgather"))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--modes", default="native,fp32-accumulate,fp32",
                        help=f"comma-separated, native first; of {', '.join(ALL_MODES)}")
    args = parser.parse_args(argv)
    tps = [int(t) for t in args.tp.split(",")]
    modes = args.modes.split(",")
    if modes[0] != "native" or not set(modes) <= set(ALL_MODES):
        parser.error(f"--modes {args.modes!r}: native first, then any of {', '.join(list(ALL_MODES)[1:])}")
    results = run_ranks(_job, world_size=max(tps), args=(tps, args.reps, args.dispatcher, modes), timeout=3600)[0]
    print(f"MoE ({args.dispatcher} dispatcher): {SHAPE['num_layers']} layers, hidden {SHAPE['hidden_size']}, "
          f"8 experts top-2 (FFN {SHAPE['moe_ffn_hidden_size']}), vocab {VOCAB}, {BATCH}x{SEQ} tokens, BF16; "
          f"one training step (forward, backward, clipped AdamW), median of {args.reps}, {max(tps)} CPU ranks:\n")
    others = modes[1:]
    print("| TP | step time native | " + " | ".join(f"{m} / native" for m in others)
          + " | step tensor memory native | " + " | ".join(f"{m} / native" for m in others) + " |")
    print("|---|---|" + "---|" * (2 * len(others) + 1))
    for tp, r in results.items():
        tn, (mn, _) = r["native"]
        print(f"| {tp} | {tn * 1e3:.0f} ms | " + " | ".join(f"{r[m][0] / tn:.2f}" for m in others)
              + f" | {mn / 2 ** 20:.1f} MiB | " + " | ".join(f"{r[m][1][0] / mn:.2f}" for m in others) + " |")
    if "tp_invariant" in modes:
        print("\nWhere one step's time goes (profiler self CPU time, rank 0, seconds: native -> tp_invariant):\n")
        names = [name for name, _ in COMPONENTS] + ["other ops"]
        print("| TP | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for tp, r in results.items():
            native, invariant = r["native profile"], r["tp_invariant profile"]
            print(f"| {tp} | " + " | ".join(f"{native.get(c, 0.0):.3f} -> {invariant.get(c, 0.0):.3f}"
                                           for c in names) + " |")


if __name__ == "__main__":
    main()
