"""Test-only torchrun entry: ``megapatch.testing.ranks.cpu_launch`` plus a recorder of what reaches
megatron's vocab-parallel cross entropy (the loss of Megatron-LM's ``loss_func``).

Each call appends ``{"dtype": <logits dtype>, "loss": <sha256 of the per-token losses>, "values":
<those losses as float hex>}`` to
``$MEGATRON_LM_PROBE_DIR/rank<RANK>.jsonl``, and each clipped step its total grad norm (and digests of
the replicated parameters' gradients) to ``norms-rank<RANK>.jsonl``. It only reads tensors; numerics are unchanged.
"""

import hashlib
import json
import os

import wrapt

OUT = os.path.join(os.environ["MEGATRON_LM_PROBE_DIR"], f"rank{os.environ.get('RANK', '0')}.jsonl")


def _record_cross_entropy(module):
    cls = module._VocabParallelCrossEntropy
    original = cls.forward

    def forward(ctx, vocab_parallel_logits, *args, **kwargs):
        dtype = str(vocab_parallel_logits.dtype)
        loss = original(ctx, vocab_parallel_logits, *args, **kwargs)
        values = loss.detach().float().contiguous()
        digest = hashlib.sha256(values.numpy().tobytes()).hexdigest()
        with open(OUT, "a") as out:  # the values too, as FP32 hex: a distance needs them, exactly
            out.write(json.dumps({"dtype": dtype, "loss": digest,
                                  "values": [v.hex() for v in values.flatten().tolist()]}) + "\n")
        return loss

    cls.forward = staticmethod(forward)


def _record_grad_norm(module):
    """The total grad norm where clipping reads it, at full precision (the log prints 3 decimals),
    and a digest of each replicated parameter's gradient (norms, QK norms: not TP-split, so the
    same tensor at every TP size; in the optimizer's parameter order), to ``norms-rank<RANK>.jsonl``."""
    original = module.clip_grad_by_total_norm_fp32

    def clip(parameters, max_norm, total_norm, *args, **kwargs):
        parameters = parameters if isinstance(parameters, list) else list(parameters)
        replicated = [hashlib.sha256(p.grad.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]
                      for p in parameters
                      if getattr(p, "grad", None) is not None and not getattr(p, "tensor_model_parallel", False)]
        with open(NORMS, "a") as out:
            out.write(json.dumps({"grad_norm": float(total_norm).hex(), "replicated_grads": replicated}) + "\n")
        return original(parameters, max_norm, total_norm, *args, **kwargs)

    module.clip_grad_by_total_norm_fp32 = clip  # the name optimizer.py calls


NORMS = os.path.join(os.environ["MEGATRON_LM_PROBE_DIR"], f"norms-rank{os.environ.get('RANK', '0')}.jsonl")
wrapt.register_post_import_hook(_record_cross_entropy, "megatron.core.tensor_parallel.cross_entropy")
wrapt.register_post_import_hook(_record_grad_norm, "megatron.core.optimizer.optimizer")

from megapatch.testing.ranks.cpu_launch import main  # noqa: E402

main()
