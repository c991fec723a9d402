"""Tiny random models other than the demo's Llama, for end-to-end checks on
other attention layouts: grouped-query attention, and a hybrid of
sliding-window and full-attention layers (two KV-cache groups in vLLM).

Each is written beside the tokenizer of :func:`kvtier.demo.tiny_model.build_tiny_llama`
(same vocabulary), in the layout ``kvtier demo --model-dir`` accepts.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from kvtier.demo.tiny_model import VOCAB_SIZE, build_tiny_llama

SLIDING_WINDOW = 64
"""Tokens of the hybrid model's sliding window: two 32-token blocks."""

_COMMON: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
                               max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # 2 KV heads for 4 query heads, head_dim 64, 3 layers
    "llama-gqa": ("Llama", dict(num_hidden_layers=3, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)),
    # Gemma 2 alternates sliding-window and full-attention layers
    "gemma2-hybrid": ("Gemma2", dict(num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64, pad_token_id=0,
                                     sliding_window=SLIDING_WINDOW, tie_word_embeddings=True)),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def build_variant(path: Path, name: str, seed: int = 0) -> Path:
    """Write variant ``name`` (a key of ``VARIANTS``) to ``path``; return ``path``."""
    import torch
    import transformers

    family, extra = VARIANTS[name]
    config = getattr(transformers, f"{family}Config")(**{**_COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).bfloat16()
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer = build_tiny_llama(path.parent / f"{path.name}-tokenizer-source")
    for file in _TOKENIZER_FILES:
        shutil.copy(tokenizer / file, path / file)
    return path
