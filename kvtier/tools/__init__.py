"""Operator tools for the shared tiers (DESIGN.md §9): ``kvtier disk ...``, ``kvtier redis ...``.

* :mod:`kvtier.tools.disk_layout`: walking a disk tier directory (which entries
  are kvtier's blocks, temp files and manifests, and which are not);
* :mod:`kvtier.tools.disk_admin`: inspect, verify (and repair), purge;
* :mod:`kvtier.tools.redis_admin`: inspect a Redis/Valkey tier with ``SCAN``;
* :mod:`kvtier.tools.formatting`: sizes, ages and aligned tables for people;
* :mod:`kvtier.tools.commands`: the argparse subcommands ``kvtier.cli`` registers.

Every walk holds one directory entry (or one SCAN page) at a time, never the
key list of a whole tier.
"""

from __future__ import annotations

from kvtier.errors import KVTierError


class AdminError(KVTierError):
    """The tool cannot do what was asked (bad path, unknown namespace, no server)."""
