"""Settings: one table, read from ``app.conf`` in Celery's style, with per-task overrides.

Every setting is a row of :data:`SETTINGS` (name, overriding task option, environment variable, default,
parser, doc); the configuration reference is generated from it, and nothing else reads ``idemmail_*`` keys.

Values are parsed strictly, so a loader that yields strings (environment variables, INI
or YAML files) cannot turn an unsafe value on by accident: a boolean is ``True``/
``False``, ``1``/``0`` or one of the strings ``true``/``false``, ``1``/``0``, ``yes``/``no``,
``on``/``off`` (any case); a number is a number or a string of one (``"5"``, ``"2.5"``;
a count must be a whole number). Anything else raises
:class:`~idemmail_celery.errors.ConfigurationError` naming the setting (never its value).
An empty string means the setting is not set. The boolean and number keywords our
backends take in ``idemmail_ledger_options`` (``keep_payload``, ``allow_eviction``,
``auto_init``, ``create_table``, ``retention_seconds``, ``buckets``) are parsed the same way.

Celery's own retry attributes are honoured: a task with ``retry_backoff`` set retries its
transient failures on Celery's curve (``retry_backoff`` doubling up to ``retry_backoff_max``,
``retry_jitter``) instead of ``idemmail_retry_backoff``/``idemmail_retry_backoff_max``. How long
they are retried is a time, ``idemmail_retry_deadline_seconds``, not Celery's ``max_retries``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigurationError
from .sealing import Keyring

DEFAULT_LEDGER_URL = "sqlite:///idemmail-ledger.sqlite3"

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})

Parser = Callable[[str, Any], Any]


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
    raise ConfigurationError(f"{name} must be a boolean: true/false, 1/0, yes/no or on/off (got a "
                             f"{type(value).__name__} that is none of these)")


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


def parse_str(name: str, value: Any) -> str:
    """A text value (bytes are decoded as UTF-8), stripped."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        raise ConfigurationError(f"{name} must be a string (got a {type(value).__name__})")
    return value.strip()


def parse_text_list(name: str, value: Any) -> tuple[str, ...]:
    """A list of texts, or one comma-separated string (an environment variable); empty entries dropped."""
    if isinstance(value, (str, bytes)):
        value = parse_str(name, value).split(",")
    if not isinstance(value, (list, tuple)):
        raise ConfigurationError(f"{name} must be a list or a comma-separated string (got a {type(value).__name__})")
    return tuple(t for t in (parse_str(name, v) for v in value) if t)


def parse_secret_list(name: str, value: Any) -> tuple[bytes | None, ...]:
    """Secrets, newest first: a string or a list (never split on commas); after the first, ``None`` is no secret."""
    if isinstance(value, str) and name.isupper() and value.lstrip().startswith("["):
        # An environment variable holds one string: a rotation there is a JSON array, newest first.
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigurationError(f"{name}: starts with '[' but is not a JSON array of secrets") from None
    items = [value] if isinstance(value, (str, bytes)) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigurationError(f"{name} must be a string or a list of strings (got a {type(value).__name__})")
    out: list[bytes | None] = []
    for item in items:
        if item is None and out:
            out.append(None)
            continue
        if isinstance(item, str):
            item = item.encode("utf-8")
        if not isinstance(item, bytes):
            raise ConfigurationError(f"{name}: every secret must be a string (got a {type(item).__name__}); "
                                     "only an older one may be None")
        if item.strip():
            out.append(item)
    return tuple(out)


def _at_least(parse: Parser, low: float, *, strict: bool = False) -> Parser:
    def checked(name: str, value: Any) -> Any:
        number = parse(name, value)
        if number < low or (strict and number == low):
            raise ConfigurationError(f"{name} must be {'>' if strict else '>='} {low:g}, got {number!r}")
        return number

    return checked


positive = _at_least(parse_float, 0, strict=True)
non_negative_float = _at_least(parse_float, 0)
count = _at_least(parse_int, 0)
port = _at_least(parse_int, 0)

#: The typed keywords of our backends (``RedisLedger``, ``SQLLedger``) in ``idemmail_ledger_options``.
_LEDGER_OPTION_PARSERS: dict[str, Parser] = {
    "keep_payload": parse_bool, "allow_eviction": parse_bool, "auto_init": parse_bool,
    "create_table": parse_bool, "retention_seconds": parse_float, "buckets": parse_int, "shelves": parse_int,
    "policy_recheck_seconds": parse_float,
}


