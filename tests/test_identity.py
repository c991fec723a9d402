"""Model identity: the weights fingerprint (kvtier.identity) on real files."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kvtier import file_digests
from kvtier.file_digests import CACHE_NAME, FileDigests, default_cache_dir
from kvtier.identity import (
    IdentityError,
    canonical_json,
    config_digest,
    weights_digest,
)

TENSOR_BYTES = 64 << 10



@pytest.fixture(autouse=True)
def _settled_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files these tests write are seconds old at most: remember their
    digests all the same (``file_digests.RACY_S``; its own test sets it back)."""
    monkeypatch.setattr(file_digests, "RACY_S", 0.0)

def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format: 8-byte header length, JSON header, tensor data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        header[name] = {"dtype": "U8", "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for array in tensors.values():
            f.write(array.tobytes())


def checkpoint(path: Path, seed: int = 0, layers: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {f"layer.{i}.weight": rng.integers(0, 255, TENSOR_BYTES, dtype=np.uint8)
               for i in range(layers)}
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / "model.safetensors", tensors)
    (path / "config.json").write_text('{"model_type": "llama"}')
    return tensors


def test_same_weights_elsewhere_share_an_identity_and_mtime_does_not_count(
        tmp_path: Path) -> None:
    checkpoint(tmp_path / "a")
    checkpoint(tmp_path / "b")
    os.utime(tmp_path / "b" / "model.safetensors", (1, 1))
    a, b = weights_digest(tmp_path / "a"), weights_digest(tmp_path / "b")
    assert a.digest == b.digest
    assert a.files == 1 and a.bytes == (tmp_path / "a" / "model.safetensors").stat().st_size


def test_new_weights_change_the_identity(tmp_path: Path) -> None:
    checkpoint(tmp_path / "a", seed=0)
    checkpoint(tmp_path / "b", seed=1)
    assert weights_digest(tmp_path / "a").digest != weights_digest(tmp_path / "b").digest


@pytest.mark.parametrize("layer", [0, 3, 7])
def test_one_changed_tensor_changes_the_identity(tmp_path: Path, layer: int) -> None:
    """A fine-tune of one layer, wherever it lies."""
    tensors = checkpoint(tmp_path / "a")
    base = weights_digest(tmp_path / "a").digest
    tensors[f"layer.{layer}.weight"] = np.random.default_rng(9).integers(
        0, 255, TENSOR_BYTES, dtype=np.uint8)
    write_safetensors(tmp_path / "a" / "model.safetensors", tensors)
    assert weights_digest(tmp_path / "a").digest != base


def test_a_renamed_tensor_or_added_shard_changes_the_identity(tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path / "a")
    base = weights_digest(tmp_path / "a").digest
    renamed = {k.replace("layer.0", "layer.00"): v for k, v in tensors.items()}
    write_safetensors(tmp_path / "a" / "model.safetensors", renamed)
    assert weights_digest(tmp_path / "a").digest != base
    write_safetensors(tmp_path / "a" / "model.safetensors", tensors)
    assert weights_digest(tmp_path / "a").digest == base
    write_safetensors(tmp_path / "a" / "extra.safetensors", {"x": tensors["layer.1.weight"]})
    assert weights_digest(tmp_path / "a").digest != base


@pytest.mark.parametrize("suffix", ["model.safetensors", "pytorch_model.bin"])
def test_a_few_changed_rows_anywhere_change_the_identity(tmp_path: Path, suffix: str) -> None:
    """New embeddings for ten tokens, in the middle of one tensor: every byte is
    hashed (a fingerprint of samples missed this)."""
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 255, (1024, 64), dtype=np.uint8)
    (tmp_path / "m").mkdir()
    weights = tmp_path / "m" / suffix

    def save() -> None:
        if suffix.endswith(".safetensors"):
            write_safetensors(weights, {"embed.weight": rows})
        else:
            weights.write_bytes(rows.tobytes())

    save()
    base = weights_digest(tmp_path / "m").digest
    rows[300:310] = rng.integers(0, 255, (10, 64), dtype=np.uint8)
    save()
    assert weights_digest(tmp_path / "m").digest != base


