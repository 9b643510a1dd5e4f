"""``tp_reduce``: tensor-parallel sums in FP32 (``tp_reduce_dtype``; Transformer Engine issue #1761)."""