def parse_ledger_options(name: str, options: Any) -> dict[str, Any]:
    """A mapping of backend keywords; our backends' typed ones parsed like any setting."""
    if not isinstance(options, Mapping):
        try:
            if isinstance(options, (str, bytes)):
                raise TypeError
            options = dict(options)
        except (TypeError, ValueError):
            kind = type(options).__name__
            raise ConfigurationError(f"{name} must be a mapping of backend keywords (got a {kind})") from None
    out = dict(options)
    for key, parse in _LEDGER_OPTION_PARSERS.items():
        if key in out and out[key] is not None:
            out[key] = parse(f"{name}[{key!r}]", out[key])
    return out


def _check_payload_keys(name: str, value: Any) -> tuple[str, ...]:
    keys = parse_text_list(name, value)
    if keys:
        Keyring(keys)  # no cryptography, or a bad key: say so now, in the caller
    return keys


@dataclass(frozen=True)
class Setting:
    """One row of the settings table."""

    conf: str                      #: the ``app.conf`` name
    parse: Parser                  #: ``parse(name, value)``: the parsed value or ConfigurationError
    default: Any                   #: when nothing sets it
    doc: str                       #: what it does, for the configuration reference
    option: str | None = None      #: the task option that overrides it, if any
    env: str | None = None         #: the environment variable read when ``app.conf`` leaves it unset
    secret: bool = False           #: never shown: not in a repr, not in the reference's default column
    optional: bool = False         #: None is a value of its own (unset: no limit, none)

    @property
    def field(self) -> str:
        """The :class:`Settings` attribute: the name without ``idemmail_``."""
        return self.conf.removeprefix("idemmail_")


