"""Plumbing shared by the adapters: message header names, backoff, and one after-fork registry.

Nothing here knows about ledgers or tasks; every other module may import it.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger("idemmail_celery")

# -- message headers: what travels with a message between the caller, the broker and workers --

#: The intent key (a keyed hash), set by ``apply_async`` before anything is enqueued.
KEY_HEADER = "idempotency_key"
#: The seal of the headers the worker acts on (:data:`SEALED_HEADERS`; ``IntentKeyBuilder.seal``): with a
#: valid one the key is claimed as it is. Without it the key header is a caller's own key, checked and hashed.
KEY_MARK_HEADER = "idemmail_key_mark"
#: During a key-secret rotation: the keys the same call had under the older secrets (a claim finds
#: records made before the rotation under them, so rotating never sends an intent again).
OLDER_KEYS_HEADER = "idemmail_older_keys"
#: The tenant that namespaces the key, when the caller named one.
TENANT_HEADER = "idempotency_tenant"
#: When the intent was first enqueued (caller's clock, epoch seconds).
ENQUEUED_HEADER = "idemmail_enqueued"
#: When a countdown or ETA first lets the message run (epoch seconds), set only when later than its enqueue:
#: the retention rule and the retry deadline count from it; the ledger-loss rule counts from the enqueue, since
#: another copy of the same intent, enqueued with it and due at once, may have been sent before a loss.
DUE_HEADER = "idemmail_due"
#: When the outbox relay published the row this message stands for (epoch seconds), set only by the relay: the
#: retry deadline counts from it when later than the enqueue and due times (a row relayed hours after it was
#: written still has its whole budget); the other rules count from the row's own times, as written.
RELAYED_HEADER = "idemmail_relayed"
#: How many times this chain was rescheduled because another holder's claim was live.
INFLIGHT_HEADER = "idemmail_inflight"
#: How many times this chain was rescheduled because the ledger (or the provider's set-up) was unavailable.
OUTAGE_HEADER = "idemmail_outage"
#: The owners this chain may still hold its claim under, newest first (a list; see ``Delivery.resume_owners``).
OWNER_HEADER = "idemmail_owner"
#: A verdict this chain reached but could not record (the ledger was down): recorded by the next delivery.
VERDICT_HEADER = "idemmail_verdict"
#: The id of this published reschedule: two copies of one broker message share it (see ``Ledger.mark_hop``).
HOP_HEADER = "idemmail_hop"
#: Where a campaign's next pass starts, and what the passes before it came to (see ``bulk.py``).
CAMPAIGN_HEADER = "idemmail_campaign"
#: Epoch seconds before which this message only waits (a long countdown split into hops the broker keeps).
NOT_BEFORE_HEADER = "idemmail_not_before"

#: The library's own tasks, by name: a process may publish them by name (``send_task``) without ever importing
#: the modules that define them, and their arguments are addresses, subjects and bodies (always redacted).
LIBRARY_TASKS = ("idemmail_celery.send_email", "idemmail_celery.send_campaign")

#: The time a beat entry was due (ISO 8601, the app's timezone): the slot a digest is keyed by.
SLOT_HEADER = "idemmail_slot"

#: The name of the intent key in a provider's message metadata (Postmark Metadata, SendGrid custom_args,
#: SES EmailTags): what a delivery webhook reads the key back from.
KEY_TAG = "idemmail_key"

#: Headers the worker acts on: only a valid seal (``IntentKeyBuilder.seal``, in :data:`KEY_MARK_HEADER`) makes
#: them count; without one they are ignored (the key is then a caller's own, hashed). The tenant is not among
#: them: it only namespaces a key the worker hashes or derives itself.
SEALED_HEADERS = (KEY_HEADER, OLDER_KEYS_HEADER, ENQUEUED_HEADER, DUE_HEADER, RELAYED_HEADER, INFLIGHT_HEADER,
                  OUTAGE_HEADER, OWNER_HEADER, VERDICT_HEADER, HOP_HEADER, CAMPAIGN_HEADER, NOT_BEFORE_HEADER)
#: When a message sealed under a key secret its worker lacks first waited (epoch seconds). Not sealed: it
#: only decides how loudly the wait is logged (a forged one makes a publisher's own message louder).
SECRET_WAIT_HEADER = "idemmail_secret_wait"
#: A wait for an unknown key secret longer than this is logged at ERROR (the secret was removed too early).
SECRET_WAIT_ERROR_SECONDS = 600.0
#: The most older keys a message may name (one per older key secret still being rotated out).
MAX_OLDER_KEYS = 8

#: Headers that belong to one reschedule chain: a ``retry()`` starts a new chain without them.
CHAIN_HEADERS = (INFLIGHT_HEADER, OUTAGE_HEADER, OWNER_HEADER, VERDICT_HEADER, HOP_HEADER, NOT_BEFORE_HEADER)


def chain_headers(headers: Mapping[str, Any], state: Mapping[str, Any], *, drop: Iterable[str]) -> dict[str, Any]:
    """The headers of a chain's next message: ``headers`` less the chain state named in ``drop``, plus
    ``state`` (owners, verdicts, budgets, a campaign pass's place). Every adapter writes chain state
    through here (single sends in ``task.py``, campaign passes in ``bulk.py``): one place for a hook
    that signs or checks it."""
    dropped = set(drop)
    out = {k: v for k, v in headers.items() if k not in dropped}
    out.update(state)
    return out


def backoff(attempt: int, base: float, cap: float, *, jitter: bool = True) -> float:
    """Exponential backoff: ``min(cap, base * 2**attempt)``, with jitter between half and all of it.

    The curve of Celery's ``retry_backoff`` (``factor * 2**retries`` up to a maximum), in fractions
    of a second as well as whole seconds. Celery's jitter draws anywhere from nothing to the whole
    step; this one never waits less than half of it, so a retry is never immediate.
    """
    ceiling = min(cap, base * (2 ** min(max(attempt, 0), 30)))
    return float(ceiling * random.uniform(0.5, 1.0)) if jitter else float(ceiling)


# -- fork safety: one registry, one os.register_at_fork --

_after_fork: list[Callable[[], None]] = []
_after_fork_lock = threading.Lock()


def after_fork(callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` in every child right after ``fork()`` (usable as a decorator).

    Modules that hold sockets, threads or locks reset them here instead of comparing
    pids on every call: a pool child must never write on its parent's connections, and a
    lock held by a parent thread at the fork would never be released in the child.
    A callback that raises is logged and the others still run.
    """
    with _after_fork_lock:
        _after_fork.append(callback)
    return callback


def _run_after_fork() -> None:
    global _after_fork_lock
    _after_fork_lock = threading.Lock()  # the parent may have held it while forking
    for callback in list(_after_fork):
        try:
            callback()
        except Exception:  # pragma: no cover - a broken reset must not stop the others
            log.exception("idemmail: after-fork reset %r failed", callback)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_run_after_fork)


