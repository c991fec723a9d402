"""The README's configuration examples are accepted as written (users copy them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvtier.vllm.settings import KVTierSettings

README = Path(__file__).parent.parent / "README.md"


def test_every_kv_transfer_config_example_is_valid() -> None:
    text = README.read_text()
    examples = re.findall(r"--kv-transfer-config '(\{.*?\})'", text, re.S)
    assert len(examples) >= 2
    for raw in examples:
        config = json.loads(raw)
        assert config["kv_connector"] == "OffloadingConnector"
        extra = config["kv_connector_extra_config"]
        assert (extra["spec_name"], extra["spec_module_path"]) == ("KVTierSpec", "kvtier.vllm")
        KVTierSettings.from_extra_config(extra)


def test_every_config_key_is_in_the_readme_table() -> None:
    text = README.read_text()
    for key in KVTierSettings.accepted_keys():
        assert f"| `{key}` |" in text, key