SETTINGS: tuple[Setting, ...] = (
    # -- the ledger --
    Setting("idemmail_ledger_url", parse_str, DEFAULT_LEDGER_URL,
            "Where intents are claimed and outcomes recorded: `redis://`, `rediss://`, `redis+cluster://`, "
            "`sentinel://`, `postgresql+psycopg://`, `mysql+pymysql://`, `sqlite:///`.",
            option="idempotency_ledger_url"),
    Setting("idemmail_ledger_options", parse_ledger_options, {},
            "Keywords for the ledger backend (`prefix`, `table`, `buckets`, `allow_eviction`, `engine_options`, ...)."),
    Setting("idemmail_lease_seconds", positive, 30.0,
            "How long a claim holds without renewal. The holder renews it every third of this while the body runs; "
            "a crashed holder's intent is taken over once it runs out, so a short lease recovers crashes fast.",
            option="idempotency_lease_seconds"),
    Setting("idemmail_retention_seconds", positive, 7 * 24 * 3600.0,
            "How long `sent` and `failed` records are kept (and duplicates replayed) before they expire."),
    Setting("idemmail_keep_payload", parse_bool, False,
            "Keep the first payload (personal data) after `sent`, for audit. Off: it is erased on `sent`."),
    Setting("idemmail_payload_keys", _check_payload_keys, (),
            "Fernet keys (a list, or one comma-separated string; the first seals, all open; a first entry "
            "`plain` seals nothing) that encrypt stored payloads, results and errors. Needs the `crypto` extra.",
            env="IDEMMAIL_PAYLOAD_KEYS", secret=True),
    # -- keys --
    Setting("idemmail_key_secret", parse_secret_list, (),
            "The HMAC secret of intent keys, or a list of them, newest first: keys are made with the first, and a "
            "claim also finds records made under the others, so rotating never resends (in the environment "
            "variable, a list is a JSON array: `[\"new\", \"old\"]`). Unset: plain SHA-256 "
            "(development only: a key can then be brute-forced back to guessable arguments).",
            env="IDEMMAIL_KEY_SECRET", secret=True),
    Setting("idemmail_allow_plain_keys", parse_bool, False,
            "Allow intent keys without `idemmail_key_secret` on a server ledger (Redis, PostgreSQL, MySQL). "
            "Off: a missing secret is a ConfigurationError there; the embedded SQLite ledger (development) "
            "allows it with a warning."),
    # -- what happens when a claim is not simply acquired --
    Setting("idemmail_max_reclaims", count, 3,
            "Holders that may die on one intent before it is parked for review (a poison message).",
            option="idempotency_max_reclaims"),
    Setting("idemmail_inflight_max_retries", count, 30,
            "Reschedules of a copy that finds another holder's live claim before it gives up (the holder's own "
            "message still carries the intent).", option="idempotency_inflight_max_retries"),
    Setting("idemmail_inflight_backoff", positive, 1.0,
            "First wait of such a copy, in seconds, doubling with jitter."),
    Setting("idemmail_inflight_backoff_max", positive, 60.0,
            "Longest wait of such a copy, in seconds (always kept below the broker's visibility timeout)."),
    Setting("idemmail_retry_backoff", positive, 2.0,
            "First wait before retrying a transient failure, in seconds, doubling with jitter (a task's own "
            "`retry_backoff` takes precedence)."),
    Setting("idemmail_retry_backoff_max", positive, 300.0,
            "Longest wait before retrying a transient failure, in seconds (a task's own `retry_backoff_max` "
            "takes precedence when it sets `retry_backoff`), a provider's `Retry-After` included. Past half the "
            "Redis or SQS `visibility_timeout`, each wait is split into hops below it."),
    Setting("idemmail_retry_deadline_seconds", positive, 6 * 3600.0,
            "How long after an intent's first enqueue (a countdown's due time; an outbox row's publish by the relay) "
            "a send that certainly did not happen (a `TransientSendError`: "
            "connection refused, a 4xx or 429 before the provider accepted anything) is still retried, whatever "
            "the task's `max_retries`; then the intent ends `failed`, reason `retry_deadline`. Lower it for mail "
            "that is useless late (a password reset: `@app.task(idempotency_retry_deadline_seconds=900)`).",
            option="idempotency_retry_deadline_seconds"),
    Setting("idemmail_outage_max_retries", count, None,
            "Reschedules while the ledger (or the provider's set-up) is unavailable before the message fails; "
            "unset: until it is back.", optional=True),
    Setting("idemmail_sweep_after_seconds", positive, None,
            "How long a claim's lease must have run out, with no move since, before the sweep republishes it "
            "from its first payload. Unset: twice the longest of the broker's visibility timeout (with its "
            "restore delay), `idemmail_inflight_backoff_max` and the retry backoff maximum, 300 s at least.",
            optional=True),
    Setting("idemmail_sweep_in_workers", parse_bool, True,
            "Workers sweep for stranded claims themselves, one at a time per ledger, every quarter of "
            "`idemmail_sweep_after_seconds` (15 min at most). Off: only a beat entry runs the sweep."),
    Setting("idemmail_restore_unacked", parse_bool, True,
            "Workers that run no kombu event loop (`-P gevent`, `-P eventlet`) on a Redis broker hand a killed "
            "worker's unacked messages back to the queue every `unacked_restore_interval` seconds, and every "
            "worker on a Redis broker holds the transport's restore lock one restore period at most unless "
            "`unacked_mutex_expire` is set (kombu: 300 s, and a worker killed mid-scan stopped every restore that "
            "long). Off: only workers with an event loop restore, kombu's way."),
    Setting("idemmail_refuse_to_start", parse_bool, False,
            "Exit at worker start when a start-up check fails (a ledger that does not answer or whose driver is "
            "missing, a provider that cannot be built, no key secret). Off: each failure is one ERROR line with "
            "its fix, and messages wait on the outage budget until it is fixed."),
    Setting("idemmail_fail_open", parse_bool, False,
            "Run the body without a claim while the ledger is unavailable (at-least-once). Off: fail closed.",
            option="idempotency_fail_open"),
    Setting("idemmail_carries_key", parse_bool, False,
            "The body passes the key to a service that de-duplicates on it, so a crashed or ambiguous attempt is "
            "retried with the same key instead of parked for review.", option="idempotency_carries_key"),
    Setting("idemmail_redact_args", parse_bool, True,
            "Show the intent key instead of the arguments wherever Celery shows a message (events, Flower, logs).",
            option="idempotency_redact_args"),
    # -- send_email and its provider --
    Setting("idemmail_provider_url", parse_str, None,
            "The email provider: `resend://`, `https://...`, `postmark://`, `sendgrid://`, `ses://`, `smtp://`, "
            "`smtps://`, `file:///dir`, `console://`.", optional=True),
    Setting("idemmail_provider_api_key", parse_str, None,
            "The provider's API key, whatever the provider (never logged; for `smtp://` the password, for `ses://` "
            "`ACCESS_KEY_ID:SECRET_ACCESS_KEY`). Unset, here and in the environment: each provider reads its own "
            "variables (`RESEND_API_KEY`, `POSTMARK_SERVER_TOKEN`, `SENDGRID_API_KEY`, `AWS_ACCESS_KEY_ID` and "
            "`AWS_SECRET_ACCESS_KEY`, `IDEMMAIL_SMTP_PASSWORD`).",
            env="IDEMMAIL_PROVIDER_API_KEY", secret=True, optional=True),
    Setting("idemmail_provider_timeout", positive, None,
            "Seconds a provider call may take (each provider has its own default).", optional=True),
    Setting("idemmail_default_from", parse_str, None,
            "The sender of `send_email` calls that pass no `from_`.", optional=True),
    Setting("idemmail_max_message_bytes", positive, 10 * 1024 * 1024,
            "Largest message `send_email` accepts, refused at `delay()` and again at the worker: every byte it "
            "stores or sends counts (addresses, subject, bodies, headers, tags, attachments with their names and "
            "a MIME part's overhead each, `event_id`, `template`, `tenant`). Lowered, it holds new calls and "
            "messages sent by name: one `delay()` accepted (sealed) under a higher value is still sent."),
    Setting("idemmail_allow_mixed_script_domains", parse_bool, False,
            "Accept address domains whose labels mix scripts (Latin with Cyrillic: `ex\\u0430mple.com`, a "
            "look-alike of `example.com`); off, they are refused at `delay()`."),
    Setting("idemmail_max_recipients", _at_least(parse_int, 1), 50,
            "Most recipients (to, cc and bcc together) one `send_email` message may have, refused at `delay()`."),
    Setting("idemmail_campaign_pass_seconds", positive, None,
            "How long one pass of `send_campaign` runs before it hands the rest of the list to a fresh message "
            "(a broker hands out a message held longer than its visibility timeout again, to a second worker). "
            "Unset: half the Redis or SQS `visibility_timeout`, else 900 s (half RabbitMQ's `consumer_timeout`).",
            optional=True),
    # -- metrics --
    Setting("idemmail_metrics", parse_bool, False,
            "Count outcomes and ledger operations into prometheus_client's registry (the `metrics` extra)."),
    Setting("idemmail_metrics_port", port, 0,
            "Serve `/metrics` from the worker's main process on this port (0: do not serve)."),
    Setting("idemmail_metrics_addr", parse_str, "0.0.0.0",
            "The address `/metrics` listens on."),
    # -- the transactional outbox relay --
    Setting("idemmail_outbox_url", parse_str, None,
            "The database of the outbox table the relay task drains (the application's own database).",
            optional=True),
    Setting("idemmail_outbox_table", parse_str, "idemmail_outbox", "The outbox table's name."),
    Setting("idemmail_outbox_batch_size", _at_least(parse_int, 1), 100, "Rows the relay publishes per transaction."),
    Setting("idemmail_outbox_max_seconds", positive, 10.0, "How long one run of the relay task may drain."),
    Setting("idemmail_email_window_seconds", positive, 600.0,
            "Django's `EMAIL_BACKEND`: how long a message sent again with the same sender, recipients, subject, "
            "bodies and attachments (and no `Idempotency-Key` header) is the same intent: one window, one email."),
)

