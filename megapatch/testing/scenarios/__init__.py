"""Scenario runners: one experiment end to end (a TP change on resume, a tiny Hugging Face Llama/Qwen2
through Megatron-LM's converter and a forward of its checkpoint, Megatron-Bridge's AutoBridge and its
training entry)."""
