"""A tiny randomly initialised Llama model built locally (no downloads).

Used by ``kvtier demo`` and by the tests that start a real vLLM engine on CPU.
Needs torch, transformers and tokenizers (vLLM's dependencies), imported on use.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from kvtier.atomic_files import make_private_dirs

VOCAB_SIZE = 512
NUM_SPECIAL = 3  # <unk>, <s>, </s>
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 4
HEAD_DIM = 32
DTYPE_BYTES = 2  # bfloat16
MAX_POSITIONS = 4096
"""The tiny model's ``max_position_embeddings``."""
MODEL_SUBDIR = ("kvtier", "tiny-llama")
"""The model's directory under the user's cache directory (``default_model_dir``)."""
DEFAULT_MODEL_DIR_TEXT = "~/.cache/" + "/".join(MODEL_SUBDIR)
"""``default_model_dir()`` as help texts give it (``$XDG_CACHE_HOME`` unset)."""
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
"""Files a complete model dir has."""


def _word_vocab() -> dict[str, int]:
    """Word-level vocabulary: three specials plus words ``w3`` .. ``w511``."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(NUM_SPECIAL, VOCAB_SIZE):
        vocab[f"w{i}"] = i
    return vocab


def _save_tokenizer(path: Path) -> None:
    """Write a whitespace word-level fast tokenizer (``w3 w17 ...``) to ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=_word_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=4096,
    )
    fast.save_pretrained(str(path))


def default_model_dir() -> Path:
    """``$XDG_CACHE_HOME/kvtier/tiny-llama`` (``~/.cache``), or if that cannot be
    made ``tiny-llama`` in this user's private temp directory (``private_temp_dir``)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = base.joinpath(*MODEL_SUBDIR)
    try:
        make_private_dirs(target.parent)
    except OSError:
        return private_temp_dir() / "tiny-llama"
    return target


def private_temp_dir() -> Path:
    """``kvtier-UID`` in the temp directory, made 0700; ``PermissionError`` when
    it is not this user's private directory. The temp directory is every
    user's: a model found at a name anyone could take first (the old
    ``/tmp/kvtier-tiny-llama``) could be another user's, with outputs of its
    choosing."""
    path = Path(tempfile.gettempdir()) / f"kvtier-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise PermissionError(f"{path} is not a private directory of this user (uid "
                              f"{os.geteuid()}): remove it, or pass a model directory")
    return path


def is_built(path: str | Path) -> bool:
    """Whether ``path`` holds a complete model dir."""
    out = Path(path)
    return all((out / name).is_file() for name in _FILES)


def build_tiny_llama(path: str | Path, seed: int = 0) -> Path:
    """Save a tiny random Llama (2 layers, 4 heads, head_dim 32) and tokenizer.

    Returns ``path``. Idempotent: an existing complete model dir is reused. The
    model is written to a temp dir beside ``path`` and renamed into place, so
    an interrupted or concurrent build never leaves a half-written model.
    """
    out = Path(path)
    if is_built(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_model(tmp, seed)
        try:
            os.replace(tmp, out)  # atomic; replaces an empty dir
        except OSError:
            if not is_built(out):  # a concurrent build may have won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_model(out: Path, seed: int) -> None:
    """Write the model, tokenizer and generation config into ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).bfloat16()
    model.save_pretrained(str(out), safe_serialization=True)
    write_tokenizer(out)


def write_tokenizer(out: Path) -> None:
    """Write the tiny model's tokenizer and greedy generation config into ``out``
    (also used for other random models of the same vocabulary)."""
    _save_tokenizer(out)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False})
    )


def kv_bytes_per_block(block_tokens: int) -> int:
    """Bytes of one engine KV block of the tiny model (K and V of every layer)."""
    return 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * DTYPE_BYTES * block_tokens


def token_prompt(length: int, start: int = NUM_SPECIAL) -> list[int]:
    """A deterministic prompt of ``length`` non-special token ids."""
    span = VOCAB_SIZE - NUM_SPECIAL
    return [NUM_SPECIAL + (start + 7 * i) % span for i in range(length)]
