"""Re-export of :mod:`kvtier.demo.tiny_model` (the model now ships with the demo)."""

from kvtier.demo.tiny_model import NUM_SPECIAL, VOCAB_SIZE, build_tiny_llama, token_prompt

__all__ = ["NUM_SPECIAL", "VOCAB_SIZE", "build_tiny_llama", "token_prompt"]
