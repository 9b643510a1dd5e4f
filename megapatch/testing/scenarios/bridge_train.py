"""A few training steps through Megatron-Bridge's own training entry, on CPU ranks.

Run under the CPU launcher (one process per rank, as on GPUs)::

    MEGAPATCH_TP_REDUCE_DTYPE=fp32 torchrun --nproc-per-node 2 -m megapatch.testing.ranks.cpu_launch \\
        --bridge megapatch/testing/scenarios/bridge_train.py --hf DIR --tp 2 --iters 5

What runs is Bridge's: the recipe base ``megatron.bridge.recipes.common._pretrain_common()``
(mock GPT data, Bridge's optimizer/scheduler/DDP/logging configuration), its ``cfg.model`` set to
the provider ``AutoBridge.from_hf_pretrained(DIR).to_megatron_provider(load_weights=True)`` gives
for the HF Llama (with :func:`megapatch.testing.scenarios.bridge_llama.configure_provider`'s CPU settings),
then ``megatron.bridge.training.pretrain.pretrain(cfg, gpt_step.forward_step)``. Overridden for a
CPU run of a few steps: iterations, batch sizes, sequence length, gloo, no checkpoint saving,
no evaluation, no tensorboard, the plain (non-distributed) Adam with no overlapped
communication, a constant learning rate. megapatch is switched by ``MEGAPATCH_*`` only.

The CUDA-only calls of Bridge's training loop are replaced by the launcher's labelled stand-ins
(:data:`megapatch.testing.stand_ins.bridge_compat.TRAINING_WORKAROUNDS`).
"""

from __future__ import annotations

import argparse


def _config(args):
    from megatron.bridge import AutoBridge
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    from megapatch.testing.scenarios.bridge_llama import configure_provider

    cfg = _pretrain_common()
    provider = AutoBridge.from_hf_pretrained(args.hf).to_megatron_provider(load_weights=True)
    provider.cross_entropy_loss_fusion = bool(args.cross_entropy_fusion)
    cfg.model = configure_provider(provider, args.tp)
    cfg.model.seq_length = args.seq
    cfg.train.train_iters = args.iters
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 4
    cfg.train.manual_gc = False
    cfg.validation.eval_iters, cfg.validation.eval_interval = 0, 10 * args.iters + 1000
    cfg.dataset.seq_length = args.seq
    cfg.tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=args.hf,
                                    use_tokenizer_vocab_size=True)
    cfg.checkpoint.save = cfg.checkpoint.load = None
    cfg.checkpoint.save_interval = None
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = None
    cfg.logger.log_timers_to_tensorboard = False
    cfg.dist.distributed_backend = "gloo"
    cfg.rng.seed = 1234
    opt = cfg.optimizer
    opt.use_distributed_optimizer = False
    opt.lr = opt.min_lr = args.lr
    cfg.scheduler.lr_decay_style = "constant"
    cfg.scheduler.lr_warmup_iters = 0
    ddp = cfg.ddp
    ddp.use_distributed_optimizer = False
    ddp.overlap_grad_reduce = ddp.overlap_param_gather = False
    ddp.data_parallel_sharding_strategy = "no_shard"
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--cross-entropy-fusion", type=int, choices=(0, 1), default=1,
                        help="the provider's cross_entropy_loss_fusion (Bridge's default: 1)")
    args = parser.parse_args()
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    pretrain(_config(args), forward_step)


if __name__ == "__main__":
    main()
