"""GPU: overhead of keeping the LM-head GEMM's FP32 output (the PR #6252 table), for users with GPUs.

    python benchmarks/gpu_fp32_gemm.py [--n 32768] [--m 16,128,1024] [--k 1024,2048,4096,8192,16384]

For each shape it times, interleaved with CUDA events (10 warm-up pairs, 30 samples each, median),
``torch.mm`` BF16 -> BF16 against ``torch.mm(..., out_dtype=torch.float32)`` and, where
Transformer Engine is installed, TE ``general_gemm(..., out_dtype=torch.float32)`` -- the kernels
megapatch's ``logits_dtype="fp32"`` uses. Prints the ratio to the BF16 GEMM. Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def _time(fn, warmup=10, samples=30):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--m", default="16,128,1024")
    parser.add_argument("--k", default="1024,2048,4096,8192,16384")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    from megapatch.numerics import fp32_gemm

    te_gemm = fp32_gemm._te_general_gemm()
    print(f"{torch.cuda.get_device_name()}; N={args.n}; TE general_gemm: {'yes' if te_gemm else 'no'}\n")
    print("| M | K | BF16 (ms) | mm out_dtype=fp32 / BF16 | TE general_gemm fp32 / BF16 |")
    print("|---|---|---|---|---|")
    for m in [int(v) for v in args.m.split(",")]:
        for k in [int(v) for v in args.k.split(",")]:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(args.n, k, device="cuda", dtype=torch.bfloat16)
            out_bf16 = torch.empty(m, args.n, device="cuda", dtype=torch.bfloat16)
            base = _time(lambda: torch.mm(a, w.t(), out=out_bf16))
            try:
                mm = _time(lambda: torch.mm(a, w.t(), out_dtype=torch.float32)) / base
                mm_text = f"{mm:.3f}"
            except (TypeError, RuntimeError) as exc:
                mm_text = f"n/a ({type(exc).__name__})"
            te_text = "n/a"
            if te_gemm is not None:
                te_text = f"{_time(lambda: te_gemm(w, a, out_dtype=torch.float32, layout='TN')) / base:.3f}"
            print(f"| {m} | {k} | {base:.3f} | {mm_text} | {te_text} |")


if __name__ == "__main__":
    main()
