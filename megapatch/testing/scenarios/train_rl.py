"""Megatron-LM's own ``train_rl.py`` (GRPO) on CPU ranks: the fixtures it needs without a hub
(a byte-level BPE tokenizer trained on generated countdown text, the synthetic countdown
environment of :mod:`megapatch.testing.scenarios.rl_countdown`), the flags of a tiny Qwen3-shaped
model (dense or MoE), and a launch that returns upstream's own rollout statistics per step
(recorded by :mod:`megapatch.testing.stand_ins.rl_compat` from what ``train_rl.py`` hands its
loggers)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

SPECIALS = ("<|unused|>", "<|pad|>", "<|endoftext|>")  # id 0 is neither EOD nor pad (rl_utils masks by both)
VOCAB = 512  # the BPE's size; pads to 512 at TP 1/2/4 (--make-vocab-size-divisible-by 32)
SEQ = 64
AGENT = "megapatch.testing.scenarios.rl_countdown.SyntheticCountdownAgent"


def countdown_tokenizer(out_dir) -> Path:
    """A byte-level BPE of :data:`VOCAB` entries trained on generated countdown prompts and
    answers, saved as a Hugging Face tokenizer directory. Deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    texts = []
    for _ in range(2000):
        nums = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        target = rng.randint(1, 100)
        texts.append(f"Using the numbers {nums}, create an equation that equals {target}. <answer> "
                     f"({nums[0]} + {nums[1]}) * {nums[2]} </answer>")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[2], pad_token=SPECIALS[1])
    out = Path(out_dir)
    fast.save_pretrained(str(out))
    return out


def env_config(path, revision: str = "core_v0.16.1") -> Path:
    """The environment config: core_v0.16.1 imports an agent_type given as a dotted path, main only
    names from its allowlist (the launcher registers the agent there: ``rl_compat``)."""
    from megapatch.testing.stand_ins.rl_compat import AGENT_NAME

    path = Path(path)
    agent = AGENT_NAME if _is_main(revision) else AGENT
    path.write_text(f"- agent_type: {agent}\n  agent_args: {{}}\n  weight: 1.0\n")
    return path


def _is_main(revision: str) -> bool:
    """Megatron-LM main (``main-d98e8a64``): the in-process rollout server is the only one and its flag
    is gone, ``--inference-max-batch-size`` became ``--inference-max-requests``, and an environment
    names its agent from an allowlist."""
    return revision.startswith("main")