def test_digests_are_remembered_until_the_file_changes(tmp_path: Path) -> None:
    tensors = checkpoint(tmp_path / "a")
    cache = tmp_path / "cache"
    first = weights_digest(tmp_path / "a", FileDigests(cache))
    assert first.read == 1 and (cache / CACHE_NAME).exists()
    again = weights_digest(tmp_path / "a", FileDigests(cache))  # a restart
    assert again.read == 0 and again.digest == first.digest
    tensors["layer.3.weight"][5] ^= 1  # same size, one bit
    write_safetensors(tmp_path / "a" / "model.safetensors", tensors)
    changed = weights_digest(tmp_path / "a", FileDigests(cache))
    assert changed.read == 1 and changed.digest != first.digest
    (cache / CACHE_NAME).write_text("{not json")  # a broken cache is ignored
    assert weights_digest(tmp_path / "a", FileDigests(cache)).digest == changed.digest


def test_a_digest_of_a_file_changed_seconds_ago_is_not_remembered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # on a file system with coarse timestamps a write later in the same tick
    # keeps the file's key: a digest taken that early would outlive its bytes
    monkeypatch.setattr(file_digests, "RACY_S", 2.0)
    checkpoint(tmp_path / "a")
    cache = tmp_path / "cache"
    assert weights_digest(tmp_path / "a", FileDigests(cache)).read == 1
    assert weights_digest(tmp_path / "a", FileDigests(cache)).read == 1  # not remembered
    later = file_digests.time.time_ns() + 3 * 10**9
    monkeypatch.setattr(file_digests.time, "time_ns", lambda: later)
    assert weights_digest(tmp_path / "a", FileDigests(cache)).read == 1
    assert weights_digest(tmp_path / "a", FileDigests(cache)).read == 0  # settled: remembered


def test_a_cache_that_cannot_be_written_costs_a_read_not_an_error(tmp_path: Path) -> None:
    checkpoint(tmp_path / "a")
    blocked = tmp_path / "file"
    blocked.write_text("")  # the cache directory would have to be below a file
    digests = FileDigests(blocked / "cache")
    assert weights_digest(tmp_path / "a", digests).read == 1
    assert weights_digest(tmp_path / "a", FileDigests(blocked / "cache")).read == 1


