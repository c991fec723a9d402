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
  state dtypes, and the engine's block hashing (``prefix_caching_hash_algo``);
* for a multimodal model, what changes the encoder's output after vLLM hashed
  the raw image or video (an item's blocks are keyed by that hash and the
  request's own processor kwargs only): the engine's ``mm_processor_kwargs``,
  video pruning, the encoder's attention dtype (``MM_FIELDS``), and the
  processor's config files in the model directory (``PROCESSOR_FILES``:
  normalization, resolution);
* a drafter's (EAGLE, draft model): its layers' KV is in the same blocks, so
  its method, KV dtype, config and weights enter as the model's do;
* with ``trust_remote_code``, the model directory's Python files (the model's
  own code may compute its layers, e.g. with ``model_impl=transformers``).

The weights come from the model's local directory (a hub id is resolved in the
local cache: by the time the offloading connector starts, the workers have
loaded the weights). Weights that are not local files (object storage, the
``dummy`` load format) cannot be fingerprinted: the engine then refuses to
start with a shared tier unless ``model_identity`` names them.
"""

from __future__ import annotations

import hashlib
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

MM_FIELDS = ("mm_processor_kwargs", "mm_encoder_attn_dtype", "video_pruning_rate")
"""``MultiModalConfig`` attributes that change the KV of an image's or a video's
tokens but not the item's hash vLLM keys them by (that hash mixes in the
request's processor kwargs only, ``vllm.multimodal.processing.inputs``). With
``video_pruning_rate`` its ``video_pruning_method`` enters, with an fp8
encoder its scale file's content."""

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")
"""Files of the model directory vLLM's multimodal processor is loaded from
(``cached_processor_from_config``): image normalization, patch size, resolution."""


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


def _model_part(model: Any) -> dict[str, Any]:
    """The fields of one ``ModelConfig`` (the engine's, a drafter's) that decide its KV."""
    hf = _plain(model.hf_config.to_dict())
    for name in HF_CONFIG_DROPPED:
        hf.pop(name, None)
    out: dict[str, Any] = {"hf_config": hf}
    for name in MODEL_FIELDS:
        if hasattr(model, name):
            out["model." + name] = _plain(getattr(model, name))
    mm = getattr(model, "multimodal_config", None)
    if mm is not None:
        for name in MM_FIELDS:
            out["mm." + name] = _plain(getattr(mm, name, None))
        if getattr(mm, "video_pruning_rate", None):
            out["mm.video_pruning_method"] = _plain(getattr(mm, "video_pruning_method", None))
        scales = getattr(mm, "mm_encoder_fp8_scale_path", None)
        if scales:
            try:
                out["mm.encoder_fp8_scales"] = _file_digest(Path(scales))
            except OSError:  # vLLM cannot start either
                out["mm.encoder_fp8_scales"] = "unreadable:" + str(scales)
    return out


def _file_digest(path: Path) -> str:
    """Hex digest of a small file's bytes (a config file); ``OSError`` if unreadable."""
    return hashlib.blake2b(path.read_bytes(), digest_size=32).hexdigest()


def effective_config(vllm_config: Any) -> dict[str, Any]:
    """The config fields that decide a block's KV bytes and keys (module doc),
    but for files: the weights' and processor files' digests (``model_identity``)."""
    out = _model_part(vllm_config.model_config)
    for name in CACHE_FIELDS:
        if hasattr(vllm_config.cache_config, name):
            out["cache." + name] = _plain(getattr(vllm_config.cache_config, name))
    out["load.load_format"] = _plain(getattr(vllm_config.load_config, "load_format", None))
    spec, draft = _drafter(vllm_config)
    if draft is not None:
        out["draft"] = {"method": _plain(getattr(spec, "method", None)),
                        "kv_cache_dtype": _plain(getattr(spec, "kv_cache_dtype", None)),
                        "quantization": _plain(getattr(spec, "quantization", None)),
                        **_model_part(draft)}
    return out


