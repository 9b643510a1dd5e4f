"""Forward of a converted Megatron-LM checkpoint, once per megapatch mode, in one job.

Run by :func:`megapatch.testing.scenarios.llama_hf.forward` as::

    torchrun --nproc-per-node TP -m megapatch.testing.ranks.cpu_launch .../llama_forward.py \\
        <Megatron-LM Llama flags> --mp-tokens T.pt --mp-out OUT.pt --mp-modes native,fp32,... --mp-vocab V

from the Megatron-LM checkout. It uses Megatron-LM's own ``initialize_megatron``, ``get_model``
(``model_provider`` + ``gpt_builder``, as ``pretrain_gpt.py``) and ``load_checkpoint(strict=True)``,
then runs the token batch through the model in each mode: ``megapatch.disable()``, then
``megapatch.enable(**MODES[mode])`` (megapatch's wrappers read the settings at call time, so one
loaded model serves every mode). The vocab-parallel logits are all-gathered over the TP group and
trimmed to the true vocabulary; the dtype the output layer produced (before ``Float16Module``
casts to float32) is recorded. A mode megapatch refuses for this model (``tp_invariant`` with
SwiGLU today) is recorded with megapatch's refusal message instead of logits.
Rank 0 writes ``{mode: {"logits": float32 tensor, "logits_dtype": str} | {"refused": str}}``.
"""

from __future__ import annotations

import os
import sys


def _own_args(parser):
    group = parser.add_argument_group("megapatch llama_forward")
    group.add_argument("--mp-tokens", required=True)
    group.add_argument("--mp-out", required=True)
    group.add_argument("--mp-modes", required=True)
    group.add_argument("--mp-vocab", type=int, required=True)
    return parser


def main() -> None:
    sys.path.insert(0, os.getcwd())  # the Megatron-LM checkout (model_provider, gpt_builders)
    from functools import partial

    import torch

    import megapatch
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.testing.scenarios.llama_hf import MODES
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model

    from gpt_builders import gpt_builder
    from model_provider import model_provider

    initialize_megatron(extra_args_provider=_own_args, allow_no_cuda=True)
    args = get_args()
    modes = [m for m in args.mp_modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"llama_forward: unknown modes {unknown}; known: {list(MODES)}")

    model = get_model(partial(model_provider, gpt_builder), ModelType.encoder_or_decoder,
                      wrap_with_ddp=False)
    load_checkpoint(model, None, None, strict=True)
    module = model[0]
    module.eval()
    inner = module.module if hasattr(module, "module") else module
    seen_dtype = {}
    inner.output_layer.register_forward_hook(
        lambda _m, _i, out: seen_dtype.__setitem__("dtype", str((out[0] if isinstance(out, tuple) else out).dtype)))

    tokens = torch.load(args.mp_tokens)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    results = {}
    for mode in modes:
        megapatch.disable()
        if MODES[mode]:
            megapatch.enable(**MODES[mode])
        try:
            with torch.no_grad():
                logits = module(tokens, positions, None).float().contiguous()
        except UnsupportedConfigurationError as refusal:
            results[mode] = {"refused": str(refusal)}
            continue
        finally:
            megapatch.disable()
        if tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            torch.distributed.all_gather(parts, logits, group=group)
            logits = torch.cat(parts, dim=-1)
        results[mode] = {"logits": logits[..., :args.mp_vocab].clone(),
                         "logits_dtype": seen_dtype.get("dtype", "?"),
                         "padded_vocab": int(logits.shape[-1])}
    if torch.distributed.get_rank() == 0:
        torch.save(results, args.mp_out)
        print(f"llama_forward: wrote {args.mp_out} ({', '.join(results)})", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
