"""``logits``: FP32 LM-head logits, in training, inference and Megatron RL's log-probs (Megatron-LM PR #6252)."""
