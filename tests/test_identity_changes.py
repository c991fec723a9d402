"""Model identity: changes that alter the KV an engine computes (or what
kvtier believes the weights are) without changing the identity.

Each test failed on the code before its fix; the comments say how.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvtier import file_digests
from kvtier.file_digests import CACHE_NAME, FileDigests
from kvtier.identity import weights_digest


def checkpoint(path: Path, seed: int = 0) -> Path:
    """A model directory with one small weights file (not a real safetensors
    file: the identity hashes bytes, it does not parse them)."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    (path / "model.safetensors").write_bytes(rng.integers(0, 255, 4096, dtype=np.uint8).tobytes())
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path


def model_config(path: Path, **fields: Any) -> SimpleNamespace:
    hf = SimpleNamespace(to_dict=lambda: {"model_type": "llama", "_name_or_path": str(path)})
    return SimpleNamespace(model=str(path), model_weights="", revision=None, hf_config=hf,
                           dtype="bfloat16", **fields)


def engine(path: Path, **parts: Any) -> SimpleNamespace:
    """The parts of a vLLM ``VllmConfig`` the identity reads."""
    model_fields = {k: parts.pop(k) for k in list(parts)
                    if k in ("multimodal_config", "trust_remote_code")}
    return SimpleNamespace(
        model_config=model_config(path, **model_fields),
        cache_config=SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        load_config=SimpleNamespace(load_format="auto", download_dir=None),
        **parts)


# --- the remembered digests (kvtier/file_digests.py) -------------------------

