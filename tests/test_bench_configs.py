"""`kvtier bench serve --configs`: which server configurations it accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.serving import BenchSettings, check_config, server_argv
from kvtier.cli import build_parser


@pytest.mark.parametrize("config", ["none", "vllm-lru", "lru", "default", "adaptive",
                                    "default+disk", "adaptive+disk", "arc"])
def test_known_configurations_are_accepted(config: str) -> None:
    assert check_config(config) == config


@pytest.mark.parametrize("config,problem", [("nope", "'nope'"), ("lru+tape", "'tape'"),
                                            ("+disk", "''"), ("vllm-lru+disk", "'vllm-lru'")])
def test_unknown_configurations_name_the_problem(config: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_config(config)


def test_a_policy_configuration_starts_kvtier_serve_with_that_policy(tmp_path: Path) -> None:
    s = BenchSettings(model=tmp_path / "model", out=tmp_path / "out")
    argv = server_argv(s, "adaptive+disk", 1 << 20, 8000, tmp_path / "disk")
    assert argv[argv.index("--policy") + 1] == "adaptive"
    assert argv[argv.index("--disk-path") + 1] == str(tmp_path / "disk")
    plain = server_argv(s, "adaptive", 1 << 20, 8000, tmp_path / "disk")
    assert "--disk-path" not in plain


def test_the_command_line_rejects_an_unknown_configuration(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "serve", "--configs", "vllm-lru,adaptive"])
    assert args.configs == ("vllm-lru", "adaptive")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--configs", "vllm-lru,bogus"])
    assert "bogus" in capsys.readouterr().err
