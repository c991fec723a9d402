"""Bounded bookkeeping of lookup leases."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.argtypes import is_positive_seconds
from kvtier.request import RequestContext

DEFAULT_LEASE_TIMEOUT_S = 60.0
"""Seconds a request may hold leases without a new lookup before they lapse."""

DEFAULT_MAX_LEASES_PER_REQUEST = 16_384
"""Keys one request may hold leased (a 256k-token prompt in 16-token blocks)."""

DEFAULT_MAX_LEASE_HOLDERS = 65_536
"""Requests that may hold leases at once (far more than an engine runs); past
it, the leases of the oldest holder lapse early, as if they had timed out."""


class LeaseTable:
    """Which requests hold leases, how many, and until when.

    Owns an ``OrderedDict`` of requests holding at least one lease, ordered by
    their last lease grant (so expired holders are at the front), and the total
    count of leases. Bounds: at most ``per_request`` leases per request and
    ``total`` in all; a holder's leases lapse ``timeout_s`` seconds after its
    last grant. The per-request bound counts a request's leases; the total bound
    counts distinct leased blocks (the manager's lease counts), so requests
    sharing a prefix hold no more of the cache than one of them. The holders
    themselves (each keeps its ``RequestContext`` alive) are at most
    ``max_holders``: :meth:`expired` also names the oldest holders beyond it,
    so between two lookups the table holds at most ``max_holders + 1``.
    """

    __slots__ = ("per_request", "total", "timeout_s", "max_holders", "held", "_holders")

    def __init__(self, per_request: int, total: int, timeout_s: float,
                 max_holders: int = DEFAULT_MAX_LEASE_HOLDERS) -> None:
        for name, value in (("max_leases_per_request", per_request), ("max_leased_blocks", total),
                            ("max_lease_holders", max_holders)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name} must be an int >= 1 (with no lease budget no lookup "
                    f"could ever hit), got {value!r}"
                )
        if not is_positive_seconds(timeout_s):  # a lease that never lapses holds its slot
            raise ValueError(f"lease_timeout_s must be a finite number of seconds > 0, "
                             f"got {timeout_s!r}")
        self.per_request = per_request
        self.total = total
        self.timeout_s = float(timeout_s)
        self.max_holders = max_holders
        self.held = 0
        self._holders: OrderedDict[RequestContext, None] = OrderedDict()

    def budgets(self, ctx: RequestContext, leased_blocks: int) -> tuple[int, int]:
        """(leases ``ctx`` may still take, blocks that may still become leased)."""
        return self.per_request - len(ctx.leased), self.total - leased_blocks

    def granted(self, ctx: RequestContext, n: int, now: float) -> None:
        """Record ``n`` new leases of ``ctx`` at time ``now``."""
        self.held += n
        ctx.lease_deadline = now + self.timeout_s
        self._holders[ctx] = None
        self._holders.move_to_end(ctx)

    def dropped(self, ctx: RequestContext, n: int) -> None:
        """Record that ``ctx`` gave back ``n`` leases."""
        self.held -= n
        if not ctx.leased:
            self._holders.pop(ctx, None)

    def expired(self, now: float) -> list[RequestContext]:
        """Holders whose leases lapsed by ``now``, and the oldest holders beyond
        ``max_holders``; oldest first."""
        out: list[RequestContext] = []
        over = len(self._holders) - self.max_holders
        for ctx in self._holders:
            if ctx.lease_deadline > now and over <= 0:
                break
            out.append(ctx)
            over -= 1
        return out

    def __len__(self) -> int:
        """Requests holding leases."""
        return len(self._holders)

    def has_holders(self) -> bool:
        """Whether any request holds a lease."""
        return bool(self._holders)

    def clear(self) -> None:
        """Forget every lease (the caller forgets the blocks' side)."""
        self.held = 0
        self._holders.clear()


def leased_prefix(run: list[bytes], leased: set[bytes], counted: Container[bytes],
                  mine: int, blocks: int) -> int:
    """Length of the longest prefix of ``run`` that a request holding ``leased``
    can lease with ``mine`` new leases, of which at most ``blocks`` on keys no
    request leases yet (not in ``counted``)."""
    seen: set[bytes] = set()
    for i, key in enumerate(run):
        if key in leased or key in seen:
            continue
        fresh = key not in counted
        if mine <= 0 or (fresh and blocks <= 0):
            return i
        seen.add(key)
        mine -= 1
        blocks -= fresh
    return len(run)
