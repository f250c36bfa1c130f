"""Re-drive what the broker forgot, in every worker whose app has an idempotent task (docs/deployment.md,
"Re-drive, on by default"): :func:`sweep_stranded` republishes claims nobody will come back for, from their
stored first payload under their own key (a live lease is never touched); :func:`restore_unacked_on_a_timer`
restores a Redis broker's unacked messages in workers with no kombu event loop (celery/celery#4968).
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from celery.signals import worker_init, worker_ready, worker_shutdown

from ._common import logsafe, transport_visibility_timeout
from .config import Settings
from .errors import IdemmailError, LedgerError
from .keys import Payload
from .ledger import ClaimRequest, Ledger, Record, State
from .ledger.base import new_owner
from .ledger.sealed import is_sealed
from .task import IdempotentTask

log = logging.getLogger("idemmail_celery")

SWEEP_TASK = "idemmail_celery.sweep_stranded"
#: The ledger key of the sweep's own lease (a hash, like every key): one sweeper at a time per ledger.
LOCK_KEY = hashlib.sha256(b"idemmail_celery:sweep-lock").hexdigest()
#: Most claims one sweep republishes (the rest wait for the next sweep).
SWEEP_LIMIT = 1000
#: The sweep's lease, renewed every third of it: a sweeper killed mid-sweep holds the sweeps up no longer.
LOCK_LEASE_SECONDS = 60.0
#: The least derived ``idemmail_sweep_after_seconds``, so the sweep never races the broker's own redelivery.
MIN_SWEEP_AFTER = 300.0
#: The longest period between two sweeps of one ledger by the workers.
MAX_SWEEP_EVERY = 900.0

_REDIS_SCHEMES = ("redis", "rediss", "sentinel")
#: kombu's Redis transport defaults: seconds between restores, and how many calls make one scan.
_KOMBU_RESTORE_INTERVAL, _KOMBU_RESTORE_THROTTLE = 10.0, 10.0


@dataclass
class _Swept:
    """One ledger and the idempotent tasks that claim in it, with its sweep's age and period."""

    ledger: Ledger
    tasks: dict[str, IdempotentTask] = field(default_factory=dict)
    after: float = MIN_SWEEP_AFTER

    @property
    def every(self) -> float:
        return min(max(self.after / 4, 1.0), MAX_SWEEP_EVERY)


def _by_ledger(app: Any) -> list[_Swept]:
    """``app``'s idempotent tasks by ledger, each ledger with its age (:func:`stranded_after`)."""
    groups: dict[int, _Swept] = {}
    for task in list(app.tasks.values()):
        if isinstance(task, IdempotentTask):
            try:
                ledger = task.ledger
            except IdemmailError as exc:  # its ledger cannot be opened here (a missing driver, bad settings)
                log.warning("idemmail: the sweep skips %s, whose ledger cannot be opened (%s)", logsafe(task.name),
                            type(exc).__name__)
                continue
            groups.setdefault(id(ledger), _Swept(ledger)).tasks[task.name] = task
    for group in groups.values():
        group.after = stranded_after(app, group.tasks.values())
    return list(groups.values())


def _redis_broker(app: Any) -> bool:
    return str(app.conf.broker_url or "").split("://", 1)[0].split("+", 1)[0].lower() in _REDIS_SCHEMES


def _transport_option(app: Any, name: str, default: float) -> float:
    return float((app.conf.broker_transport_options or {}).get(name) or default)


def stranded_after(app: Any, tasks: Iterable[IdempotentTask]) -> float:
    """How long a claim of ``tasks`` must have been quiet past its lease before the sweep re-drives it
    (``idemmail_sweep_after_seconds``, or derived: docs/deployment.md, "Re-drive, on by default")."""
    settings = Settings.resolve(app.conf)
    if settings.sweep_after_seconds is not None:
        return settings.sweep_after_seconds
    longest = redelivered_after(app)
    for task in tasks:
        try:
            policy = task.policy
        except IdemmailError:  # its settings do not parse: its start-up check says so
            continue
        longest = max(longest, policy.inflight_backoff_max, policy.retry_backoff_max)
    return max(MIN_SWEEP_AFTER, 2 * longest)


