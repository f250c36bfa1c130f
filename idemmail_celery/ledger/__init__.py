"""Ledgers: where intent keys are claimed and outcomes recorded, each picked by URL as kombu picks a transport
(``from_url("redis://127.0.0.1:6379/0")``, ``from_url("postgresql+psycopg://app@db/app", table="idemmail_ledger")``).
A new backend subclasses :class:`Ledger` in its own module and registers its schemes with :func:`register_backend`."""

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

_BACKENDS: dict[str, str] = {  # sentinel: Celery's sentinel://h1:26379;sentinel://h2:26379
    **dict.fromkeys(("redis", "rediss", "sentinel"), "idemmail_celery.ledger.redis:RedisLedger"),
    **dict.fromkeys(("sqlite", "postgresql", "postgres", "mysql", "mariadb"), "idemmail_celery.ledger.sql:SQLLedger"),
}
#: URL forms a scheme serves besides ``scheme://`` and ``scheme+driver://``, named when refusing an unknown one.
_FORMS: dict[str, tuple[str, ...]] = {"redis": ("redis+cluster",), "rediss": ("rediss+cluster",)}


def register_backend(scheme: str, target: str, *, forms: tuple[str, ...] = ()) -> None:
    """Serve ``scheme[+driver]://`` URLs with ``"module:Class"``; ``forms``: other URL forms, named in refusals."""
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
        raise UnknownLedgerSchemeError(f"no ledger backend for {scheme!r}:// (known: {', '.join(known_schemes())})")
    cls: type[Ledger] = load(target, Ledger)
    return cls


def from_url(url: str, **options: Any) -> Ledger:
    """Build the ledger for ``url`` (connecting on first use); ``payload_keys`` seal what it stores (:mod:`.sealed`)."""
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
    """The process-wide ledger for ``url`` and ``options``, timed whenever metrics are on (``MeteredLedger``)."""
    # A digest, not the options: they hold the payload keys, which must not sit in a dict key.
    cache_key = (url, hashlib.sha256(repr(sorted((options or {}).items())).encode()).hexdigest())
    with _shared_lock:
        ledger = _shared.get(cache_key)
        if ledger is None:
            from .metered import MeteredLedger

            ledger = _shared[cache_key] = MeteredLedger(from_url(url, **(options or {})))
        return ledger


def passive_options(url: str) -> dict[str, Any]:
    """Keywords that open ``url``'s ledger for reading only (operators, metrics scrapes)."""
    return {"passive": True} if issubclass(backend_for(url), DetectsLoss) else {}