def test_hub_cache_blobs_are_hashed_by_content_not_by_name(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot links each file to blobs/<sha256>; the
    bytes are hashed, not the name (weights saved over the snapshot's path
    write through the link and keep the name: tests/test_identity_changes.py),
    so the same bytes under another blob name keep the identity."""
    blobs = tmp_path / "hub" / "blobs"
    blobs.mkdir(parents=True)
    snapshot = tmp_path / "hub" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    blob = blobs / ("a" * 64)
    blob.write_bytes(b"\0" * 1000)
    (snapshot / "model.safetensors").symlink_to(blob)
    first = weights_digest(snapshot).digest
    other = blobs / ("b" * 64)
    os.rename(blob, other)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(other)
    assert weights_digest(snapshot).digest == first


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(IdentityError, match="no weights file"):
        weights_digest(tmp_path)
    with pytest.raises(IdentityError, match="not a local model directory"):
        weights_digest(tmp_path / "missing")


def test_a_truncated_safetensors_header_is_hashed_like_any_bytes(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    first = weights_digest(tmp_path).digest
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"[]")
    assert weights_digest(tmp_path).digest != first


def test_config_digest_is_canonical() -> None:
    a = {"rope": {"theta": 1e4, "type": "default"}, "layers": 2, "skip": {"b", "a"}}
    b = {"skip": {"a", "b"}, "layers": 2, "rope": {"type": "default", "theta": 1e4}}
    assert config_digest(a) == config_digest(b)
    assert config_digest({**a, "rope": {"theta": 5e5, "type": "default"}}) != config_digest(a)
    assert canonical_json({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'


def test_callables_and_objects_enter_the_config_by_name_not_address() -> None:
    """vLLM allows ``hf_overrides`` to be a function: its address differs per
    process, its qualified name does not."""
    from kvtier.vllm.identity import _plain

    def override(config: object) -> object:
        return config

    first = _plain({"hf_overrides": override, "dtype": np.dtype("float16")})
    assert first == _plain({"hf_overrides": override, "dtype": np.dtype("float16")})
    assert first["hf_overrides"].endswith("override") and first["dtype"] == "float16"


def _engine_config(model: str, load_format: str = "auto", weights: str = "") -> object:
    """The parts of a vLLM ``VllmConfig`` the identity reads."""
    from types import SimpleNamespace

    hf = SimpleNamespace(to_dict=lambda: {"model_type": "llama", "_name_or_path": model})
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, model_weights=weights, revision=None,
                                     hf_config=hf, dtype="bfloat16"),
        cache_config=SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        load_config=SimpleNamespace(load_format=load_format, download_dir=None))


@pytest.mark.parametrize(("model", "load_format", "weights", "why"), [
    ("dir", "dummy", "", "does not read the weights files"),
    ("dir", "auto", "s3://bucket/m", "streamed from"),
    ("no-such-org/no-such-model", "auto", "", "neither a directory nor in the local"),
])
def test_unidentifiable_weights_are_refused_naming_model_identity(
        tmp_path: Path, model: str, load_format: str, weights: str, why: str) -> None:
    from kvtier.vllm.identity import model_identity

    checkpoint(tmp_path / "dir")
    name = str(tmp_path / "dir") if model == "dir" else model
    config = _engine_config(name, load_format, weights)
    with pytest.raises(IdentityError, match=why) as err:
        model_identity(config)
    assert "model_identity" in str(err.value)
    vouched = model_identity(config, vouched="release-7")
    assert vouched.weights == "vouched:release-7"


def test_the_path_does_not_enter_the_identity(tmp_path: Path) -> None:
    from kvtier.vllm.identity import model_identity

    checkpoint(tmp_path / "a")
    checkpoint(tmp_path / "b")
    a = model_identity(_engine_config(str(tmp_path / "a")))
    assert a == model_identity(_engine_config(str(tmp_path / "b")))
    assert a != model_identity(_engine_config(str(tmp_path / "a"), load_format="safetensors"))


def test_unshared_keys_reason_names_the_fast_hashes_without_a_seed() -> None:
    from types import SimpleNamespace

    from kvtier.vllm.block_hashing import unshared_keys_reason

    def config(algo: str) -> object:
        return SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))

    for algo in ("xxhash", "xxhash_cbor"):
        reason = unshared_keys_reason(config(algo), {})
        assert reason is not None and repr(algo) in reason and "PYTHONHASHSEED" in reason
        assert unshared_keys_reason(config(algo), {"PYTHONHASHSEED": "0"}) is None
    for algo in ("sha256", "sha256_cbor"):
        assert unshared_keys_reason(config(algo), {}) is None
    assert unshared_keys_reason(None, {}) is None  # no engine config: nothing to say


def test_an_engine_serving_lora_adapters_is_told_to_rename_retrained_ones() -> None:
    from types import SimpleNamespace

    from kvtier.vllm.identity import lora_reason

    reason = lora_reason(SimpleNamespace(lora_config=SimpleNamespace(max_loras=4)))
    assert reason is not None and "max_loras=4" in reason and "new name or path" in reason
    assert lora_reason(SimpleNamespace(lora_config=None)) is None
    assert lora_reason(None) is None


def test_no_home_directory_means_no_remembered_digests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a container user with no passwd entry and no $HOME: fingerprint anyway
    for name in ("KVTIER_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert default_cache_dir() is None
    checkpoint(tmp_path / "a")
    assert weights_digest(tmp_path / "a").read == 1


def test_a_longrope_model_at_another_max_model_len_gets_another_identity(
        tmp_path: Path) -> None:
    # vLLM picks a LongRoPE model's factors by max_model_len (above the
    # original context it uses the long ones): the stored, rotated keys differ
    import json

    import torch
    from vllm.config import (
        CacheConfig,
        LoadConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.layers import rotary_embedding

    from kvtier.identity import config_digest
    from kvtier.vllm.identity import effective_config

    head = 32
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * (head // 2),
                         "long_factor": [4.0] * (head // 2)},
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}))

    def engine(max_len: int) -> VllmConfig:
        model = ModelConfig(model=str(tmp_path), max_model_len=max_len,
                            skip_tokenizer_init=True, dtype="bfloat16")
        return VllmConfig(model_config=model, cache_config=CacheConfig(),
                          load_config=LoadConfig())

    def rotated_keys(config: VllmConfig) -> torch.Tensor:
        rotary_embedding._ROPE_DICT.clear()  # vLLM caches one rope per process
        hf = config.model_config.hf_config
        with set_current_vllm_config(config):
            rope = rotary_embedding.get_rope(
                head, max_position=hf.max_position_embeddings, is_neox_style=True,
                rope_parameters=hf.rope_parameters, dtype=torch.float32)
        ones = torch.ones(8, head)
        return rope.forward(torch.arange(8), ones.clone(), ones.clone())[1]

    short, long = engine(4096), engine(8192)
    assert not torch.allclose(rotated_keys(short), rotated_keys(long))
    assert config_digest(effective_config(short)) != config_digest(effective_config(long))