def redelivered_after(app: Any, *, event_loop: bool = True) -> float:
    """How long after a worker dies, at the most, the broker hands the messages it held out again: the
    visibility timeout (Redis, SQS), plus on Redis the :func:`restore_period`. 0 for a broker that requeues
    them when the worker's connection drops (AMQP)."""
    longest = transport_visibility_timeout(app) or 0.0
    if longest and _redis_broker(app):
        longest += restore_period(app, event_loop=event_loop)
    return longest


def restore_period(app: Any, *, event_loop: bool = True) -> float:
    """Seconds between two scans that restore a Redis broker's unacked messages: kombu's event loop scans every
    ``unacked_restore_interval`` x ``unacked_restore_throttle``, the library's timer in a worker without one
    every ``unacked_restore_interval``."""
    period = _transport_option(app, "unacked_restore_interval", _KOMBU_RESTORE_INTERVAL)
    if event_loop:
        period *= _transport_option(app, "unacked_restore_throttle", _KOMBU_RESTORE_THROTTLE)
    return period


def sweep_stranded(app: Any, *, after_seconds: float | None = None, now: float | None = None,
                   limit: int = SWEEP_LIMIT) -> list[str]:
    """Republish (at most once per ``after_seconds``) each claim of ``app``'s idempotent tasks whose lease ran out,
    and that was last moved, over ``after_seconds`` ago (None: each ledger's :func:`stranded_after`); their keys."""
    now = time.time() if now is None else now
    republished: list[str] = []
    for group in _by_ledger(app):
        after = group.after if after_seconds is None else after_seconds
        republished += _sweep_guarded(group, after, now, limit - len(republished))
    return republished


def _sweep_guarded(group: _Swept, after: float, now: float, limit: int) -> list[str]:
    """:func:`_sweep_ledger`, a ledger that does not answer logged and skipped."""
    try:
        return _sweep_ledger(group.ledger, group.tasks, after, now, limit)
    except LedgerError as exc:  # one ledger down (a task of another service, say) stops no other's sweep
        log.warning("idemmail: the sweep skips a ledger that does not answer (%s: %s); it is looked at again "
                    "next time", type(exc).__name__, logsafe(exc))
        return []


def _sweep_ledger(ledger: Ledger, tasks: dict[str, IdempotentTask], after_seconds: float, now: float,
                  limit: int) -> list[str]:
    """:func:`sweep_stranded` on one ledger, under its sweep lease (none if another sweeper holds it)."""
    republished: list[str] = []
    lock = ledger.claim(ClaimRequest(key=LOCK_KEY, task_name=SWEEP_TASK, payload=Payload([], {}).to_json(),
                                     fingerprint="", owner=new_owner("sweep"), lease_seconds=LOCK_LEASE_SECONDS))
    if not lock.status.holds:
        return republished  # another sweeper has this ledger
    renewed = time.monotonic()
    try:
        for record in ledger.iter_records(State.CLAIMED):
            if len(republished) >= limit:
                break
            if time.monotonic() - renewed > LOCK_LEASE_SECONDS / 3:
                if not ledger.renew(LOCK_KEY, lock.token, LOCK_LEASE_SECONDS):
                    break  # taken over (this sweep stalled past its lease): the new holder goes on
                renewed = time.monotonic()
            task = tasks.get(record.task_name)
            if task is None or record.key == LOCK_KEY or not _stranded(record, after_seconds, now):
                continue
            if not record.payload or is_sealed(record.payload):
                log.warning("idemmail: claim %s is stranded and has no payload this process can read; "
                            "resolve it by hand (idemmail ledger resolve)", logsafe(record.key))
                continue
            # Read again: the listing may be minutes old, and a holder may have renewed (or settled) since.
            fresh = ledger.get(record.key)
            if fresh is None or fresh.token != record.token or not _stranded(fresh, after_seconds, now):
                continue
            if ledger.mark_hop(record.key, "sweep", after_seconds) is False:
                continue  # republished by a sweep not long ago
            first = Payload.from_json(record.payload)
            task.apply_async(list(first.args), dict(first.kwargs), headers=task.key_headers(record.key, first))
            log.warning("idemmail: claim %s of %s had no holder for %.0f s: republished from its first payload",
                        logsafe(record.key), logsafe(record.task_name),
                        now - max(fresh.lease_expires_at or 0.0, fresh.updated_at))
            republished.append(record.key)
    finally:
        _unlock(ledger, lock.token)
    return republished


