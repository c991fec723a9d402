"""kvtier as a vLLM offloading plug-in.

Enable it with ``"spec_name": "KVTierSpec", "spec_module_path": "kvtier.vllm"``
in ``kv_connector_extra_config`` (see the README). Importing this package
imports vLLM.
"""

from kvtier.vllm.settings import ConfigError, KVTierSettings
from kvtier.vllm.spec import KVTierSpec

__all__ = ["ConfigError", "KVTierSettings", "KVTierSpec"]
