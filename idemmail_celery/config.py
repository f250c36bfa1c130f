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
``idemmail_redact_args``           ``idempotency_redact_args``                 True (arguments never shown)
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

Values are parsed strictly, so a loader that yields strings (environment variables,
INI or YAML files) cannot turn an unsafe value on by accident: a boolean is ``True``/
``False``, ``1``/``0`` or one of the strings ``true``/``false``, ``1``/``0``, ``yes``/``no``,
``on``/``off`` (any case); a number is a number or a string of one (``"5"``, ``"2.5"``;
a count must be a whole number). Anything else raises
:class:`~idemmail_celery.errors.ConfigurationError` naming the setting (never its value).
An empty string means the setting is not set. The boolean and number keywords our
backends take in ``idemmail_ledger_options`` (``keep_payload``, ``allow_eviction``,
``auto_init``, ``create_table``, ``retention_seconds``, ``buckets``) are parsed the same way.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigurationError

DEFAULT_LEDGER_URL = "sqlite:///idemmail-ledger.sqlite3"

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_BOOL_FIELDS = ("fail_open", "carries_key", "keep_payload", "redact_args")
_FLOAT_FIELDS = ("lease_seconds", "retention_seconds", "inflight_backoff", "inflight_backoff_max",
                 "retry_backoff", "retry_backoff_max")
_INT_FIELDS = ("max_reclaims", "inflight_max_retries", "outage_max_retries")


