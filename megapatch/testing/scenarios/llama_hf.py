"""A tiny Hugging Face Llama (or Qwen2) through Megatron-LM's own converter and loader, on CPU.

The pieces the Llama test (``tests/test_llama_hf.py``) and benchmark (``benchmarks/llama_hf.py``)
share:

* :func:`build_tiny_hf`: seeded random weights saved with ``save_pretrained`` (safetensors, BF16)
  plus a word-level fast tokenizer built locally with ``tokenizers`` (no download), with planted
  outlier channels (below);
* :func:`convert`: Megatron-LM's ``tools/checkpoint/convert.py --loader llama_mistral
  --checkpoint-type hf --saver core --saver-transformer-impl local`` under
  :mod:`megapatch.testing.ranks.convert_launch`;
* :func:`forward`: Megatron-LM's ``initialize_megatron`` / ``get_model`` / ``load_checkpoint`` with
  the Llama flags (:func:`megatron_flags`) under ``torchrun -m megapatch.testing.ranks.cpu_launch``
  (:mod:`megapatch.testing.scenarios.llama_forward`), every megapatch mode in one process per TP size;
* :func:`hf_logits`: the independent oracle, transformers' own forward of the same HF weights;
* the metrics (:func:`compare`, :func:`drift`).

**Planted outlier channels** ("massive activations", as trained LLMs show on delimiter tokens):
token :data:`DELIMITER`'s embedding carries ``DELIMITER_SCALE`` in hidden dimension 0 (every other
entry stays small and random), so after layer 0's ``post_attention_layernorm`` that dimension is
about sqrt(hidden) for this token only. Layer 0's MLP neurons 3 and ``ffn - 3`` read dimension 0
through ``gate_proj`` and ``up_proj`` (SwiGLU: silu(gate) * up, both large for this token) and
write through ``down_proj`` into :data:`OUTLIER_DIMS` with scales ``+OUTLIER_SCALE`` and
``-OUTLIER_SCALE * (1 - 1/128)``: two large, nearly cancelling contributions. Neuron 3 sits in
the first and neuron ``ffn - 3`` in the last tensor-parallel shard of ``linear_fc1``/``linear_fc2``
at every TP size > 1, so the cancellation happens in the TP all-reduce of ``linear_fc2``, where a
BF16 reduction loses the remainder. Norm gains are 1 + 0.1 N(0, 1) and (Qwen2) QKV biases
0.05 N(0, 1) so a wrong mapping cannot hide behind ones or zeros.

Nothing here imports torch, transformers or megatron at module level.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from megapatch.testing.ranks import megatron_lm_runs

DELIMITER = 7  # the token with the massive activation ("." in the word-level vocabulary)
DELIMITER_SCALE = 4.0
OUTLIER_DIMS = (5, 21, 38, 50)
OUTLIER_SCALE = 4.0
OUTLIER_NEURON = 3  # neurons OUTLIER_NEURON and ffn - OUTLIER_NEURON
SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")

#: megapatch modes of the forward runner: name -> ``megapatch.enable`` keywords (native: disabled)
MODES: Dict[str, Dict[str, object]] = {
    "native": {},
    "fp32": {"tp_reduce_dtype": "fp32"},
    "fp32-accumulate": {"tp_reduce_dtype": "fp32-accumulate"},
    "logits-fp32": {"logits_dtype": "fp32"},
    "fp32+logits-fp32": {"tp_reduce_dtype": "fp32", "logits_dtype": "fp32"},
    "tp-invariant": {"tp_invariant": True},
}

#: the CPU flags every forward needs on top of the Llama flags (no CUDA kernels, gloo)
CPU_FLAGS = ("--use-cpu-initialization", "--transformer-impl", "local", "--no-bias-swiglu-fusion",
             "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
             "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--distributed-backend", "gloo")

EXTRA_NAME = "llama"  # pyproject's optional-dependency extra that brings transformers & co.


def missing_dependencies() -> List[str]:
    """The modules of the ``llama`` extra that are not importable here."""
    import importlib.util

    return [m for m in ("transformers", "accelerate", "tokenizers", "safetensors")
            if importlib.util.find_spec(m) is None]


# --- the HF model ------------------------------------------------------------------------------


def _tokenizer(vocab: int):
    """A word-level fast tokenizer with exactly ``vocab`` entries: the specials, then ``.`` (id
    :data:`DELIMITER`), then ``w<i>``. Built locally, deterministic."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = list(SPECIALS) + [f"p{i}" for i in range(DELIMITER - len(SPECIALS))] + ["."]
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIALS[2]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert tok.get_vocab_size(with_added_tokens=True) == vocab
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0],
                                                eos_token=SPECIALS[1], pad_token=SPECIALS[2],
                                                unk_token=SPECIALS[2])


