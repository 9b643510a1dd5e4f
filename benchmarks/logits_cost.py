"""FP32 LM-head logits: accuracy and cost of the output layer, patched vs native, side by side.

    python benchmarks/logits_cost.py [--vocab 32768,65536,131072] [--hidden 1024,2048,4096] [--tokens 16]

Runs megatron-core's real ColumnParallelLinear (the GPTModel output layer, TP=1, one CPU rank)
in BF16, forward + backward, with logits_dtype native and fp32 interleaved; prints the median
time ratio fp32/native and the logits error against an FP32 reference (plain FP32 matmul of the
same BF16 operands). On CPU the FP32 path upcasts the operands (no FP32-output BF16 GEMM
exists there), so the CPU ratio is an upper bound; the GPU figure comes from
benchmarks/gpu_fp32_gemm.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _bench(ctx, vocabs, hiddens, tokens, reps):
    import megapatch
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megapatch.patches.logits._lm_head import lm_head

    rows = []
    for hidden in hiddens:
        for vocab in vocabs:
            config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=8,
                                       params_dtype=torch.bfloat16, bf16=True,
                                       use_cpu_initialization=True, perform_initialization=False)
            layer = ColumnParallelLinear(hidden, vocab, config=config, init_method=None, bias=False,
                                         gather_output=False)
            with torch.no_grad():
                layer.weight.normal_(0, 0.02)
            x = torch.randn(tokens, 1, hidden).to(torch.bfloat16)
            reference = x.float() @ layer.weight.detach().float().t()
            times = {"native": [], "fp32": []}
            errors = {}
            for i in range(reps + 1):
                for mode in ("native", "fp32"):
                    megapatch.enable(logits_dtype=mode)
                    inp = x.clone().requires_grad_()
                    layer.weight.grad = None
                    start = time.perf_counter()
                    with lm_head(layer):
                        out, _ = layer(inp)
                    out.float().sum().backward()
                    if i:
                        times[mode].append(time.perf_counter() - start)
                    errors[mode] = (out.detach().float() - reference).abs().max().item()
            megapatch.disable()
            rows.append({"hidden": hidden, "vocab": vocab, "tokens": tokens,
                         "native_ms": 1e3 * statistics.median(times["native"]),
                         "ratio": statistics.median(times["fp32"]) / statistics.median(times["native"]),
                         "err_native": errors["native"], "err_fp32": errors["fp32"]})
            del layer
    return rows


def main(argv=None):
    from megapatch.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", default="32768,65536,131072")
    parser.add_argument("--hidden", default="1024,2048,4096")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    rows = run_ranks(_bench, world_size=1, timeout=3600,
                     args=([int(v) for v in args.vocab.split(",")], [int(h) for h in args.hidden.split(",")],
                           args.tokens, args.reps))[0]
    print(f"Output layer forward+backward, {args.tokens} tokens, BF16 operands, CPU, median of {args.reps}:\n")
    print("| hidden | vocab | native (ms) | fp32 / native | max abs logit error native | fp32 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hidden']} | {r['vocab']} | {r['native_ms']:.0f} | {r['ratio']:.2f} | "
              f"{r['err_native']:.2e} | {r['err_fp32']:.2e} |")


if __name__ == "__main__":
    main()
