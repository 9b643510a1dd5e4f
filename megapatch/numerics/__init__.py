"""The arithmetic behind the patches: FP32 reductions, FP32-output GEMMs and linear Functions, the
fixed FP32 block tree of ``tp_invariant``. Imports torch and ``megapatch.core``, never megatron."""
