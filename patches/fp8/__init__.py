"""``fp8``: pipeline-aligned FP8 weight transposes (NeMo PR #9481)."""
