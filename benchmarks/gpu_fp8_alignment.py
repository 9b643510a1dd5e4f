#!/usr/bin/env python
"""GPU check of align_fp8_transposes (Hopper + Transformer Engine >= 2.10, megatron-core >= 0.16).

    torchrun --nproc-per-node 2 benchmarks/gpu_fp8_alignment.py [--vpp 2 --layers-per-chunk 2]

NOT RUN by megapatch's authors (no GPU was available); it is the device counterpart of
``benchmarks/fp8_alignment.py``. Builds a GPT (TE layer spec) with FP8 parameters
(``fp8_model_init``, tensorwise recipe, ``fp8_param_gather=True``), PP = world size, VPP chunks
wrapped in megatron-core ``DistributedDataParallel`` (distributed-optimizer buffers,
``overlap_param_gather``, ``align_param_gather``), wires ``config.param_sync_func`` as Megatron-LM
does, and times ``forward_backward`` per pipeline stage, alternating lazy (megapatch disabled) and
aligned (enabled) iterations in one run. It also counts calls of TE's
``post_all_gather_processing`` (the transposes) and when each stage made them.
There is no optimizer step (the parameters do not change; each iteration still re-gathers them,
as ``finish_grad_sync`` resets the gather state). Measured: CUDA-synchronised wall time per
``forward_backward`` on every stage; nothing is simulated.
"""

import argparse
import os
import statistics
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vpp", type=int, default=2)
    ap.add_argument("--layers-per-chunk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=0, help="default: 2 * PP")
    ap.add_argument("--iters", type=int, default=6, help="per mode, after one warm-up each")
    a = ap.parse_args()

    import transformer_engine.pytorch as te
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    import megatron.core.distributed.param_and_grad_buffer as pgb

    import megapatch

    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    pp = torch.distributed.get_world_size()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=a.vpp)
    model_parallel_cuda_manual_seed(1234)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    m = a.microbatches or 2 * pp
    config = TransformerConfig(
        num_layers=pp * a.vpp * a.layers_per_chunk, hidden_size=a.hidden, num_attention_heads=32,
        ffn_hidden_size=4 * a.hidden, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=a.vpp, fp8="hybrid", fp8_recipe="tensorwise",
        fp8_param=True, microbatch_group_size_per_vp_stage=pp)
    chunks = []
    for vp in range(a.vpp):
        with te.fp8_model_init(enabled=True):
            chunks.append(GPTModel(
                config=config, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                vocab_size=32768, max_sequence_length=a.seq,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                vp_stage=vp).cuda())
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True,
        align_param_gather=True, fp8_param_gather=True)
    model = [DistributedDataParallel(config, ddp_config, c, disable_bucketing=i > 0)
             for i, c in enumerate(chunks)]
    config.no_sync_func = [c.no_sync for c in model]
    config.param_sync_func = [c.start_param_sync for c in model]
    config.finalize_model_grads_func = lambda cs, *x, **k: [c.finish_grad_sync() for c in cs]

    calls = []
    original = pgb.post_all_gather_processing

    def counting(params):  # counts and times upstream's processing; calls it unchanged
        torch.cuda.synchronize()
        calls.append(time.perf_counter())
        return original(params)

    pgb.post_all_gather_processing = counting

    tokens = torch.randint(0, 32768, (1, a.seq), device="cuda")
    pos = torch.arange(a.seq, device="cuda").unsqueeze(0)

    def forward_step(data_iterator, chunk):
        out = chunk(tokens, pos, None, labels=tokens)
        return out, lambda o: (o.float().mean(), {})

    times = {"lazy": [], "aligned": []}
    for i, mode in enumerate(["lazy", "aligned"] * (a.iters + 1)):
        (megapatch.enable if mode == "aligned" else megapatch.disable)(
            **({"align_fp8_transposes": True} if mode == "aligned" else {}))
        for c in model:
            c.zero_grad_buffer()
        torch.cuda.synchronize()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[None] * a.vpp, model=model,
            num_microbatches=m, seq_length=a.seq, micro_batch_size=1, forward_only=False)
        torch.cuda.synchronize()
        if i >= 2:
            times[mode].append(time.perf_counter() - t0)
    pgb.post_all_gather_processing = original
    status = megapatch.enable(align_fp8_transposes=True).patch("fp8.align_transposes")
    out = [None] * pp
    torch.distributed.all_gather_object(out, (pp_rank, {k: statistics.median(v) for k, v in times.items()},
                                              len(calls)))
    if torch.distributed.get_rank() == 0:
        print(f"backend: {status.backend}")
        print("| stage | lazy [s] | aligned [s] | aligned/lazy | processing calls |")
        print("|---|---|---|---|---|")
        for r, t, n in sorted(out):
            print(f"| {r} | {t['lazy']:.4f} | {t['aligned']:.4f} | {t['aligned'] / t['lazy']:.3f} | {n} |")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
