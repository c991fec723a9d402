"""The chat workload of ``kvtier demo``: conversations over a shared system prompt."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.demo.tiny_model import MAX_POSITIONS, token_prompt


class DemoError(Exception):
    """Options the demo cannot run with; printed as ``kvtier: error: ...``."""


@dataclass(frozen=True)
class Workload:
    """Shape of the chat workload; every token id is deterministic."""

    conversations: int = 4
    turns: int = 4
    system_tokens: int = 512
    user_tokens: int = 128
    reply_tokens: int = 32
    repeats: int = 5
    """Passes over the workload (the first generates the replies, the others
    replay its prompts with one output token); TTFT is their best and median."""

    def system_prompt(self) -> list[int]:
        """The system prompt all conversations start with."""
        return token_prompt(self.system_tokens, start=11)

    def user_message(self, conversation: int, turn: int) -> list[int]:
        """User message ``turn`` of ``conversation`` (distinct for each pair)."""
        return token_prompt(self.user_tokens, start=1000 + 131 * conversation + 17 * turn)

    def check(self) -> None:
        """Raise ``DemoError`` when the longest sequence does not fit the tiny model."""
        longest = self.max_prompt_tokens() + self.reply_tokens
        if longest > MAX_POSITIONS:
            raise DemoError(
                f"the last turn needs {longest} tokens but the tiny model takes at most "
                f"{MAX_POSITIONS}: use fewer turns or shorter messages"
            )

    def max_prompt_tokens(self) -> int:
        """Prompt length of the last turn."""
        per_turn = self.user_tokens + self.reply_tokens
        return self.system_tokens + self.turns * per_turn - self.reply_tokens
