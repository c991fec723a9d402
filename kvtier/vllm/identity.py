"""The model identity of a vLLM engine: ``kvtier.identity`` over vLLM's config.

vLLM's ``OffloadingConfig`` names the model but holds neither its weights nor
its effective config, so the spec reads them from the engine's ``VllmConfig``
(``find_vllm_config``). What enters the config digest (``effective_config``):

* the model's Hugging Face config after ``hf_overrides`` (RoPE type, theta and
  scaling, sliding window, quantization config, head geometry...), with the
  fields that only say where or by which library version it was saved dropped;
* the overrides themselves, dtype, quantization, ``disable_sliding_window``,
  the architecture and model implementation vLLM chose, the load format, and
  ``max_model_len`` (LongRoPE's factors depend on it);
* the KV cache: its dtype, per-layer dtype exceptions, sliding window, Mamba
  state dtypes, and the engine's block hashing (``prefix_caching_hash_algo``).

The weights come from the model's local directory (a hub id is resolved in the
local cache: by the time the offloading connector starts, the workers have
loaded the weights). Weights that are not local files (object storage, the
``dummy`` load format) cannot be fingerprinted: the engine then refuses to
start with a shared tier unless ``model_identity`` names them.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from kvtier.identity import (
    IdentityError,
    ModelIdentity,
    config_digest,
    weights_digest,
)

logger = logging.getLogger(__name__)

MODEL_FIELDS = (
    "dtype", "quantization", "quantization_config", "hf_overrides", "disable_sliding_window",
    "model_impl", "runner", "convert", "model_class_overrides", "architecture",
    "max_model_len",
)
"""``ModelConfig`` attributes that change the KV a model computes
(``max_model_len``: LongRoPE models, Phi-3's 128k ones among them, choose their
RoPE factors by it, and keys are stored after RoPE)."""

CACHE_FIELDS = (
    "cache_dtype", "prefix_caching_hash_algo", "kv_cache_dtype_skip_layers", "sliding_window",
    "mamba_cache_dtype", "mamba_ssm_cache_dtype", "calculate_kv_scales",
)
"""``CacheConfig`` attributes that change the KV bytes or the block keys."""

HF_CONFIG_DROPPED = ("_name_or_path", "transformers_version", "_commit_hash")
"""Hugging Face config fields that say where or with what it was saved, not what it is."""

NOT_FROM_FILES = ("dummy",)
"""Load formats whose weights do not come from the model's files."""


def find_vllm_config() -> Any | None:
    """The ``VllmConfig`` of the engine constructing the caller, or None.

    vLLM passes it to the offloading connector, which builds the spec; the
    scheduler process does not set vLLM's "current config", so the caller's
    frames are searched for the connector's ``vllm_config`` first.
    """
    from vllm.config import VllmConfig, get_current_vllm_config_or_none

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("vllm_config")
        if isinstance(candidate, VllmConfig):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return get_current_vllm_config_or_none()


def _plain(value: Any) -> Any:
    """``value`` as JSON-ready data; a callable by its qualified name (its
    address would differ per process)."""
    if callable(value) and not isinstance(value, type):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _plain(to_dict())
    return str(value)


def effective_config(vllm_config: Any) -> dict[str, Any]:
    """The config fields that decide a block's KV bytes and keys (module doc)."""
    model = vllm_config.model_config
    hf = _plain(model.hf_config.to_dict())
    for name in HF_CONFIG_DROPPED:
        hf.pop(name, None)
    out: dict[str, Any] = {"hf_config": hf}
    for prefix, obj, names in (("model.", model, MODEL_FIELDS),
                               ("cache.", vllm_config.cache_config, CACHE_FIELDS)):
        for name in names:
            if hasattr(obj, name):
                out[prefix + name] = _plain(getattr(obj, name))
    out["load.load_format"] = _plain(getattr(vllm_config.load_config, "load_format", None))
    return out


def local_model_dir(vllm_config: Any) -> Path:
    """The directory holding the engine's weights: the model path, or the hub
    id's snapshot in the local cache. ``IdentityError`` when there is none."""
    model = vllm_config.model_config
    if getattr(model, "model_weights", ""):
        raise IdentityError(f"the weights are streamed from {model.model_weights!r}, "
                            "not read from local files")
    path = Path(model.model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        cache_dir = getattr(vllm_config.load_config, "download_dir", None)
        found = snapshot_download(model.model, revision=model.revision, cache_dir=cache_dir,
                                  local_files_only=True)
    except Exception as exc:  # hub errors have many types; all mean "not local"
        raise IdentityError(f"{model.model!r} is neither a directory nor in the local "
                            f"Hugging Face cache ({type(exc).__name__})") from None
    return Path(found)


def model_identity(vllm_config: Any, vouched: str | None = None) -> ModelIdentity:
    """The engine's ``ModelIdentity``: its weights' digest (or ``vouched``, the
    ``model_identity`` setting) and its effective config's digest.

    Raises ``IdentityError`` naming the fix when the weights cannot be read.
    """
    config = config_digest(effective_config(vllm_config))
    if vouched is not None:
        return ModelIdentity(weights="vouched:" + vouched, config=config)
    load_format = str(getattr(vllm_config.load_config, "load_format", ""))
    try:
        if load_format in NOT_FROM_FILES:
            raise IdentityError(f"load_format={load_format!r} does not read the weights files")
        digest = weights_digest(local_model_dir(vllm_config))
    except (IdentityError, OSError) as exc:
        raise IdentityError(
            f"kvtier cannot fingerprint the weights of {vllm_config.model_config.model!r} for "
            f"its disk/Redis tiers: {exc}. Set 'model_identity' in kv_connector_extra_config "
            "to a string that changes whenever the weights do (e.g. the checkpoint's digest)"
        ) from None
    logger.info("kvtier: model weights fingerprinted (%d files, %.1f GB, %d of them read "
                "in full, the others' digests known) in %.3f s",
                digest.files, digest.bytes / 1e9, digest.read, digest.seconds)
    return ModelIdentity(weights=digest.digest, config=config)


def lora_reason(vllm_config: Any) -> str | None:
    """Why a disk/Redis tier may serve an adapter's request stale KV, with the
    fix; None when the engine serves no LoRA adapters (or the config is unknown).

    vLLM keys a block of an adapter's request by the adapter's name and path,
    not its weights, and the offloading interface does not say which adapter a
    request uses, so kvtier cannot fingerprint adapters as it does the model.
    """
    lora = getattr(vllm_config, "lora_config", None)
    if lora is None:
        return None
    return (
        f"LoRA is enabled (max_loras={getattr(lora, 'max_loras', '?')}): vLLM keys an "
        "adapter's blocks by the adapter's name and path, not its weights, so the "
        "disk/Redis tier serves an adapter retrained in place the KV of its old weights. "
        "Give a retrained adapter a new name or path"
    )