#: Every setting's default, by :class:`Settings` attribute: ``Settings``, the handler's ``Policy`` and the
#: ledgers read it from here.
DEFAULTS: dict[str, Any] = {s.field: s.default for s in SETTINGS}
_D = DEFAULTS
_KNOWN = frozenset(s.conf for s in SETTINGS)


def _refuse_unknown(conf: Any) -> None:
    """Refuse an unknown ``idemmail_*`` key, naming the setting it most likely meant: a typo until proven
    otherwise (a misspelt ``idemmail_key_secret`` would leave keys unkeyed)."""
    try:
        names = [str(k) for k in conf]
    except Exception:  # a conf object that cannot be listed: nothing to look through
        return
    # Lower case only: in a Django project's conf, IDEMMAIL_KEY_SECRET = env(...) is the project's own variable.
    unknown = sorted(n for n in names if n.startswith("idemmail_") and n not in _KNOWN)
    if unknown:
        import difflib

        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name.lower(), _KNOWN, n=1, cutoff=0.6)
            hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise ConfigurationError(f"unknown idemmail setting(s): {', '.join(hints)}; the settings are listed in "
                                 "the configuration reference (docs/configuration.md)")


def _unset(value: Any) -> bool:
    """None, or an empty string (an environment variable set to nothing)."""
    return value is None or (isinstance(value, (str, bytes)) and not value.strip())