def _stranded(record: Record, after_seconds: float, now: float) -> bool:
    """Is ``record`` a claim whose lease ran out, and that nothing moved, more than ``after_seconds`` before
    ``now``? Never one whose lease is live, whatever ``after_seconds``."""
    if record.state is not State.CLAIMED:
        return False
    expires = record.lease_expires_at or 0.0
    return expires <= now and now - max(expires, record.updated_at) >= after_seconds


def _unlock(ledger: Ledger, token: int) -> None:
    """End the sweep's lease leaving no record behind (``ledger stats`` counts records), else release it."""
    try:
        ledger.withdraw(LOCK_KEY, token)  # False: taken over meanwhile, and the new holder ends it
    except NotImplementedError:
        ledger.release(LOCK_KEY, token)


def _sweep(self: Any) -> int:
    """What a beat entry for :data:`SWEEP_TASK` runs: :func:`sweep_stranded` over this app's ledgers."""
    return len(sweep_stranded(self.app))


# -- what runs in the worker, on timers --

def _repeat(name: str, wait: Callable[[], float], tick: Callable[[], None],
            done: Callable[[], None] = lambda: None) -> threading.Event:
    """Run ``tick`` every ``wait()`` seconds in a daemon thread (a greenlet under gevent), then ``done``;
    set the returned event to stop."""
    stop = threading.Event()

    def run() -> None:
        try:
            while not stop.wait(wait()):
                tick()
        finally:
            done()

    threading.Thread(target=run, name=name, daemon=True).start()
    return stop


def restore_unacked(app: Any, connection: Any, lock_seconds: float) -> None:
    """One pass of the Redis transport's ``restore_visible`` over ``connection``, as kombu's event loop does it,
    its lock held ``lock_seconds`` at most unless ``unacked_mutex_expire`` is set (:func:`bound_restore_lock`)."""
    options = app.conf.broker_transport_options or {}
    qos = connection.default_channel.qos
    if options.get("unacked_mutex_expire") is None:
        qos.unacked_mutex_expire = lock_seconds
    limit = options.get("unacked_restore_limit")
    qos.restore_visible(num=int(limit) if limit else None, interval=1)


def restore_unacked_on_a_timer(app: Any, interval: float) -> threading.Event:
    """Run :func:`restore_unacked` every ``interval`` seconds on a connection of its own (kombu's own lock keeps
    it to one worker at a time, held one interval at most); set the returned event to stop."""
    conn = [app.connection_for_read()]

    def tick() -> None:
        try:
            conn[0].ensure_connection(max_retries=1)
            restore_unacked(app, conn[0], interval)
        except Exception as exc:  # the broker is away: the next tick tries again
            log.warning("idemmail: restoring unacked messages failed (%s); retrying in %.0f s",
                        type(exc).__name__, interval)
            conn[0].release()
            conn[0] = app.connection_for_read()

    return _repeat("idemmail-restore-unacked", lambda: interval, tick, lambda: conn[0].release())


