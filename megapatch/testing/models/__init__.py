"""Reference models and their inputs: the deterministic tiny GPT (an MoE reference model goes here too)."""
