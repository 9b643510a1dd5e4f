"""``tp_invariant``: bit-identical training and inference at every parallel layout (``tp_invariant=True``).

megatron-core's layers give the same bits at every TP size dividing ``tp_invariant_width`` (W); the
arithmetic (the fixed FP32 block tree, the exact sums) is in ``megapatch.numerics``. One module per
record (``tp_invariant.<what>`` in ``<what>.py``), helpers shared by several records beside them:

======================  ===========================================================================
record module           what it makes invariant, or refuses
======================  ===========================================================================
tensor_parallel         column/row-parallel linear layers (``_linear_layers``), vocab-parallel
                        cross entropy (``_cross_entropy``)
mlp                     the MLP: refusals, a gated fc1's (SwiGLU) gate/up halves, expert scaling
moe                     the router (``_router``), the alltoall dispatcher's token sources (``_experts``)
moe_micro_batch         an MoE layer one sequence at a time (any micro-batch size)
construction            refusals when a block is built (``_refusal_tables``); norms (``_norms``)
distributed_optimizer   refusals when the distributed optimizer is built
grad_norm               the clipping norm (fixed tree along partition dims, exact stage sum)
data_parallel           the exact data-parallel gradient sum (integer bins)
loss_scale              the loss scale applied once; the loss report in FP64
micro_batch             the word embedding's weight gradient per sequence (any micro-batch size)
attention               core attention (training): one arithmetic for training and decode
packed_rope             RoPE of packed (THD) sequences: each sequence rotated from position 0
packed_bins             a packed bin's weight gradients cut at its sequences (terms of the exact sum)
engine_attention        the dynamic inference engine's attention, same arithmetic
rl_logprobs             Megatron RL's trainer log-probs in the rollout engine's arithmetic
rl_refit                Megatron RL's refit: experts matched by global index at EP > 1
transformer_engine      TE's linears, fused norms, norms and attention as the mode's arithmetic
te_grouped_experts      TE's grouped-GEMM experts, one local expert at a time
======================  ===========================================================================

Shared helpers: ``_mode`` (the record factory, refusals, verified releases), ``_marks`` (attributes
set on upstream modules and parameters), ``_parallel_state`` (the layout layers are built with).

Exact already, untouched: the vocab-parallel embedding's all-reduce (one non-zero per token),
all-gathers, the norms' per-token work and replicated parameters' gradients (same full tensors on
every rank), the MLP activation, the loss average, Adam (elementwise).

What the mode covers and refuses, layer by layer and flag by flag: docs/tp_invariant.md.
"""