def _sweep_on_a_timer(groups: list[_Swept]) -> threading.Event:
    """Sweep each of ``groups``' ledgers about once per its period (:func:`_sweep_round`); set the event to stop."""
    shortest = min(group.every for group in groups)
    # Each worker waits half to all of the period: twenty workers started together do not all ask at once.
    return _repeat("idemmail-sweep-stranded", lambda: shortest * random.uniform(0.5, 1.0),
                   lambda: _sweep_round(groups))


def _sweep_round(groups: list[_Swept]) -> None:
    """One tick of a worker's sweep timer: each ledger whose round this worker takes is swept."""
    for group in groups:
        try:
            if group.ledger.mark_hop(LOCK_KEY, "round", group.every) is False:
                continue  # another worker took this round
        except LedgerError:
            continue  # down: looked at again next tick
        swept = _sweep_guarded(group, group.after, time.time(), SWEEP_LIMIT)
        log.info("idemmail: this worker swept a ledger for stranded claims: %d republished", len(swept))


_timers: list[threading.Event] = []


def _idempotent(app: Any) -> bool:
    return any(isinstance(task, IdempotentTask) for task in list(app.tasks.values()))


def _on_init(sender: Any = None, **_: Any) -> None:
    """``worker_init``: register :data:`SWEEP_TASK` and :func:`bound_restore_lock` in a worker of idempotent tasks."""
    app = getattr(sender, "app", None)
    if app is None or not _idempotent(app):
        return
    if SWEEP_TASK not in app.tasks:
        app.task(name=SWEEP_TASK, bind=True, ignore_result=True, shared=False)(_sweep)
    # Before the consumer connects: its connection takes the transport options as they are now.
    bound_restore_lock(app, event_loop=bool(getattr(sender, "use_eventloop", True)))


def bound_restore_lock(app: Any, *, event_loop: bool) -> None:
    """Unless ``unacked_mutex_expire`` is set (or ``idemmail_restore_unacked`` is off), set it to one restore
    period (:func:`restore_period`, 1 s at least) on a Redis broker. kombu's default 300 s lets a worker killed
    mid-scan stop every restore that long; overlapping scans restore each message once all the same."""
    try:
        settings = Settings.resolve(app.conf)
    except IdemmailError:  # the start-up check says what is wrong
        return
    options = dict(app.conf.broker_transport_options or {})
    if not settings.restore_unacked or not _redis_broker(app) or options.get("unacked_mutex_expire") is not None:
        return
    options["unacked_mutex_expire"] = max(1.0, restore_period(app, event_loop=event_loop))
    app.conf.broker_transport_options = options


def _on_ready(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` (the consumer, in the worker's main process): start what the settings leave on."""
    app = getattr(sender, "app", None)
    if app is None or not _idempotent(app):
        return
    try:
        settings = Settings.resolve(app.conf)
    except IdemmailError:  # the start-up check says what is wrong
        return
    # kombu restores from its event loop (the consumer's hub); a worker without one never does.
    if settings.restore_unacked and _redis_broker(app) and getattr(sender, "hub", None) is None:
        interval = _transport_option(app, "unacked_restore_interval", _KOMBU_RESTORE_INTERVAL)
        _timers.append(restore_unacked_on_a_timer(app, interval))
        log.info("idemmail: this worker runs no event loop: it restores the Redis broker's unacked messages "
                 "every %.0f s", interval)
    if settings.sweep_in_workers:
        groups = _by_ledger(app)
        if groups:
            _timers.append(_sweep_on_a_timer(groups))
            log.info("idemmail: this worker takes its turn sweeping for claims stranded over %.0f s",
                     min(group.after for group in groups))


def _on_shutdown(**_: Any) -> None:
    while _timers:
        _timers.pop().set()


worker_init.connect(_on_init, weak=False)
worker_ready.connect(_on_ready, weak=False)
worker_shutdown.connect(_on_shutdown, weak=False)