def transport_visibility_timeout(app: Any) -> float | None:
    """The broker's visibility timeout in seconds, for transports that redeliver unacknowledged
    messages after it (Redis, SQS); None for those that do not (AMQP) or when it cannot be told.

    A message the worker holds longer than this (waiting for its countdown, say) is handed out
    again while still held: every countdown the library sets stays below it.
    """
    try:
        url = str(app.conf.broker_url or "")
        scheme = url.split("://", 1)[0].split("+", 1)[0].lower() if "://" in url else url.lower()
        if scheme not in ("redis", "rediss", "sentinel", "sqs"):
            return None
        options = app.conf.broker_transport_options or {}
        value = options.get("visibility_timeout")
        if value is None:  # kombu's defaults: the Redis transport's, and SQS's own (a queue's may differ)
            return 1800.0 if scheme == "sqs" else 3600.0
        return float(value)
    except Exception:  # an unusual conf object: no cap rather than a crash on the task path
        return None


# -- log lines: what an outsider's text may not do to them --

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def quoted(text: str) -> str:
    """``text`` in double quotes, with quotes, backslashes and every unprintable character escaped."""
    return '"' + "".join(_ESCAPES.get(c) or (c if c.isprintable() else f"\\x{ord(c):02x}") for c in text) + '"'


def logsafe(value: object) -> str:
    """``value`` as a log or audit line may show it: as it is when it is printable text without quotes or
    backslashes, else :func:`quoted` (so it spans one line and cannot pass for a line of its own).

    Every value a log call takes from outside the library's own code (keys, task names and ids, message
    ids, event types, user names, texts quoted from a webhook or a store) goes through it: a newline in
    one would otherwise write a second, well-formed line saying whatever its author chose.
    """
    text = str(value)
    if text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return quoted(text)
