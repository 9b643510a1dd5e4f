"""Test-only torchrun entry: ``megapatch.testing.cpu_launch`` plus a recorder of what reaches
megatron's vocab-parallel cross entropy (the loss of Megatron-LM's ``loss_func``).

Each call appends ``{"dtype": <logits dtype>, "loss": <sha256 of the per-token losses>}`` to
``$MEGATRON_LM_PROBE_DIR/rank<RANK>.jsonl``. It only reads tensors; numerics are unchanged.
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
        digest = hashlib.sha256(loss.detach().float().contiguous().numpy().tobytes()).hexdigest()
        with open(OUT, "a") as out:
            out.write(json.dumps({"dtype": dtype, "loss": digest}) + "\n")
        return loss

    cls.forward = staticmethod(forward)


wrapt.register_post_import_hook(_record_cross_entropy, "megatron.core.tensor_parallel.cross_entropy")

from megapatch.testing.cpu_launch import main  # noqa: E402

main()
