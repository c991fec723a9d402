"""Exceptions raised by kvtier."""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of kvtier's own errors."""


class MissingBlocksError(KVTierError, KeyError):
    """``prepare_load`` was asked for blocks that are not resident and ready.

    The message says which request and KV group, how many keys are missing,
    when the missing ones were last evicted and what the history covers.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class ProtocolError(KVTierError, ValueError):
    """A call that breaks the manager's protocol (complete without prepare...)."""


PROG = "kvtier"
"""The command line's name, as its messages start (``kvtier: error: ...``)."""


class CommandError(KVTierError):
    """Bad command-line input found after argument parsing; printed as
    ``kvtier: error: ...`` with exit status 2."""