def parse_bool(name: str, value: Any) -> bool:
    """``value`` as a boolean, strictly; :class:`ConfigurationError` naming ``name`` otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    # The value itself is never echoed: a misplaced secret must not reach a log.
    raise ConfigurationError(
        f"{name} must be a boolean: true/false, 1/0, yes/no or on/off (got a {type(value).__name__} "
        "that is none of these)"
    )


def parse_int(name: str, value: Any) -> int:
    """``value`` as a whole number (``5``, ``5.0``, ``"5"``); :class:`ConfigurationError` otherwise."""
    if not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, (str, bytes)):
            try:
                return int(value.strip())
            except ValueError:
                pass
    raise ConfigurationError(f"{name} must be a whole number (got a {type(value).__name__} that is not one)")


def parse_float(name: str, value: Any) -> float:
    """``value`` as a finite number (``2``, ``2.5``, ``"2.5"``); :class:`ConfigurationError` otherwise."""
    if not isinstance(value, bool) and isinstance(value, (int, float, str, bytes)):
        try:
            number = float(value.strip() if isinstance(value, (str, bytes)) else value)
        except ValueError:
            pass
        else:
            if math.isfinite(number):
                return number
    raise ConfigurationError(f"{name} must be a finite number (got a {type(value).__name__} that is not one)")


#: The typed keywords of our backends (``RedisLedger``, ``SQLLedger``) in ``idemmail_ledger_options``.
_LEDGER_OPTION_PARSERS = {
    "keep_payload": parse_bool, "allow_eviction": parse_bool, "auto_init": parse_bool,
    "create_table": parse_bool, "retention_seconds": parse_float, "buckets": parse_int,
}


def _unset(value: Any) -> bool:
    """None, or an empty string (an environment variable set to nothing)."""
    return value is None or (isinstance(value, (str, bytes)) and not value.strip())


def _ledger_options(options: Any) -> dict[str, Any]:
    if _unset(options):
        return {}
    if not isinstance(options, dict):
        try:
            if isinstance(options, (str, bytes)):
                raise TypeError
            options = dict(options)
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"idemmail_ledger_options must be a mapping of backend keywords (got a {type(options).__name__})"
            ) from None
    out = dict(options)
    for name, parse in _LEDGER_OPTION_PARSERS.items():
        if name in out and out[name] is not None:
            out[name] = parse(f"idemmail_ledger_options[{name!r}]", out[name])
    return out


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
    redact_args: bool = True
    payload_keys: tuple[str, ...] = field(default=(), repr=False)  # secrets: never in a repr or a log

    def __post_init__(self) -> None:
        # Built directly, not by resolve(): the same strict parsing, named by field.
        for name in _BOOL_FIELDS:
            object.__setattr__(self, name, parse_bool(name, getattr(self, name)))
        for name in _FLOAT_FIELDS:
            object.__setattr__(self, name, parse_float(name, getattr(self, name)))
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None or name != "outage_max_retries":
                object.__setattr__(self, name, parse_int(name, value))
        object.__setattr__(self, "ledger_options", _ledger_options(self.ledger_options))
        for name in ("lease_seconds", "retention_seconds", "inflight_backoff", "retry_backoff"):
            if not float(getattr(self, name)) > 0:
                raise ConfigurationError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_reclaims < 0 or self.inflight_max_retries < 0:
            raise ConfigurationError("max_reclaims and inflight_max_retries must be >= 0")
        if self.outage_max_retries is not None and self.outage_max_retries < 0:
            raise ConfigurationError("outage_max_retries must be >= 0 (or unset: retry forever)")
        if self.payload_keys:
            from .ledger.sealed import PayloadCodec

            PayloadCodec(self.payload_keys)  # no cryptography, or a bad key: say so now, in the caller

    def ledger_kwargs(self) -> dict[str, Any]:
        """Keywords for :func:`~idemmail_celery.ledger.from_url`; ``ledger_options`` win.

        Booleans and numbers are already parsed (see the module docstring): a backend never
        receives ``"false"`` for ``keep_payload`` or ``allow_eviction``.
        """
        out: dict[str, Any] = {"retention_seconds": self.retention_seconds, "keep_payload": self.keep_payload}
        if self.payload_keys:
            out["payload_keys"] = list(self.payload_keys)
        return {**out, **self.ledger_options}

    @classmethod
    def resolve(cls, conf: Any, task: Any) -> Settings:
        """Task option, else ``app.conf`` setting, else the default."""

        def pick(setting: str, option: str | None, default: Any, parse: Any = None) -> Any:
            """The task option, else the setting, else ``default``; ``parse(name, value)`` checks a given value."""
            name, value = setting, None
            if option is not None:
                value = getattr(task, option, None)
                name = option
            if value is None:
                name, value = setting, conf.get(setting)
            if value is None or (parse is not None and _unset(value)):
                return default
            return value if parse is None else parse(name, value)

        secret = conf.get("idemmail_key_secret") or os.environ.get("IDEMMAIL_KEY_SECRET") or None
        payload_keys = conf.get("idemmail_payload_keys") or os.environ.get("IDEMMAIL_PAYLOAD_KEYS") or ()
        if isinstance(payload_keys, bytes):
            payload_keys = payload_keys.decode("ascii")
        if isinstance(payload_keys, str):
            payload_keys = payload_keys.split(",")
        if isinstance(secret, str):
            secret = secret.encode("utf-8")
        d = cls()
        flag, count, number = parse_bool, parse_int, parse_float
        return cls(
            ledger_url=pick("idemmail_ledger_url", "idempotency_ledger_url", d.ledger_url),
            ledger_options=_ledger_options(pick("idemmail_ledger_options", None, {})),
            key_secret=secret,
            lease_seconds=pick("idemmail_lease_seconds", "idempotency_lease_seconds", d.lease_seconds, number),
            retention_seconds=pick("idemmail_retention_seconds", None, d.retention_seconds, number),
            max_reclaims=pick("idemmail_max_reclaims", "idempotency_max_reclaims", d.max_reclaims, count),
            inflight_max_retries=pick(
                "idemmail_inflight_max_retries", "idempotency_inflight_max_retries", d.inflight_max_retries, count
            ),
            inflight_backoff=pick("idemmail_inflight_backoff", None, d.inflight_backoff, number),
            inflight_backoff_max=pick("idemmail_inflight_backoff_max", None, d.inflight_backoff_max, number),
            retry_backoff=pick("idemmail_retry_backoff", None, d.retry_backoff, number),
            retry_backoff_max=pick("idemmail_retry_backoff_max", None, d.retry_backoff_max, number),
            outage_max_retries=pick("idemmail_outage_max_retries", None, None, count),
            fail_open=pick("idemmail_fail_open", "idempotency_fail_open", False, flag),
            carries_key=pick("idemmail_carries_key", "idempotency_carries_key", False, flag),
            keep_payload=pick("idemmail_keep_payload", None, False, flag),
            redact_args=pick("idemmail_redact_args", "idempotency_redact_args", True, flag),
            payload_keys=tuple(_text(k) for k in payload_keys if _text(k)),
        )


def _text(key: str | bytes) -> str:
    return (key.decode("ascii") if isinstance(key, bytes) else str(key)).strip()
