"""Secrets in kvtier's settings: where they live and how they stay out of sight.

Two settings are secret: the Redis password and the tenant salt. Neither is
ever logged, put in a metric label, an exception message or a printed command.
Both can come from the environment instead of the config: the Redis tier reads
the password from ``REDIS_PASSWORD_ENV`` when the URL has none, and a setting
whose value is ``env:NAME`` is read from the variable NAME (``ENV_PREFIX``).
``kvtier serve`` moves both there before it starts vLLM, whose logs print
its whole configuration.
"""

from __future__ import annotations

from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

REDIS_URL_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
"""The schemes of a Redis tier's URL (``+cluster``: Redis Cluster)."""

REDIS_PASSWORD_ENV = "KVTIER_REDIS_PASSWORD"
"""Environment variable holding the Redis password when the URL has none."""

TENANT_SALT_ENV = "KVTIER_TENANT_SALT"
"""Where ``kvtier serve`` puts the tenant salt (the config then says ``env:KVTIER_TENANT_SALT``)."""

ENV_PREFIX = "env:"
"""A secret setting's value that names the environment variable holding it."""

SECRET_QUERY_KEYS = ("password", "pass", "passwd")
"""URL query parameters that hold the server's password."""

HIDDEN_QUERY_KEYS = (*SECRET_QUERY_KEYS, "ssl_password")
"""URL query parameters whose values are never shown: the server's password,
and the TLS client key's (redis-py reads ``ssl_password`` from the query)."""


MISPLACED_AT_HINT = (
    "it has an '@' outside its user:password part; percent-encode a password's "
    "'/', '?', '#' and '@' (%2F, %3F, %23, %40), and any '@' of a path or query (%40)"
)
"""Why a URL for which :func:`misplaced_at` holds is refused."""


def misplaced_at(url: str) -> bool:
    """Whether ``url`` has an ``@`` outside the part a URL parser reads as user
    info: typically a password holding an unencoded ``/``, ``?`` or ``#``, of
    which the parser would take a piece for the host, path or query (and show it
    in errors). kvtier refuses such URLs (``MISPLACED_AT_HINT``)."""
    _, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return False
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        return True
    return rest.count("@") > netloc.count("@")


def redact_url(url: str) -> str:
    """``url`` with any password (userinfo or query) replaced by ``***``.

    A URL with an ``@`` outside its user info (:func:`misplaced_at`) has
    everything from ``://`` to its last ``@`` replaced: better too much hidden
    than a piece of a password shown.
    """
    try:
        if misplaced_at(url):
            scheme, _, rest = url.partition("://")
            return f"{scheme}://***@{rest.rpartition('@')[2]}"
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user = parts.username or ""
            host = netloc.rpartition("@")[2]
            netloc = f"{user}:***@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode(
                [(k, "***" if k.lower() in HIDDEN_QUERY_KEYS else v) for k, v in pairs],
                safe="*/")
        return _unsplit(parts, netloc, query)
    except ValueError:
        return "<unparsable redis url>"


def url_endpoint(url: str) -> str:
    """Where ``url`` points, for a log line: scheme, host, port and path (the
    database, or a socket's path) and a ``db`` query parameter; no user name,
    no password, no other query parameter. ``"<unparsable redis url>"`` when
    it cannot be parsed, and only the host when an ``@`` is misplaced
    (:func:`misplaced_at`: a piece of a password could pass for a path)."""
    try:
        if misplaced_at(url):
            scheme, _, rest = url.partition("://")
            return f"{scheme}://{rest.rpartition('@')[2].partition('/')[0]}"
        parts = urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
        kept = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
                if k.lower() == "db"]
        return _unsplit(parts._replace(fragment=""), host, urlencode(kept))
    except ValueError:
        return "<unparsable redis url>"


def split_url_password(url: str) -> tuple[str, str | None]:
    """``(url without its password, the password or None)``; a user name stays.

    The password is returned decoded (``p%40ss`` in the URL is ``p@ss``), as the
    Redis client would send it. Raises ``ValueError`` for a URL that cannot be parsed.
    """
    parts = urlsplit(url)
    password = None if parts.password is None else unquote(parts.password)
    netloc = parts.netloc
    if password is not None:
        host = netloc.rpartition("@")[2]
        netloc = f"{parts.username}@{host}" if parts.username else host
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    kept = [(k, v) for k, v in pairs if k.lower() not in SECRET_QUERY_KEYS]
    if password is None:
        password = next((v for k, v in pairs if k.lower() in SECRET_QUERY_KEYS), None)
    query = urlencode(kept, safe="/") if len(kept) != len(pairs) else parts.query
    return _unsplit(parts, netloc, query), password


def _unsplit(parts: SplitResult, netloc: str, query: str) -> str:
    """``urlunsplit`` of ``parts`` with ``netloc`` and ``query``, keeping the
    ``//`` of a URL without a host (``unix:///path.sock``), which it drops."""
    text = urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    if parts.scheme and not netloc and "://" not in text:
        text = f"{parts.scheme}://{text.partition(':')[2]}"
    return text
