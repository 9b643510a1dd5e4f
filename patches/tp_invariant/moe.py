"""``tp_invariant.moe``: the router (``_router``) and, with expert parallelism, the alltoall
dispatcher's token order (``_experts``). Experts are MLPs of ``tp_invariant.mlp`` and
``tp_invariant.tensor_parallel``; a token's top-k outputs are added by upstream's unpermute in
expert order on one rank; shared experts are ordinary MLPs. Aux- and z-loss gradients are per token
(token counts are integers); their logged values are not made invariant."""

from __future__ import annotations

from megapatch.core.registry import Target
from megapatch.patches.tp_invariant._experts import alltoall_combine_preprocess, alltoall_dispatch_postprocess, DISPATCHER
from megapatch.patches.tp_invariant._mode import tp_invariant_patch
from megapatch.patches.tp_invariant._refusal_tables import moe_coverage
from megapatch.patches.tp_invariant._router import MOE_UTILS, per_token_blocks, ROUTER, router_gating, router_routing


MOE_LAYER = "megatron.core.transformer.moe.moe_layer"  # imports the router, the dispatchers and moe_utils
PATCHES = (
    tp_invariant_patch(
        name="tp_invariant.moe",
        summary="MoE under tp_invariant: router gating GEMM and top-k per token block (the gate's weight gradient "
                "through the token tree); with expert parallelism (alltoall) each source DP rank's tokens one "
                "block in the experts' GEMMs (experts: tp_invariant.tensor_parallel, tp_invariant.mlp)",
        hook=MOE_LAYER,
        backend=moe_coverage,
        targets=(
            Target(ROUTER, "Router.gating", router_gating, kind="method", params=("self", "input")),
            Target(ROUTER, "TopKRouter.routing", router_routing, kind="method", params=("self", "logits")),
            Target(MOE_UTILS, "topk_routing_with_score_function", per_token_blocks, params=("logits", "topk")),
            Target(MOE_UTILS, "compute_routing_scores_for_aux_loss", per_token_blocks, params=("logits", "topk")),
            Target(DISPATCHER, "MoEAlltoAllTokenDispatcher.dispatch_postprocess", alltoall_dispatch_postprocess,
                   kind="method", params=("self", "global_input_tokens", "global_probs")),
            Target(DISPATCHER, "MoEAlltoAllTokenDispatcher.combine_preprocess", alltoall_combine_preprocess,
                   kind="method", params=("self", "hidden_states")),
        ),
    ),
)
