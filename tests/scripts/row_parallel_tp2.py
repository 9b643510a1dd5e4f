"""An unmodified training-style script: it never imports or enables megapatch.

Launched by tests/test_activation.py as `torchrun --nproc-per-node 2 row_parallel_tp2.py OUT`.
A row-parallel layer with integer-valued BF16 inputs is compared with an oracle (all-gather +
plain FP32 matmul, rounded once); each rank writes what it found to OUT.rank<N>.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def integers(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).to(torch.bfloat16)


def main(out_prefix):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=8,
                               tensor_model_parallel_size=world, params_dtype=torch.bfloat16,
                               bf16=True, use_cpu_initialization=True, perform_initialization=False)
    k, n = 512, 16
    layer = RowParallelLinear(k, n, config=config, init_method=None, bias=False,
                              input_is_parallel=True, skip_bias_add=False)
    with torch.no_grad():
        layer.weight.copy_(integers((n, k // world), 100 + rank))
    x = integers((4, 1, k // world), 200 + rank)
    with torch.no_grad():
        out, _ = layer(x)
        xs = [torch.empty_like(x) for _ in range(world)]
        ws = [torch.empty_like(layer.weight) for _ in range(world)]
        dist.all_gather(xs, x)
        dist.all_gather(ws, layer.weight.detach().contiguous())
        oracle = (torch.cat(xs, -1).float() @ torch.cat(ws, -1).float().t()).to(torch.bfloat16)
    megapatch = sys.modules.get("megapatch")  # loaded by the startup hook, if at all
    report = {
        "rank": rank,
        "equals_oracle": bool(torch.equal(out, oracle)),
        "megapatch_loaded": megapatch is not None,
        "active": megapatch.status().active if megapatch is not None else [],
    }
    with open(f"{out_prefix}.rank{rank}.json", "w") as fh:
        json.dump(report, fh)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
