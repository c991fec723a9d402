"""Tiny random models other than the demo's Llama, for end-to-end checks on
other attention layouts: grouped-query attention, a hybrid of
sliding-window and full-attention layers (two KV-cache groups in vLLM), and
DeepSeek-V2's multi-head latent attention.

``python tests/helpers/model_variants.py NAME DIR`` builds one. Each is
written with the demo's tiny model's tokenizer (same vocabulary,
:func:`kvtier.demo.tiny_model.write_tokenizer`), in the layout ``kvtier demo
--model-dir`` accepts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.demo.tiny_model import VOCAB_SIZE, write_tokenizer

SLIDING_WINDOW = 64
"""Tokens of the test's hybrid model's sliding window: two 32-token blocks."""

_COMMON: dict[str, Any] = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=256,
                               max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                               tie_word_embeddings=False)
_GQA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64)
_GEMMA2 = dict(num_hidden_layers=4, **_GQA, pad_token_id=0, tie_word_embeddings=True)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # the models of the README's demo section ("How the outputs are checked")
    "llama-gqa": ("Llama", dict(num_hidden_layers=3, **_GQA)),
    "qwen2": ("Qwen2", dict(num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=2)),
    "qwen3": ("Qwen3", dict(num_hidden_layers=2, **_GQA)),
    "mistral-swa": ("Mistral", dict(num_hidden_layers=2, **_GQA, sliding_window=256)),
    # Gemma 2 alternates sliding-window and full-attention layers
    "gemma2-hybrid": ("Gemma2", dict(_GEMMA2, sliding_window=256)),
    # the same with a window the tests' short prompts pass
    "gemma2-hybrid-short": ("Gemma2", dict(_GEMMA2, sliding_window=SLIDING_WINDOW)),
    # multi-head latent attention: one 576-wide latent per token and layer (512 + 64 RoPE,
    # the only width vLLM's CPU kernel takes), no separate K and V; two dense layers
    "deepseek-v2-mla": ("DeepseekV2", dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=128, rope_scaling=None)),
}


def build_variant(path: Path, name: str, seed: int = 0) -> Path:
    """Write variant ``name`` (a key of ``VARIANTS``) to ``path``; return ``path``."""
    import torch
    import transformers

    family, extra = VARIANTS[name]
    config = getattr(transformers, f"{family}Config")(**{**_COMMON, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).bfloat16()
    model.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)
    return path


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] not in VARIANTS:
        sys.exit(f"usage: python tests/helpers/model_variants.py {{{','.join(VARIANTS)}}} DIR")
    print(build_variant(Path(sys.argv[2]), sys.argv[1]))
