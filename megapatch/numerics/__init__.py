"""The arithmetic behind the patches: FP32 reductions, FP32-output GEMMs and linear Functions, the
fixed FP32 block tree of ``tp_invariant`` and the model shapes it can split (``block_shapes``,
which alone imports no torch). Imports torch and ``megapatch.core``, never megatron."""
