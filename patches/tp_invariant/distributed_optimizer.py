"""``tp_invariant.distributed_optimizer``: several distributed-optimizer instances are refused when
the optimizer is built (their gradient all-reduce is not under the fixed tree). The distributed
optimizer itself is covered: Adam is elementwise on its flat shards, and the grad norm reads the
full-shaped gradients from the grad buffers (``grad_norm``)."""

from __future__ import annotations

from megapatch.core.call_args import argument
from megapatch.core.registry import Target
from megapatch.numerics import block_tree as tpi
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant, tp_invariant_patch
from megapatch.patches.tp_invariant._refusal_tables import described, optimizer_instances


def _preflight_optimizer(config):
    instances = getattr(config, "num_distributed_optimizer_instances", 1) or 1
    distributed = getattr(config, "use_distributed_optimizer", False)
    return described([optimizer_instances(instances)] if distributed and instances > 1 else [])


def _distributed_optimizer_init(wrapped, instance, args, kwargs):
    if tpi.active():
        for chunk in argument(args, kwargs, 4, "model_chunks", None) or ():
            instances = getattr(getattr(chunk, "ddp_config", None), "num_distributed_optimizer_instances", 1)
            if (instances or 1) > 1:
                refuse_tp_invariant(*optimizer_instances(instances))
    return wrapped(*args, **kwargs)


PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.distributed_optimizer",
        summary="refuses several distributed-optimizer instances at construction (their all-reduce is not under the tree)",
        hook="megatron.core.optimizer.distrib_optimizer",
        targets=(Target("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
                        _distributed_optimizer_init, kind="method",
                        params=("self", "optimizer", "config", "grad_scaler", "init_state_fn", "model_chunks")),),
        preflight=_preflight_optimizer,
    ),
)