@pytest.mark.parametrize("bad", ["not hex", "ab", "", "00" * 15, "zz" * 16])
def test_a_cache_entry_that_is_not_a_digest_is_ignored(
        tmp_path: Path, bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache file is read as {stat key: hex digest}; the old loader kept any
    string value. A non-hex one made every later start fail with a ValueError
    from bytes.fromhex (the module doc promises a cache that cannot be read is
    ignored); a hex one of the wrong length (a truncated write by another tool,
    an edit) was used as the file's digest, so the identity was not the one
    the weights have. Only 32 hex characters (an XXH3-128) are kept."""
    monkeypatch.setattr(file_digests, "RACY_S", 0.0)  # remember the fresh file's digest
    model = checkpoint(tmp_path / "m")
    cache = tmp_path / "cache"
    first = weights_digest(model, FileDigests(cache))
    entries = json.loads((cache / CACHE_NAME).read_text())
    assert len(entries) == 1
    (cache / CACHE_NAME).write_text(json.dumps({key: bad for key in entries}))
    again = weights_digest(model, FileDigests(cache))
    assert again.digest == first.digest and again.read == 1


# --- Hugging Face cache blobs (kvtier/identity.py) ---------------------------

def test_weights_rewritten_through_a_hub_snapshot_link_change_the_identity(
        tmp_path: Path) -> None:
    """A Hugging Face cache snapshot links model.safetensors to
    blobs/<sha256>. Saving new weights to the snapshot path with a tool that
    opens the existing file for writing (safetensors' save_file, a
    ``save_pretrained`` into the snapshot directory, an in-place patch of one
    tensor) writes through the link: the blob's bytes change, its name, the
    "checkpoint's own hash", does not. The identity used the name and read
    nothing, so the engine served the old weights' blocks.

    NOT FIXED (fails): the fix is to hash a linked blob's bytes like any other
    file's (remembered by kvtier.file_digests, so once per blob), at the cost
    of one read of a hub checkpoint at its first start."""
    blobs = tmp_path / "hub" / "blobs"
    snapshot = tmp_path / "hub" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    blob = blobs / ("a" * 64)
    blob.write_bytes(b"\1" * 4096)
    (snapshot / "model.safetensors").symlink_to(blob)
    before = weights_digest(snapshot, FileDigests(None)).digest
    with open(snapshot / "model.safetensors", "wb") as f:  # follows the link
        f.write(b"\2" * 4096)
    assert (snapshot / "model.safetensors").is_symlink()
    assert weights_digest(snapshot, FileDigests(None)).digest != before


# --- what enters the effective config (kvtier/vllm/identity.py) --------------

def mm_config(**fields: Any) -> SimpleNamespace:
    """vLLM's MultiModalConfig fields the identity may read."""
    base: dict[str, Any] = {
        "mm_processor_kwargs": None, "mm_encoder_attn_dtype": None,
        "mm_encoder_fp8_scale_path": None, "video_pruning_rate": None,
        "video_pruning_method": "evs", "mm_device_do_normalize": True,
        "mm_processor_cache_gb": 4, "limit_per_prompt": {}, "mm_hasher_algorithm": "blake3",
    }
    base.update(fields)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("field", [
    {"mm_processor_kwargs": {"max_pixels": 200_704}},
    {"video_pruning_rate": 0.5},
    {"mm_encoder_attn_dtype": "fp8"},
])
def test_engine_level_multimodal_settings_change_the_identity(
        tmp_path: Path, field: dict[str, Any]) -> None:
    """vLLM keys an image's blocks by the image's hash, which mixes in the
    *request's* mm_processor_kwargs only (vllm/multimodal/processing/inputs.py,
    get_mm_hashes): the engine's --mm-processor-kwargs (image resolution, crop
    count), --video-pruning-rate and an fp8 ViT change the encoder's output,
    hence the KV of the image's placeholder tokens, under the same keys. The
    old identity read none of MultiModalConfig, so two engines of one model,
    one at another image resolution, served each other their image blocks."""
    from kvtier.vllm.identity import model_identity

    model = checkpoint(tmp_path / "m")
    base = model_identity(engine(model, multimodal_config=mm_config()))
    assert base == model_identity(engine(model, multimodal_config=mm_config()))
    assert base != model_identity(engine(model, multimodal_config=mm_config(**field)))


def test_multimodal_settings_that_do_not_change_kv_keep_the_identity(tmp_path: Path) -> None:
    """Caches, limits and the hasher do not change a block's KV (the hasher
    changes the keys themselves): no needless namespace split."""
    from kvtier.vllm.identity import model_identity

    model = checkpoint(tmp_path / "m")
    base = model_identity(engine(model, multimodal_config=mm_config()))
    other = mm_config(mm_processor_cache_gb=0, limit_per_prompt={"image": 2},
                      mm_hasher_algorithm="sha256")
    assert base == model_identity(engine(model, multimodal_config=other))


@pytest.mark.parametrize("name", ["preprocessor_config.json", "processor_config.json",
                                  "video_preprocessor_config.json"])
def test_the_processor_config_files_enter_the_identity(tmp_path: Path, name: str) -> None:
    """vLLM loads a multimodal model's processor from the model directory
    (vllm/transformers_utils/processor.py: cached_processor_from_config uses
    model_config.model): its preprocessor_config.json decides the image
    normalization, patch size and resolution, so the pixels the encoder sees
    and the KV of the image tokens, while the image's hash (the key) is of
    the raw image. The old identity hashed the weights and config.json only,
    so an edited image_mean at the same path served the old blocks."""
    from kvtier.vllm.identity import model_identity

    model = checkpoint(tmp_path / "m")
    (model / name).write_text(json.dumps({"image_mean": [0.5, 0.5, 0.5]}))
    base = model_identity(engine(model, multimodal_config=mm_config()))
    copy = checkpoint(tmp_path / "copy")
    (copy / name).write_text(json.dumps({"image_mean": [0.5, 0.5, 0.5]}))
    assert model_identity(engine(copy, multimodal_config=mm_config())) == base  # not the path
    (model / name).write_text(json.dumps({"image_mean": [0.48, 0.46, 0.41]}))
    assert model_identity(engine(model, multimodal_config=mm_config())) != base
    # a text-only engine does not load the processor: its files do not split it
    text = model_identity(engine(model))
    (model / name).write_text(json.dumps({"image_mean": [0.5, 0.5, 0.5]}))
    assert model_identity(engine(model)) == text


def test_remote_code_enters_the_identity_when_trusted(tmp_path: Path) -> None:
    # with trust_remote_code the model directory's Python may compute the
    # layers (model_impl=transformers): an edit changes the KV under the same keys
    from kvtier.vllm.identity import model_identity

    model = checkpoint(tmp_path / "m")
    (model / "modeling_tiny.py").write_text("SCALE = 1.0\n")
    trusted = model_identity(engine(model, trust_remote_code=True))
    untrusted = model_identity(engine(model))
    (model / "modeling_tiny.py").write_text("SCALE = 2.0\n")
    assert model_identity(engine(model, trust_remote_code=True)) != trusted
    assert model_identity(engine(model)) == untrusted  # vLLM does not run it then


def draft_spec(path: Path, method: str = "eagle", kv_cache_dtype: str | None = None) -> Any:
    return SimpleNamespace(method=method, model=str(path), kv_cache_dtype=kv_cache_dtype,
                           quantization=None, draft_model_config=model_config(path),
                           draft_load_config=None, uses_draft_kv_cache=lambda: True)


def test_the_draft_model_enters_the_identity(tmp_path: Path) -> None:
    """With EAGLE or a draft model, the drafter's attention layers have KV in
    the same engine blocks (build_offloading_config counts every layer of the
    KV cache tensors in worker_kv_bytes_per_block), so an offloaded block
    holds the drafter's KV too. The old identity ignored speculative_config:
    an engine whose drafter was retrained (same geometry) loaded the old
    drafter's KV. Greedy output stays right (the target verifies), but the
    block is not what the engine would compute, and acceptance collapses."""
    from kvtier.vllm.identity import model_identity

    model = checkpoint(tmp_path / "m")
    draft_a = checkpoint(tmp_path / "draft-a", seed=1)
    draft_b = checkpoint(tmp_path / "draft-b", seed=2)
    draft_copy = checkpoint(tmp_path / "draft-copy", seed=1)
    a = model_identity(engine(model, speculative_config=draft_spec(draft_a)))
    assert a == model_identity(engine(model, speculative_config=draft_spec(draft_copy)))
    assert a != model_identity(engine(model, speculative_config=draft_spec(draft_b)))
    assert a != model_identity(engine(model, speculative_config=draft_spec(draft_a, "eagle3")))
    assert a != model_identity(engine(model, speculative_config=draft_spec(draft_a,
                                                                          kv_cache_dtype="fp8")))
    assert a != model_identity(engine(model))


def test_ngram_speculation_does_not_split_the_namespace(tmp_path: Path) -> None:
    """n-gram and suffix speculation have no drafter layers: no KV of theirs
    (vLLM sets an n-gram engine's draft_model_config to the target's all the same)."""
    from kvtier.vllm.identity import model_identity

    model = checkpoint(tmp_path / "m")
    ngram = SimpleNamespace(method="ngram", model=None, draft_model_config=model_config(model),
                            kv_cache_dtype=None, quantization=None, draft_load_config=None,
                            uses_draft_kv_cache=lambda: False)
    assert model_identity(engine(model, speculative_config=ngram)) == model_identity(engine(model))