def flags(*, tokenizer, env, tp: int = 1, rollout_tp: Optional[int] = None, ep: int = 1,
          rollout_ep: Optional[int] = None, moe: bool = False, iters: int = 3, prompts: int = 2,
          group: int = 4, micro_batch: int = 2, sequence_parallel: bool = True, hidden: int = 64,
          ffn: int = 128, moe_ffn: int = 64, revision: str = "core_v0.16.1",
          extra: Sequence[str] = ()) -> List[str]:
    """``train_rl.py``'s flags: a tiny Qwen3-shaped model (QK RMSNorm, SwiGLU, GQA, RoPE; with
    ``moe`` 4 experts top-2, alltoall dispatcher), GRPO with ``prompts`` x ``group`` rollouts a
    step, each step's global batch in micro-batches of ``micro_batch``, the dynamic engine as the
    in-process rollout server; the rollout model at ``rollout_tp`` / ``rollout_ep``; ``hidden``,
    ``ffn`` and ``moe_ffn`` its widths (8 heads of ``hidden / 8``)."""
    out = ["--num-layers", "2", "--hidden-size", str(hidden), "--num-attention-heads", "8",
           "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", str(ffn),
           "--kv-channels", str(hidden // 8), "--swiglu", "--normalization", "RMSNorm", "--qk-layernorm",
           "--position-embedding-type", "rope", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights",
           "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
           "--micro-batch-size", str(micro_batch), "--global-batch-size", str(prompts * group),
           "--train-iters", str(iters), "--lr", "1e-2", "--min-lr", "1e-2", "--lr-decay-style", "constant",
           "--seed", "1234", "--attention-dropout", "0", "--hidden-dropout", "0",
           "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer),
           "--make-vocab-size-divisible-by", "32",
           "--tensor-model-parallel-size", str(tp), "--distributed-backend", "gloo",
           "--use-cpu-initialization", "--bf16", "--transformer-impl", "local",
           "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
           "--no-rope-fusion", "--no-persist-layer-norm", "--no-bias-swiglu-fusion",
           "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
           "--perform-rl-step", "--langrl-env-config", str(env),
           *(() if _is_main(revision) else ("--langrl-inference-server-type", "inplace_megatron")),
           "--grpo-prompts-per-step", str(prompts), "--grpo-group-size", str(group), "--grpo-iterations", "1",
           "--inference-max-seq-length", str(SEQ),
           "--inference-max-requests" if _is_main(revision) else "--inference-max-batch-size", str(prompts * group),
           "--inference-dynamic-batching-buffer-size-gb", "0.05",
           "--inference-dynamic-batching-block-size", "16",
           "--inference-dynamic-batching-max-requests", "8",
           "--inference-dynamic-batching-max-tokens", "512",
           "--rl-default-temperature", "1.0"]
    if tp > 1 and sequence_parallel:
        out.append("--sequence-parallel")
    if rollout_tp is not None and rollout_tp != tp:
        out += ["--rl-inference-tensor-model-parallel-size", str(rollout_tp)]
    if moe:
        out += ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
                "--moe-ffn-hidden-size", str(moe_ffn), "--moe-aux-loss-coeff", "0",
                "--expert-model-parallel-size", str(ep)]
        if rollout_ep is not None and rollout_ep != ep:
            out += ["--rl-inference-expert-model-parallel-size", str(rollout_ep)]
        if rollout_tp is not None and rollout_tp != tp:  # expert TP follows the rollout's TP (as the trainer's does)
            out += ["--rl-inference-expert-tensor-model-parallel-size", str(rollout_tp)]
    return out + list(extra)


def run(checkout, workdir, *, nproc: int, megapatch_env: Optional[Mapping[str, str]] = None,
        timeout: float = 600.0, name: str = "run", **flag_args):
    """One ``train_rl.py`` job from the checkout root on ``nproc`` CPU ranks, ``MEGAPATCH_*`` from
    ``megapatch_env`` only; returns ``(run, stats)``: the finished :class:`Run` and rank 0's
    recorded rollout statistics, one dict per step (upstream's ``RolloutStats`` fields)."""
    from megapatch.testing.ranks import megatron_lm_runs as mlm
    from megapatch.testing.stand_ins.rl_compat import STATS_ENV

    workdir = Path(workdir)
    tokenizer = workdir / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        countdown_tokenizer(tokenizer)
    env = env_config(workdir / f"env-{name}.yaml", flag_args.get("revision", "core_v0.16.1"))
    stats = workdir / f"{name}.stats.jsonl"
    stats.unlink(missing_ok=True)
    job = mlm.launch(checkout, flags(tokenizer=tokenizer, env=env, **flag_args), nproc=nproc,
                     script="train_rl.py", megapatch_env=megapatch_env, timeout=timeout,
                     entry=["-m", "megapatch.testing.ranks.rl_launch"],
                     extra_env={"PYTHONPATH": str(checkout), STATS_ENV: str(stats),
                                "WANDB_MODE": "disabled"})
    job.stats_path = stats
    return job, rank_stats(job, 0)


def rank_stats(job, rank: int) -> list:
    """One rank's recorded rollout statistics of a finished :func:`run`, one dict per step."""
    from megapatch.testing.stand_ins.rl_compat import read_rollout_stats

    return read_rollout_stats(job.stats_path, rank) if job.stats_path.is_file() else []
