"""Re-drive what the broker forgot: claims nobody will come back for, and a green pool's unacked messages.

A claim is held by the delivery that made it; if that worker dies, the broker hands the message
out again (RabbitMQ at once, the Redis transport after its visibility timeout) and the next
delivery takes the claim over. Two things break that promise:

* a broker that lost the message (a Redis broker restarted without persistence, a queue purged,
  a message stuck in the Redis transport's ``unacked`` set while only green-pool workers run:
  celery/celery#4968, #4976), or the chain's only copy acknowledged by a defect. The ledger still
  has the claim and its first payload. :func:`sweep_stranded` republishes each claim whose lease
  ran out more than ``idemmail_sweep_after_seconds`` ago with no sign of life since (no renewal,
  no move), from its stored first payload and under its own key. The republished message meets
  the claim as any late copy would: it takes it over (sent again with the key where the provider
  de-duplicates on it; reconciled, or parked for review, where it does not), or finds it settled.
  Run it from beat (:data:`SWEEP_TASK`); one sweeper at a time per ledger, by a lease in the ledger.
* a worker whose pool does not run kombu's event loop (``-P gevent``, ``eventlet``, ``threads``) on
  a Redis broker never runs the transport's ``restore_visible``: messages of a killed worker stay
  unacked until a prefork or solo worker starts. :func:`restore_unacked_on_a_timer` runs it from
  a daemon thread (a greenlet under gevent) in such workers, every ``unacked_restore_interval``.

Import this module in the worker (``include=["idemmail_celery.redrive"]``) to register both.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

from celery import Task, current_app, shared_task
from celery.signals import worker_ready, worker_shutdown

from ._common import logsafe
from .config import Settings
from .errors import IdemmailError, LedgerError
from .keys import Payload
from .ledger import ClaimRequest, Ledger, State
from .ledger.base import new_owner
from .ledger.sealed import is_sealed
from .task import IdempotentTask

log = logging.getLogger("idemmail_celery")

SWEEP_TASK = "idemmail_celery.sweep_stranded"
#: The ledger key of the sweep's own lease (a hash, like every key): one sweeper at a time per ledger.
LOCK_KEY = hashlib.sha256(b"idemmail_celery:sweep-lock").hexdigest()
#: Most claims one sweep republishes (the rest wait for the next sweep).
SWEEP_LIMIT = 1000


def sweep_stranded(app: Any, *, after_seconds: float, now: float | None = None,
                   limit: int = SWEEP_LIMIT) -> list[str]:
    """Republish every stranded claim of ``app``'s idempotent tasks; returns their keys.

    A claim is stranded when its lease ran out, and it was last moved, more than ``after_seconds``
    ago: longer than any reschedule of a live chain waits (keep it above the broker's visibility
    timeout, ``idemmail_inflight_backoff_max`` and ``idemmail_retry_backoff_max``). A claim with no
    stored payload (erased, or sealed with keys this process lacks) is logged and left. Each claim is
    republished at most once per ``after_seconds`` (``Ledger.mark_hop``), whoever sweeps.
    """
    now = time.time() if now is None else now
    ledgers: dict[int, tuple[Ledger, dict[str, IdempotentTask]]] = {}
    for task in list(app.tasks.values()):
        if isinstance(task, IdempotentTask):
            try:
                ledger = task.ledger
            except IdemmailError as exc:  # its ledger cannot be opened here (a missing driver, bad settings)
                log.warning("idemmail: the sweep skips %s, whose ledger cannot be opened (%s)", logsafe(task.name),
                            type(exc).__name__)
                continue
            ledgers.setdefault(id(ledger), (ledger, {}))[1][task.name] = task
    republished: list[str] = []
    for ledger, tasks in ledgers.values():
        try:
            republished += _sweep_ledger(ledger, tasks, after_seconds, now, limit - len(republished))
        except LedgerError as exc:  # one ledger down (a task of another service, say) stops no other's sweep
            log.warning("idemmail: the sweep skips a ledger that does not answer (%s: %s); it is looked at again "
                        "next time", type(exc).__name__, logsafe(exc))
    return republished


def _sweep_ledger(ledger: Ledger, tasks: dict[str, IdempotentTask], after_seconds: float, now: float,
                  limit: int) -> list[str]:
    """:func:`sweep_stranded` on one ledger, under its sweep lock (none if another sweeper holds it)."""
    republished: list[str] = []
    lock = ledger.claim(ClaimRequest(key=LOCK_KEY, task_name=SWEEP_TASK, payload=Payload([], {}).to_json(),
                                     fingerprint="", owner=new_owner("sweep"), lease_seconds=300.0))
    if not lock.status.holds:
        return republished  # another sweeper has this ledger
    try:
        for record in ledger.iter_records(State.CLAIMED):
            if len(republished) >= limit:
                break
            task = tasks.get(record.task_name)
            quiet = now - max(record.lease_expires_at or 0.0, record.updated_at)
            if task is None or record.key == LOCK_KEY or quiet < after_seconds:
                continue
            if not record.payload or is_sealed(record.payload):
                log.warning("idemmail: claim %s is stranded and has no payload this process can read; "
                            "resolve it by hand (idemmail ledger resolve)", logsafe(record.key))
                continue
            if ledger.mark_hop(record.key, "sweep", after_seconds) is False:
                continue  # republished by a sweep not long ago
            first = Payload.from_json(record.payload)
            task.apply_async(list(first.args), dict(first.kwargs), headers=task.key_headers(record.key, first))
            log.warning("idemmail: claim %s of %s had no holder for %.0f s: republished from its first payload",
                        logsafe(record.key), logsafe(record.task_name), quiet)
            republished.append(record.key)
    finally:
        ledger.release(LOCK_KEY, lock.token)
    return republished


def _sweep() -> int:
    """Beat runs this (say every five minutes): :func:`sweep_stranded` with ``idemmail_sweep_after_seconds``."""
    app = current_app._get_current_object()
    settings = Settings.resolve(app.conf)
    return len(sweep_stranded(app, after_seconds=settings.sweep_after_seconds))


sweep_stranded_task: Task = shared_task(name=SWEEP_TASK, ignore_result=True)(_sweep)


# -- the Redis transport's restore, for pools without kombu's event loop --

#: The pools (by module: ``celery.concurrency.<name>``) that do not run kombu's event loop.
GREEN_POOLS = ("gevent", "eventlet", "thread")
_restorers: list[threading.Event] = []


def restore_unacked_on_a_timer(app: Any, interval: float) -> threading.Event:
    """Run the Redis transport's ``restore_visible`` every ``interval`` seconds on a connection of its own
    (kombu's own mutex keeps it to one worker at a time); set the returned event to stop."""
    stop = threading.Event()

    def run() -> None:
        conn = app.connection_for_read()
        try:
            while not stop.wait(interval):
                try:
                    conn.ensure_connection(max_retries=1)
                    options = app.conf.broker_transport_options or {}
                    qos = conn.default_channel.qos
                    qos.restore_visible(num=int(options.get("unacked_restore_limit", 10) or 10), interval=1)
                except Exception as exc:  # the broker is away: the next tick tries again
                    log.warning("idemmail: restoring unacked messages failed (%s); retrying in %.0f s",
                                type(exc).__name__, interval)
                    conn.release()
                    conn = app.connection_for_read()
        finally:
            conn.release()

    threading.Thread(target=run, name="idemmail-restore-unacked", daemon=True).start()
    return stop


def _pool_name(worker: Any) -> str:
    pool = getattr(worker, "pool", None) or getattr(getattr(worker, "controller", None), "pool", None)
    return type(pool).__module__.rsplit(".", 1)[-1] if pool is not None else ""


def _on_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    scheme = str(app.conf.broker_url or "").split("://", 1)[0].split("+", 1)[0].lower()
    if scheme not in ("redis", "rediss", "sentinel") or _pool_name(sender) not in GREEN_POOLS:
        return
    options = app.conf.broker_transport_options or {}
    interval = float(options.get("unacked_restore_interval") or 10)
    _restorers.append(restore_unacked_on_a_timer(app, interval))
    log.info("idemmail: this %s worker restores the Redis broker's unacked messages every %.0f s",
             _pool_name(sender), interval)


def _on_shutdown(**_: Any) -> None:
    while _restorers:
        _restorers.pop().set()


worker_ready.connect(_on_ready, weak=False)
worker_shutdown.connect(_on_shutdown, weak=False)
