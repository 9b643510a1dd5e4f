"""Dense linear layers under the mode: ``ColumnParallelLinear`` runs its GEMM per block of N/W
output features, its dgrad (summed over TP upstream) through the fixed tree, wgrad and bias grad
per block; ``RowParallelLinear``'s K-split GEMM and TP all-reduce become one fixed-tree sum of W
blocks of K/W (the bias added after the sum, as upstream). With sequence parallelism the row sum is
sliced to this rank's positions (upstream's reduce-scatter) and the column input all-gathered.
A routed expert's layers (``explicit_expert_comm``) hand their sums to the token dispatcher on
expert-TP rank 0 only (``block_tree.on_root``); the routing probability scales fc2's input
(``ScaledRows``). ``ColumnParallelLinear.__init__`` refuses an output size W does not divide
(a GPT's output layer: its padded vocabulary)."""

from __future__ import annotations

import torch

from megapatch.core.call_args import argument
from megapatch.numerics import block_shapes, expert_call, fp32_output_linear
from megapatch.numerics import block_tree as tpi
from megapatch.numerics import block_linear
from megapatch.numerics import token_tree
from megapatch.patches._common import tp_group
from megapatch.patches.tp_invariant._marks import gated_fc1
from megapatch.patches.tp_invariant._mode import refuse_tp_invariant
from megapatch.patches.tp_invariant._refusal_tables import few_kv_groups, MOE_BIAS


def column_forward_impl(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    input_ = argument(args, kwargs, 0, "input")
    weight = argument(args, kwargs, 1, "weight")
    bias = argument(args, kwargs, 2, "bias", None)
    if argument(args, kwargs, 3, "gradient_accumulation_fusion", False):
        refuse_tp_invariant("gradient_accumulation_fusion", "its fused wgrad GEMM accumulates by shape")
    sequence_parallel = argument(args, kwargs, 5, "sequence_parallel", False)
    if argument(args, kwargs, 6, "grad_output_buffer", None) is not None:
        refuse_tp_invariant("defer_embedding_wgrad_compute", "the deferred wgrad runs outside this layer")
    expert = _expert_layer(instance)
    group = tp_group(instance)
    groups = getattr(getattr(instance, "config", None), "num_query_groups", None)
    if groups is not None and groups < tpi.group_size(group):
        refuse_tp_invariant(*few_kv_groups(groups, tpi.group_size(group)))
    allreduce_dgrad = argument(args, kwargs, 4, "allreduce_dgrad", False)
    if expert:  # the token dispatcher gathered the input over expert TP and sums the dgrad there
        allreduce_dgrad = True
    elif (tpi.group_size(group) > 1 and not (allreduce_dgrad or sequence_parallel)
          and torch.is_grad_enabled() and input_.requires_grad):  # no dgrad, nothing to reduce (inference)
        refuse_tp_invariant("a column-parallel layer whose dgrad is reduced outside it",
                "that reduction would sum TP partials natively")
    if sequence_parallel and tpi.group_size(group) > 1:
        # the dgrad's fixed-tree TP sum, then this rank's slice, replaces upstream's reduce-scatter
        input_ = block_linear.GatherSequence.apply(input_, group)
        allreduce_dgrad = True
    nb = tpi.blocks_per_rank(group)
    halves = 2 if gated_fc1.get() is instance else 1  # SwiGLU's fc1: [gate_r; up_r] on rank r
    tpi.check_divisible(f"{type(instance).__name__} output features" + (" (each of gate, up)" if halves == 2 else ""),
                        weight.shape[0] // halves * tpi.group_size(group), weight.shape[0] // halves, group)
    # logits_dtype="fp32" asks the LM head for its FP32 accumulator, unrounded
    out_dtype = fp32_output_linear.requested_output_dtype()
    return block_linear.ColumnParallel.apply(input_, weight, bias, group, allreduce_dgrad, nb, out_dtype, halves, expert,
                                    expert_call.sources(instance))


def _expert_layer(layer) -> bool:
    """A routed expert's linear layer whose TP communication the token dispatcher does
    (``explicit_expert_comm``: with expert TP or expert parallelism)."""
    return bool(getattr(layer, "explicit_expert_comm", False))


def column_init(wrapped, instance, args, kwargs):
    """A column-parallel layer whose outputs the width cannot split is refused when it is built:
    the layers of a transformer block are checked from its config before (``block_init``), so
    this catches the others, a GPT's output layer (the padded vocabulary) first of all."""
    result = wrapped(*args, **kwargs)
    if tpi.active():
        group = tp_group(instance)
        tpi.blocks_per_rank(group)
        outputs = argument(args, kwargs, 1, "output_size")
        vocabulary = block_shapes.megatron_lm_vocabulary()
        if vocabulary is not None and vocabulary.padded_vocab_size == outputs:
            refusal = block_shapes.vocabulary_refusal(vocabulary, tpi.group_size(group))
            if refusal:
                refuse_tp_invariant(*refusal)
        tpi.check_divisible(f"the output features of a {type(instance).__name__} being built (a GPT's output "
                            f"layer: its padded vocabulary)", outputs, outputs // tpi.group_size(group), group)
    return result


def row_forward(wrapped, instance, args, kwargs):
    if not tpi.active():
        return wrapped(*args, **kwargs)
    input_ = argument(args, kwargs, 0, "input_")
    expert = _expert_layer(instance)
    if getattr(instance, "gradient_accumulation_fusion", False):
        refuse_tp_invariant("gradient_accumulation_fusion", "its fused wgrad GEMM accumulates by shape")
    group = tp_group(instance)
    if not instance.input_is_parallel:
        from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region

        input_ = scatter_to_tensor_model_parallel_region(input_, group=group)
    weight = instance.weight
    nb = tpi.blocks_per_rank(group)
    tpi.check_divisible(f"{type(instance).__name__} input features",
                        weight.shape[1] * tpi.group_size(group), weight.shape[1], group)
    scale = expert_call.scale(instance)
    if scale is not None:  # an expert's activation times its routing probabilities
        input_ = token_tree.ScaledRows.apply(input_, scale, group, nb)
    # an expert's output is summed over expert TP by the token dispatcher: kept on its rank 0
    output = block_linear.RowParallel.apply(input_, weight, group, nb, expert, expert_call.sources(instance))
    if expert and instance.bias is not None:
        refuse_tp_invariant(*MOE_BIAS)
    split = not expert and bool(getattr(instance, "sequence_parallel", False)) and tpi.group_size(group) > 1
    if split:  # this rank's part of the sequence of the fixed-tree sum: upstream's reduce-scatter
        output = block_linear.ScatterSequence.apply(output, group)
    bias = instance.bias
    if bias is not None:  # its gradient sums over tokens: token blocks in the fixed tree
        bias = token_tree.TokenBlockedBias.apply(bias, output.shape, group, tpi.token_blocks(output, group, split), split)
    if instance.skip_bias_add:
        return output, bias
    return (output + bias if bias is not None else output), None
