"""One training step of a tiny megatron-core GPT at TP = world size, on CPU ranks over gloo.

Launched by tests/test_integrations_nemo_run.py through a NeMo-Run ``LocalExecutor`` with the
torchrun launcher. The script never calls ``megapatch.enable()``: megapatch activates only when the
``MEGAPATCH_*`` variables reach the ranks (the startup hook), which is what the plugin is tested
for. It imports ``megapatch.testing`` for the CPU stand-ins of megatron-core's CUDA-only calls and
the tiny model, which import megapatch but do not activate it.

Rank 0 prints one line ``nemo_run_tiny_gpt step done: ...`` with the logits dtype (FP32 only when
``logits_dtype=fp32`` took effect; the model is BF16), the loss, the gradient norm and whether
megapatch is enabled in this process.
"""

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    from megatron.core import parallel_state

    from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds
    from megapatch.testing.models.tiny_gpt import (build_bf16_optimizer, build_tiny_gpt, cuda_type_names,
                                            make_batch, tiny_gpt_config)

    with cpu_workarounds():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        model = build_tiny_gpt(tiny_gpt_config(world), vocab_size=128, seq_len=32)
        optimizer = build_bf16_optimizer(model)
        batch = make_batch(0, batch=2, seq_len=32, vocab=128)
        with torch.no_grad():
            logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
        loss = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
        loss = loss.float().mean()
        loss.backward()
        with cuda_type_names():
            ok, grad_norm, _ = optimizer.step()
        import megapatch  # already imported above (megapatch.testing); asked, not enabled, here

        if dist.get_rank() == 0:
            print(f"nemo_run_tiny_gpt step done: world={world} logits_dtype={logits.dtype} "
                  f"loss={loss.item():.4f} grad_norm={grad_norm:.4f} step_ok={ok} "
                  f"megapatch_enabled={megapatch.is_enabled()}", flush=True)
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
