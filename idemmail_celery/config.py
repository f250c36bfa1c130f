"""Settings, read from ``app.conf`` in Celery's style, with per-task overrides.

=================================  ==========================================  ==========================
``app.conf`` setting               task option (``@app.task(...)``)            default
=================================  ==========================================  ==========================
``idemmail_ledger_url``            ``idempotency_ledger_url``                  ``sqlite:///idemmail-ledger.sqlite3``
``idemmail_ledger_options``        -                                           ``{}`` (backend keywords)
``idemmail_key_secret``            -                                           env ``IDEMMAIL_KEY_SECRET``, else none
``idemmail_lease_seconds``         ``idempotency_lease_seconds``               300
``idemmail_retention_seconds``     -                                           604800 (7 days)
``idemmail_keep_payload``          -                                           False (erase it on ``sent``)
``idemmail_payload_keys``          -                                           env ``IDEMMAIL_PAYLOAD_KEYS``, else none
``idemmail_max_reclaims``          ``idempotency_max_reclaims``                3
``idemmail_inflight_max_retries``  ``idempotency_inflight_max_retries``        30
``idemmail_inflight_backoff``      -                                           1.0 s, doubling
``idemmail_inflight_backoff_max``  -                                           60 s
``idemmail_retry_backoff``         -                                           2.0 s, doubling
``idemmail_retry_backoff_max``     -                                           300 s
``idemmail_outage_max_retries``    -                                           none (retry forever)
``idemmail_fail_open``             ``idempotency_fail_open``                   False
-                                  ``idempotency_carries_key``                 False
``idemmail_redact_args``           ``idempotency_redact_args``                 False (``send_email``: True)
``idemmail_metrics``               -                                           False (:mod:`.metrics`)
``idemmail_metrics_port``          -                                           none (no ``/metrics``)
``idemmail_metrics_addr``          -                                           ``0.0.0.0``
=================================  ==========================================  ==========================

The lease must outlast the slowest side effect (above the provider's timeout);
the holder renews it every third of its length while the body runs.

The ledger stores each intent's first payload (the task's arguments: personal
data) so a released claim re-sends exactly the first message. Moving to ``sent``
erases it unless ``idemmail_keep_payload`` keeps it for audit.
``idemmail_payload_keys`` (a list of Fernet keys, or one comma-separated string;
the first seals, all open; a first entry ``"plain"`` seals nothing) encrypts stored
payloads, results and errors; it needs ``pip install 'idemmail-celery[crypto]'``.
See README, "Payloads at rest".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigurationError

DEFAULT_LEDGER_URL = "sqlite:///idemmail-ledger.sqlite3"


@dataclass(frozen=True)
class Settings:
    """Resolved settings for one task."""

    ledger_url: str = DEFAULT_LEDGER_URL
    ledger_options: dict[str, Any] = field(default_factory=dict)
    key_secret: bytes | None = None
    lease_seconds: float = 300.0
    retention_seconds: float = 7 * 24 * 3600.0
    max_reclaims: int = 3
    inflight_max_retries: int = 30
    inflight_backoff: float = 1.0
    inflight_backoff_max: float = 60.0
    retry_backoff: float = 2.0
    retry_backoff_max: float = 300.0
    outage_max_retries: int | None = None
    fail_open: bool = False
    carries_key: bool = False
    keep_payload: bool = False
    payload_keys: tuple[str, ...] = field(default=(), repr=False)  # secrets: never in a repr or a log

    def __post_init__(self) -> None:
        for name in ("lease_seconds", "retention_seconds", "inflight_backoff", "retry_backoff"):
            if not float(getattr(self, name)) > 0:
                raise ConfigurationError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_reclaims < 0 or self.inflight_max_retries < 0:
            raise ConfigurationError("max_reclaims and inflight_max_retries must be >= 0")
        if self.payload_keys:
            from .ledger.sealed import PayloadCodec

            PayloadCodec(self.payload_keys)  # no cryptography, or a bad key: say so now, in the caller

    def ledger_kwargs(self) -> dict[str, Any]:
        """Keywords for :func:`~idemmail_celery.ledger.from_url`; ``ledger_options`` win."""
        out: dict[str, Any] = {"retention_seconds": self.retention_seconds, "keep_payload": self.keep_payload}
        if self.payload_keys:
            out["payload_keys"] = list(self.payload_keys)
        return {**out, **self.ledger_options}

    @classmethod
    def resolve(cls, conf: Any, task: Any) -> Settings:
        """Task option, else ``app.conf`` setting, else the default."""

        def pick(setting: str, option: str | None, default: Any) -> Any:
            if option is not None:
                value = getattr(task, option, None)
                if value is not None:
                    return value
            value = conf.get(setting)
            return default if value is None else value

        secret = conf.get("idemmail_key_secret") or os.environ.get("IDEMMAIL_KEY_SECRET") or None
        payload_keys = conf.get("idemmail_payload_keys") or os.environ.get("IDEMMAIL_PAYLOAD_KEYS") or ()
        if isinstance(payload_keys, bytes):
            payload_keys = payload_keys.decode("ascii")
        if isinstance(payload_keys, str):
            payload_keys = payload_keys.split(",")
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        d = cls()
        return cls(
            ledger_url=pick("idemmail_ledger_url", "idempotency_ledger_url", d.ledger_url),
            ledger_options=dict(pick("idemmail_ledger_options", None, {})),
            key_secret=secret,
            lease_seconds=float(pick("idemmail_lease_seconds", "idempotency_lease_seconds", d.lease_seconds)),
            retention_seconds=float(pick("idemmail_retention_seconds", None, d.retention_seconds)),
            max_reclaims=int(pick("idemmail_max_reclaims", "idempotency_max_reclaims", d.max_reclaims)),
            inflight_max_retries=int(pick(
                "idemmail_inflight_max_retries", "idempotency_inflight_max_retries", d.inflight_max_retries
            )),
            inflight_backoff=float(pick("idemmail_inflight_backoff", None, d.inflight_backoff)),
            inflight_backoff_max=float(pick("idemmail_inflight_backoff_max", None, d.inflight_backoff_max)),
            retry_backoff=float(pick("idemmail_retry_backoff", None, d.retry_backoff)),
            retry_backoff_max=float(pick("idemmail_retry_backoff_max", None, d.retry_backoff_max)),
            outage_max_retries=pick("idemmail_outage_max_retries", None, None),
            fail_open=bool(pick("idemmail_fail_open", "idempotency_fail_open", False)),
            carries_key=bool(pick("idemmail_carries_key", "idempotency_carries_key", False)),
            keep_payload=bool(pick("idemmail_keep_payload", None, False)),
            payload_keys=tuple(_text(k) for k in payload_keys if _text(k)),
        )


def _text(key: str | bytes) -> str:
    return (key.decode("ascii") if isinstance(key, bytes) else str(key)).strip()