def _drafter(vllm_config: Any) -> tuple[Any, Any]:
    """The speculative config and the drafter's ``ModelConfig`` when the drafter
    has KV cache layers (EAGLE, MTP, a draft model), else ``(spec, None)``:
    n-gram, suffix and custom proposers keep none (vLLM sets their
    ``draft_model_config`` to the target's all the same)."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    uses_kv = getattr(spec, "uses_draft_kv_cache", None)
    if draft is None or (callable(uses_kv) and not uses_kv()):
        return spec, None
    return spec, draft


def local_model_dir(vllm_config: Any) -> Path:
    """The directory holding the engine's weights: the model path, or the hub
    id's snapshot in the local cache. ``IdentityError`` when there is none."""
    return _model_dir(vllm_config.model_config, vllm_config.load_config)


def _model_dir(model: Any, load_config: Any) -> Path:
    if getattr(model, "model_weights", ""):
        raise IdentityError(f"the weights are streamed from {model.model_weights!r}, "
                            "not read from local files")
    path = Path(model.model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        cache_dir = getattr(load_config, "download_dir", None)
        found = snapshot_download(model.model, revision=model.revision, cache_dir=cache_dir,
                                  local_files_only=True)
    except Exception as exc:  # hub errors have many types; all mean "not local"
        raise IdentityError(f"{model.model!r} is neither a directory nor in the local "
                            f"Hugging Face cache ({type(exc).__name__})") from None
    return Path(found)


def model_identity(vllm_config: Any, vouched: str | None = None) -> ModelIdentity:
    """The engine's ``ModelIdentity``: its weights' digest (or ``vouched``, the
    ``model_identity`` setting) and its effective config's digest, with the
    digests of a multimodal model's processor files and of a drafter's weights
    (``vouched`` stands for those too: none of the model's files is read then).

    Raises ``IdentityError`` naming the fix when the weights cannot be read.
    """
    config = effective_config(vllm_config)
    if vouched is not None:
        return ModelIdentity(weights="vouched:" + vouched, config=config_digest(config))
    model = vllm_config.model_config
    try:
        model_dir = _checked_dir(model, vllm_config.load_config)
        digest = weights_digest(model_dir)
        if getattr(model, "multimodal_config", None) is not None:
            config["processor_files"] = {name: _file_digest(model_dir / name)
                                         for name in PROCESSOR_FILES
                                         if (model_dir / name).is_file()}
        if getattr(model, "trust_remote_code", False):
            config["remote_code"] = {p.name: _file_digest(p)
                                     for p in sorted(model_dir.glob("*.py")) if p.is_file()}
        spec, draft = _drafter(vllm_config)
        if draft is not None and (draft.model, getattr(draft, "revision", None)) != (
                model.model, getattr(model, "revision", None)):  # MTP: the model's own files
            load = getattr(spec, "draft_load_config", None) or vllm_config.load_config
            config["draft"]["weights"] = weights_digest(_checked_dir(draft, load)).digest
    except (IdentityError, OSError) as exc:
        raise IdentityError(
            f"kvtier cannot fingerprint the weights of {vllm_config.model_config.model!r} for "
            f"its disk/Redis tiers: {exc}. Set 'model_identity' in kv_connector_extra_config "
            "to a string that changes whenever the weights do (e.g. the checkpoint's digest)"
        ) from None
    logger.info("kvtier: model weights fingerprinted (%d files, %.1f GB, %d of them read "
                "in full, the others' digests known) in %.3f s",
                digest.files, digest.bytes / 1e9, digest.read, digest.seconds)
    return ModelIdentity(weights=digest.digest, config=config_digest(config))


def _checked_dir(model: Any, load_config: Any) -> Path:
    """``_model_dir``, refusing load formats that do not read the files."""
    load_format = str(getattr(load_config, "load_format", ""))
    if load_format in NOT_FROM_FILES:
        raise IdentityError(f"load_format={load_format!r} does not read the weights files")
    return _model_dir(model, load_config)


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
