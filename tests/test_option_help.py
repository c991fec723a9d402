"""Every command-line option a user can meet has a help text: those of
``kvtier``'s commands and those of the scripts under ``benchmarks/``, whose
commands the README and docs/ quote. Read from the source (each
``add_argument`` call), so a script that needs vLLM or a trace to start is
checked too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent


def options_without_help(source: str) -> list[str]:
    """The first name of each ``add_argument`` call in ``source`` that has no
    ``help=`` (an ``action="version"`` option prints the version: argparse
    gives it its own help)."""
    missing = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        action = keywords.get("action")
        if "help" in keywords or (isinstance(action, ast.Constant) and action.value == "version"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant)]
        missing.append(f"line {node.lineno}: {names[0] if names else '?'}")
    return missing


SCRIPTS = sorted([*(REPO / "kvtier").rglob("*.py"), *(REPO / "benchmarks").glob("*.py")])


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_option_has_a_help_text(path: Path) -> None:
    assert options_without_help(path.read_text()) == [], path


def test_an_option_without_help_is_found() -> None:
    source = ("import argparse\np = argparse.ArgumentParser()\n"
              "p.add_argument('--rate', type=float, help='keys sampled')\n"
              "p.add_argument('--seeds', type=int)\n"
              "p.add_argument('--version', action='version', version='1')\n")
    assert options_without_help(source) == ["line 4: --seeds"]
