"""``linear``: megatron-core's linear autograd Functions hand on an FP32 output when asked."""
