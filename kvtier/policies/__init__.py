"""Eviction policies, selectable by name or ``module.path:ClassName``."""

from __future__ import annotations

import importlib
import inspect

from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.plfu import PLFUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    ARCPolicy.name: ARCPolicy,
    PLFUPolicy.name: PLFUPolicy,
    AdaptivePolicy.name: AdaptivePolicy,
}
"""Built-in policies by name."""

DEFAULT_POLICY = AdaptivePolicy.name
"""The policy the name ``"default"`` selects (docs/policy.md says why)."""


def policy_class(name: str) -> type[EvictionPolicy]:
    """Resolve a built-in name or ``module.path:ClassName`` to a policy class."""
    if not isinstance(name, str):
        raise TypeError(f"policy must be a str name, not {type(name).__name__}")
    if name == "default":
        name = DEFAULT_POLICY
    if name in POLICIES:
        return POLICIES[name]
    if ":" not in name:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(
            f"unknown eviction policy {name!r}; known policies: {known} "
            f"('default' is {DEFAULT_POLICY}), or a custom one as 'module.path:ClassName'"
        )
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import policy module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
        raise ValueError(
            f"{name!r} does not name a subclass of kvtier.policies.EvictionPolicy"
        )
    if inspect.isabstract(cls):  # refused here, at start-up, not at the first cache
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise ValueError(f"{name!r} is abstract: it does not implement {missing}")
    _check_keep_ahead(name, cls)
    return cls


def _check_keep_ahead(name: str, cls: type[EvictionPolicy]) -> None:
    """Refuse, at start-up, a running-order policy whose ``keep_ahead`` takes
    the arguments of the contract before runs (``keys`` alone)."""
    if not cls.wants_running_order:
        return
    try:
        inspect.signature(cls.keep_ahead).bind(None, None, (), 0, frozenset())
    except TypeError:
        raise ValueError(
            f"{name!r} wants_running_order, but its keep_ahead does not take "
            "(run, keys, start, new): see EvictionPolicy.keep_ahead (its single "
            "keys argument was replaced, so that an offer costs O(its new keys))"
        ) from None


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy ``name`` for a cache of ``capacity`` blocks."""
    return policy_class(name)(capacity)


__all__ = [
    "DEFAULT_POLICY", "POLICIES", "ARCPolicy", "AdaptivePolicy", "EvictionPolicy", "LRUPolicy",
    "PLFUPolicy",
    "make_policy", "policy_class",
]
