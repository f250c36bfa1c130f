"""Ledgers: where intent keys are claimed and outcomes recorded.

Pick a backend by URL, as kombu picks a transport::

    from idemmail_celery.ledger import from_url
    ledger = from_url("redis://127.0.0.1:6379/0")
    ledger = from_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
    ledger = from_url("sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26379", master_name="mymaster")
    ledger = from_url("postgresql+psycopg://app@db/app", table="idemmail_ledger")
    ledger = from_url("sqlite:///idemmail.sqlite3")

A new backend subclasses :class:`Ledger` in its own module and registers its
schemes with :func:`register_backend`.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from .._registry import load, scheme_of
from ..errors import UnknownLedgerSchemeError
from .base import Claim, ClaimRequest, ClaimStatus, DetectsLoss, Ledger, Record, State

__all__ = [
    "Claim", "ClaimRequest", "ClaimStatus", "DetectsLoss", "Ledger", "Record", "State",
    "backend_for", "from_url", "known_schemes", "passive_options", "register_backend", "shared",
]

_BACKENDS: dict[str, str] = {
    "redis": "idemmail_celery.ledger.redis:RedisLedger",
    "rediss": "idemmail_celery.ledger.redis:RedisLedger",  # also redis+cluster:// and rediss+cluster://
    "sentinel": "idemmail_celery.ledger.redis:RedisLedger",  # Celery's sentinel://h1:26379;sentinel://h2:26379
    "sqlite": "idemmail_celery.ledger.sql:SQLLedger",
    "postgresql": "idemmail_celery.ledger.sql:SQLLedger",
    "postgres": "idemmail_celery.ledger.sql:SQLLedger",
    "mysql": "idemmail_celery.ledger.sql:SQLLedger",
    "mariadb": "idemmail_celery.ledger.sql:SQLLedger",
}
#: URL forms a scheme serves besides ``scheme://`` and ``scheme+driver://``, named where an unknown
#: scheme is refused (the docs use them: a list without them reads as if they were not served).
_FORMS: dict[str, tuple[str, ...]] = {"redis": ("redis+cluster",), "rediss": ("rediss+cluster",)}


def register_backend(scheme: str, target: str, *, forms: tuple[str, ...] = ()) -> None:
    """Serve URLs starting ``scheme://`` (or ``scheme+driver://``) with ``"module:Class"``; ``forms``
    (``"redis+cluster"``) are named with it where an unknown scheme is refused."""
    _BACKENDS[scheme.lower()] = target
    if forms:
        _FORMS[scheme.lower()] = tuple(f.lower() for f in forms)


def known_schemes() -> list[str]:
    """Every URL form a ledger is built from, as ``scheme://`` (sorted)."""
    return sorted(f"{form}://" for scheme in _BACKENDS for form in (scheme, *_FORMS.get(scheme, ())))


def backend_for(url: str) -> type[Ledger]:
    """The backend class for ``url``, without connecting. Raises on an unknown scheme."""
    scheme = scheme_of(url, "ledger")
    target = _BACKENDS.get(scheme)
    if target is None:
        known = ", ".join(known_schemes())
        raise UnknownLedgerSchemeError(f"no ledger backend for {scheme!r}:// (known: {known})")
    cls: type[Ledger] = load(target, Ledger)
    return cls


def from_url(url: str, **options: Any) -> Ledger:
    """Build the ledger for ``url``. Connects lazily, on first use.

    ``payload_keys`` (a list of Fernet keys; the first seals, all open) seals stored
    payloads, results and errors: see :mod:`idemmail_celery.ledger.sealed`. Without
    it the backend is returned as is, with no extra work per operation.
    """
    if url.startswith("postgres://"):
        url = "postgresql" + url[len("postgres"):]
    keys = options.pop("payload_keys", None)
    backend: Any = backend_for(url)  # concrete backends take the URL first
    if keys:
        from .sealed import PayloadCodec, SealedLedger

        codec = PayloadCodec(keys)  # a missing cryptography or a bad key fails before connecting
        return SealedLedger(backend(url, **options), codec)
    ledger: Ledger = backend(url, **options)
    return ledger


_shared: dict[tuple[str, str], Ledger] = {}
_shared_lock = threading.Lock()


def shared(url: str, options: dict[str, Any] | None = None) -> Ledger:
    """The process-wide ledger for ``url`` and ``options``: one connection pool each, timed by
    :mod:`idemmail_celery.metrics` whenever metrics are on (:class:`~.metered.MeteredLedger`).

    What tasks, bulk sends and the metrics endpoint use. Backends reconnect after a fork.
    """
    # A digest, not the options: they hold the payload keys, which must not sit in a dict key.
    cache_key = (url, hashlib.sha256(repr(sorted((options or {}).items())).encode()).hexdigest())
    with _shared_lock:
        ledger = _shared.get(cache_key)
        if ledger is None:
            from .metered import MeteredLedger

            ledger = _shared[cache_key] = MeteredLedger(from_url(url, **(options or {})))
        return ledger


def passive_options(url: str) -> dict[str, Any]:
    """Keywords that open ``url``'s ledger for reading only (operators, metrics scrapes): a ledger
    that detects store loss then reads its markers and never writes them."""
    return {"passive": True} if issubclass(backend_for(url), DetectsLoss) else {}