def build_tiny_hf(out_dir, *, arch: str = "llama", hidden: int = 128, heads: int = 4,
                  kv_heads: int = 2, ffn: int = 384, layers: int = 2, vocab: int = 1024,
                  seed: int = 1234, outliers: bool = True, tokenizer: bool = True,
                  rms_norm_eps: float = 1e-5, rope_theta: float = 10000.0) -> dict:
    """Saves a tiny seeded Llama (``arch="llama"``: GQA, untied head, no biases) or Qwen2
    (``arch="qwen2"``: QKV biases) in BF16 with ``save_pretrained`` to ``out_dir``; returns its
    config.json as a dict. ``outliers``: plant the massive activations (module docstring)."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        _tokenizer(vocab).save_pretrained(str(out))
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=4096, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(seed)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common))
        qkv_bias = False
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(use_sliding_window=False, **common))
        qkv_bias = True
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen2', not {arch!r}")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.05 * noise)
            else:
                param.copy_(noise * (0.5 / math.sqrt(param.shape[-1])))
        if outliers:
            _plant_outliers(model, hidden, ffn)
    assert qkv_bias == any(n.endswith("q_proj.bias") for n, _ in model.named_parameters())
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(str(out), safe_serialization=True)
    return json.loads((out / "config.json").read_text())


def _plant_outliers(model, hidden: int, ffn: int) -> None:
    if max(OUTLIER_DIMS) >= hidden:
        raise ValueError(f"hidden {hidden} too small for the outlier dimensions {OUTLIER_DIMS}")
    model.model.embed_tokens.weight[DELIMITER, 0] = DELIMITER_SCALE
    mlp = model.model.layers[0].mlp
    for neuron, scale in ((OUTLIER_NEURON, OUTLIER_SCALE),
                          (ffn - OUTLIER_NEURON, -OUTLIER_SCALE * (1 - 1 / 128))):
        mlp.gate_proj.weight[neuron, 0] = 1.0
        mlp.up_proj.weight[neuron, 0] = 1.0
        for d in OUTLIER_DIMS:
            mlp.down_proj.weight[d, neuron] = scale


def tokens(batch: int, seq: int, vocab: int, seed: int = 5):
    """A seeded token batch ``[batch, seq]`` with the delimiter every 16 positions."""
    import torch

    t = torch.randint(len(SPECIALS), vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    t[:, 3::16] = DELIMITER
    return t


def hf_logits(hf_dir, token_batch, dtype: str = "fp32"):
    """transformers' own forward of the saved weights: ``fp32`` (the BF16 weights upcast, FP32
    compute) or ``bf16``; float32 logits ``[batch, seq, vocab]``."""
    import torch
    import transformers

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch_dtype).eval()
    with torch.no_grad():
        return model(token_batch).logits.float()


# --- Megatron-LM: conversion and forward ---------------------------------------------------------


def convert_command(hf_dir, out_dir, tp: int, model_size: str = "llama3",
                    tokenizer_dir=None) -> List[str]:
    """The converter command (run from the Megatron-LM checkout)."""
    return [sys.executable, "-m", "megapatch.testing.ranks.convert_launch", "tools/checkpoint/convert.py",
            "--model-type", "GPT", "--loader", "llama_mistral", "--checkpoint-type", "hf",
            "--model-size", model_size, "--load-dir", str(hf_dir),
            "--tokenizer-model", str(tokenizer_dir if tokenizer_dir is not None else hf_dir),
            "--saver", "core", "--saver-transformer-impl", "local", "--save-dir", str(out_dir),
            "--target-tensor-parallel-size", str(tp)]


def convert(checkout, hf_dir, out_dir, tp: int, model_size: str = "llama3", *,
            tokenizer_dir=None, timeout: float = 300.0) -> megatron_lm_runs.Run:
    """Runs :func:`convert_command` (no torchrun: the converter forks its own saver)."""
    import subprocess
    import time

    command = convert_command(hf_dir, out_dir, tp, model_size, tokenizer_dir)
    env = megatron_lm_runs.launch_env({}, None)
    env.update(megatron_lm_runs.rank_server_env(), CUDA_VISIBLE_DEVICES="")
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=str(checkout), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        return megatron_lm_runs.Run(command, done.returncode, done.stdout, time.monotonic() - start)
    except subprocess.TimeoutExpired as expired:
        log = expired.stdout if isinstance(expired.stdout, str) else (expired.stdout or b"").decode()
        return megatron_lm_runs.Run(command, -9, log, time.monotonic() - start, timed_out=True)


def megatron_flags(config: Mapping, ckpt, tp: int, seq: int, *, bf16: bool = True,
                   tokenizer_dir=None, num_query_groups: Optional[int] = None,
                   extra: Sequence[str] = ()) -> List[str]:
    """Megatron-LM's Llama flags for the HF ``config`` (config.json), plus :data:`CPU_FLAGS`.

    The converter does not carry ``rope_theta``, ``rope_scaling`` or ``rms_norm_eps`` into the
    checkpoint (``loader_llama_mistral.py:280-315``): they are passed here as ``--rotary-base`` and
    ``--norm-epsilon`` (``rope_scaling`` of type llama3 would need ``--use-rope-scaling
    --rope-scaling-factor F``; the tiny models have none)."""
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads", heads) if num_query_groups is None else num_query_groups
    if config.get("rope_scaling"):
        raise NotImplementedError("rope_scaling: pass --use-rope-scaling --rope-scaling-factor F via extra")
    flags = [
        "--num-layers", str(config["num_hidden_layers"]), "--hidden-size", str(config["hidden_size"]),
        "--ffn-hidden-size", str(config["intermediate_size"]), "--num-attention-heads", str(heads),
        "--kv-channels", str(config["hidden_size"] // heads),
        "--group-query-attention", "--num-query-groups", str(groups),
        "--seq-length", str(seq), "--max-position-embeddings", str(config["max_position_embeddings"]),
        "--position-embedding-type", "rope", "--rotary-base", str(int(config.get("rope_theta", 10000))),
        "--normalization", "RMSNorm", "--norm-epsilon", str(config["rms_norm_eps"]),
        "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", "1",
        "--tensor-model-parallel-size", str(tp), *CPU_FLAGS,
        "--load", str(ckpt), "--ckpt-format", "torch", "--no-load-optim", "--no-load-rng",
        "--exit-on-missing-checkpoint", "--seed", "1234",
    ]
    if config.get("model_type") == "qwen2":
        flags.append("--add-qkv-bias")
    if bf16:
        flags.append("--bf16")
    if tokenizer_dir is not None:
        flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_dir)]
    else:  # NullTokenizer's vocabulary is --vocab-size + 1 (EOD)
        flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(config["vocab_size"] - 1)]
    return flags + list(extra)


def pretrain_flags(config: Mapping, ckpt, tp: int, seq: int, *, iters: int = 20, lr: float = 1e-5,
                   micro_batch: int = 2, global_batch: int = 4) -> List[str]:
    """``pretrain_gpt.py`` flags that continue training from a converted checkpoint: the Llama
    flags of :func:`megatron_flags` (BF16, NullTokenizer with the checkpoint's vocabulary), plus
    ``--finetune`` (iteration 0, no optimizer state: the converter saves none), mock data, a
    constant learning rate, no evaluation."""
    return megatron_flags(config, ckpt, tp, seq, extra=[
        "--finetune", "--train-iters", str(iters), "--lr", str(lr), "--min-lr", str(lr),
        "--lr-decay-style", "constant", "--micro-batch-size", str(micro_batch),
        "--global-batch-size", str(global_batch), "--mock-data", "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", str(10 * iters + 1000)])


def forward(checkout, flags: Sequence[str], *, tp: int, tokens_path, out_path,
            modes: Sequence[str] = tuple(MODES), vocab: int, timeout: float = 600.0,
            megapatch_env: Optional[Mapping[str, str]] = None) -> megatron_lm_runs.Run:
    """``torchrun -m megapatch.testing.ranks.cpu_launch llama_forward.py FLAGS``: loads the checkpoint
    once and runs the token batch forward in each mode (``megapatch.enable``/``disable`` between
    forwards); rank 0 saves ``{mode: {"logits", "logits_dtype"} or {"refused": message}}`` to
    ``out_path``."""
    own = ["--mp-tokens", str(tokens_path), "--mp-out", str(out_path), "--mp-modes", ",".join(modes),
           "--mp-vocab", str(vocab)]
    # the checkout's megatron first on sys.path, as for `python pretrain_gpt.py` from the checkout
    path = os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH", "")) if p)
    return megatron_lm_runs.launch(Path(checkout), [*flags, *own], nproc=tp, timeout=timeout,
                                   megapatch_env=megapatch_env,
                                   script=str(Path(__file__).with_name("llama_forward.py")),
                                   extra_env={"PYTHONPATH": path})


# --- metrics -----------------------------------------------------------------------------------

#: eps of the element-wise mean relative error
MEAN_REL_EPS = 1e-6


def compare(x, ref) -> Dict[str, float]:
    """Error of logits ``x`` against ``ref`` (both float): ``rel_l2`` = ||x - ref|| / ||ref||
    (Frobenius norms over every logit); ``mean_rel`` = mean over every logit of
    |x - ref| / (|ref| + MEAN_REL_EPS); ``max_abs`` = max |x - ref|; ``argmax_agree`` = share of
    positions with the same top-1 token."""
    import torch

    x, ref = x.double(), ref.double()
    diff = (x - ref).abs()
    return {"rel_l2": (torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref)).item(),
            "mean_rel": (diff / (ref.abs() + MEAN_REL_EPS)).mean().item(),
            "max_abs": diff.max().item(),
            "argmax_agree": (x.argmax(-1) == ref.argmax(-1)).double().mean().item()}


def drift(x, tp1) -> Dict[str, float]:
    """Drift of logits ``x`` (TP=n) from ``tp1`` (same mode, TP=1): ``kl`` = mean over positions of
    KL(p_TP1 || p_TPn) = sum_v p_TP1(v) (log p_TP1(v) - log p_TPn(v)), p = softmax of the logits in
    float64; ``max_abs``; ``identical`` = share of bit-identical logits; ``flips`` = share of
    positions whose greedy (argmax) next token differs from TP=1's."""
    import torch

    lp1 = torch.log_softmax(tp1.double(), -1)
    lpn = torch.log_softmax(x.double(), -1)
    kl = (lp1.exp() * (lp1 - lpn)).sum(-1).mean().item()
    return {"kl": max(kl, 0.0), "max_abs": (x.double() - tp1.double()).abs().max().item(),
            "identical": (x == tp1).double().mean().item(),
            "flips": (x.argmax(-1) != tp1.argmax(-1)).double().mean().item()}


def checkpoint_shards(ckpt) -> List[Path]:
    """The model shards a ``torch``-format conversion wrote (``iter_*/mp_rank_*/model_optim_rng.pt``)."""
    return sorted(Path(ckpt).glob("iter_*/mp_rank_*/model_optim_rng.pt"))


def swap_gate_up(ckpt) -> int:
    """Corrupts a converted checkpoint in place the way a wrong mapping would: in every
    ``linear_fc1.weight`` shard, the gate and up halves ([gate; up] per TP rank) change places.
    Returns how many tensors were changed. Test oracle only."""
    import torch

    changed = 0
    for shard in checkpoint_shards(ckpt):
        state = torch.load(shard, map_location="cpu", weights_only=False)
        for name, tensor in state["model"].items():
            if name.endswith("mlp.linear_fc1.weight"):
                gate, up = torch.chunk(tensor, 2, dim=0)
                state["model"][name] = torch.cat([up, gate], dim=0).contiguous()
                changed += 1
        torch.save(state, shard)
    return changed


def env_summary() -> Dict[str, str]:
    """Versions that matter for the figures."""
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "megatron-core", "transformers", "tokenizers", "safetensors", "accelerate"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    out["cpu_count"] = str(os.cpu_count())
    return out
