"""CPU multi-rank test harness for real megatron-core (independent of the patch engine).

Public API::

    run_ranks(fn, world_size, tp=1, pp=1, vpp=None, *, args=(), kwargs=None,
              timeout=180, env=None, init_megatron=True, workarounds=True,
              parallel_kwargs=None) -> list
    reinit_model_parallel(ctx, tp=1, pp=1, vpp=None, **parallel_kwargs) -> RankContext
    RankContext, RankFailure, RankTimeout
    cpu_workarounds()                      # context manager
    tiny_gpt_config(tp, pp=1, sequence_parallel=False, *, vpp=None, **overrides)
    build_tiny_gpt(config, vocab_size=128, seq_len=32, seed=1234, ...)
    make_batch(seed, batch, seq_len, vocab) -> Batch
    gather_tp_logits(logits, ctx=None), gather_full_weights(model, ctx=None)

The torch/megatron-dependent names (from ``tiny_gpt``) are imported lazily, on
first access, so that importing this package (as every spawned rank does
before it applies its ``env``) does not import torch or megatron.
"""

from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds, workarounds_active
from megapatch.testing.ranks.harness import run_ranks
from megapatch.testing.ranks.rank_context import RankContext, reinit_model_parallel
from megapatch.testing.ranks.rank_results import RankFailure, RankTimeout

_TINY_GPT_NAMES = (
    "Batch",
    "tiny_gpt_config",
    "build_tiny_gpt",
    "make_batch",
    "gather_tp_logits",
    "gather_full_weights",
)

__all__ = [
    "run_ranks",
    "reinit_model_parallel",
    "RankContext",
    "RankFailure",
    "RankTimeout",
    "cpu_workarounds",
    "workarounds_active",
    *_TINY_GPT_NAMES,
]


def __getattr__(name):
    if name in _TINY_GPT_NAMES:
        from megapatch.testing.models import tiny_gpt

        return getattr(tiny_gpt, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