@dataclass(frozen=True)
class Settings:
    """Resolved settings for one task (or for the app, with no task): one attribute per row of :data:`SETTINGS`."""

    ledger_url: str = _D["ledger_url"]
    ledger_options: dict[str, Any] = field(default_factory=dict)
    lease_seconds: float = _D["lease_seconds"]
    retention_seconds: float = _D["retention_seconds"]
    keep_payload: bool = _D["keep_payload"]
    payload_keys: tuple[str, ...] = field(default=(), repr=False)  # secrets: never in a repr or a log
    key_secret: tuple[bytes | None, ...] = field(default=(), repr=False)
    allow_plain_keys: bool = _D["allow_plain_keys"]
    max_reclaims: int = _D["max_reclaims"]
    inflight_max_retries: int = _D["inflight_max_retries"]
    inflight_backoff: float = _D["inflight_backoff"]
    inflight_backoff_max: float = _D["inflight_backoff_max"]
    retry_backoff: float = _D["retry_backoff"]
    retry_backoff_max: float = _D["retry_backoff_max"]
    retry_deadline_seconds: float = _D["retry_deadline_seconds"]
    outage_max_retries: int | None = None
    sweep_after_seconds: float | None = None
    sweep_in_workers: bool = _D["sweep_in_workers"]
    restore_unacked: bool = _D["restore_unacked"]
    refuse_to_start: bool = _D["refuse_to_start"]
    fail_open: bool = _D["fail_open"]
    carries_key: bool = _D["carries_key"]
    redact_args: bool = _D["redact_args"]
    provider_url: str | None = None
    provider_api_key: str | None = field(default=None, repr=False)
    provider_timeout: float | None = None
    default_from: str | None = None
    max_message_bytes: float = _D["max_message_bytes"]
    max_recipients: int = _D["max_recipients"]
    allow_mixed_script_domains: bool = _D["allow_mixed_script_domains"]
    campaign_pass_seconds: float | None = None
    metrics: bool = _D["metrics"]
    metrics_port: int = _D["metrics_port"]
    metrics_addr: str = _D["metrics_addr"]
    outbox_url: str | None = None
    outbox_table: str = _D["outbox_table"]
    outbox_batch_size: int = _D["outbox_batch_size"]
    outbox_max_seconds: float = _D["outbox_max_seconds"]
    email_window_seconds: float = _D["email_window_seconds"]

    def __post_init__(self) -> None:
        # Built directly, not by resolve(): the same strict parsing, named by field.
        for setting in SETTINGS:
            value = getattr(self, setting.field)
            if value is setting.default or (setting.optional and value is None):
                continue
            object.__setattr__(self, setting.field, setting.parse(setting.field, value))

    @property
    def key_secrets(self) -> tuple[bytes | None, ...]:
        """Every HMAC secret, newest first (empty: plain SHA-256)."""
        return self.key_secret

    def ledger_kwargs(self) -> dict[str, Any]:
        """Keywords for :func:`~idemmail_celery.ledger.from_url`, already parsed; ``ledger_options`` win."""
        out: dict[str, Any] = {"retention_seconds": self.retention_seconds, "keep_payload": self.keep_payload}
        if self.payload_keys:
            out["payload_keys"] = list(self.payload_keys)
        return {**out, **self.ledger_options}

    @classmethod
    def resolve(cls, conf: Any, task: Any = None) -> Settings:
        """For each setting: the task option, else the ``app.conf`` setting, else its environment
        variable, else the default; every given value parsed strictly and named in its error."""
        _refuse_unknown(conf)
        values: dict[str, Any] = {}
        get = conf.get
        for setting in SETTINGS:
            name, value = setting.conf, None
            if setting.option is not None and task is not None:
                value = getattr(task, setting.option, None)
                name = setting.option
            if value is None:
                name, value = setting.conf, get(setting.conf)
            if _unset(value) and setting.env:
                name, value = setting.env, os.environ.get(setting.env)
            if _unset(value):
                continue
            values[setting.field] = setting.parse(name, value)
        return cls._parsed(values)

    @classmethod
    def _parsed(cls, values: dict[str, Any]) -> Settings:
        """Build without parsing again (``resolve`` parsed every value under its own name)."""
        out = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(out, f.name, values.get(f.name, default))
        return out
