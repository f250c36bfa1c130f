"""What each run of an idempotent task came to, told to the log, to Flower and to metrics.

:func:`report` writes a ``logfmt`` line on the ``idemmail_celery.outcome`` logger, sends a ``task-idemmail`` event
for outcomes whose task does not succeed, and counts it in :mod:`idemmail_celery.metrics` (see docs/operations.md).
Reports never carry an address, a subject or a payload.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from celery.signals import worker_init

from . import metrics
from ._common import after_fork, logsafe, quoted
from ._request import RequestState, state_of
from .config import Settings
from .handler import RETRY_DEADLINE, Outcome
from .ledger import passive_options, shared

log = logging.getLogger("idemmail_celery.outcome")

EVENT = "task-idemmail"

_WARN = {Outcome.REVIEW, Outcome.FAILED, Outcome.IN_FLIGHT_GAVE_UP, Outcome.KEY_REUSE, Outcome.FAIL_OPEN,
         Outcome.SETUP_ERROR}
_ERROR = {Outcome.LEDGER_GAVE_UP}
#: Outcomes whose task ends in FAILURE or RETRY: a task that succeeds carries its outcome as its result.
_EVENTFUL = {Outcome.REVIEW, Outcome.FAILED, Outcome.RETRY, Outcome.IN_FLIGHT, Outcome.IN_FLIGHT_GAVE_UP,
             Outcome.LEDGER_UNAVAILABLE, Outcome.LEDGER_GAVE_UP, Outcome.KEY_REUSE, Outcome.SETUP_ERROR}
#: Outcomes whose task ends in SUCCESS (a fail_open run is never recorded: it has its event already).
_SUCCESS = {Outcome.SENT, Outcome.DUPLICATE}
_REASON = re.compile(r"[a-z0-9_]{1,40}(,[a-z0-9_]{1,40})*")


class _Worker:
    #: Does this worker send task events (``-E``)? Set on ``worker_init``, inherited by pool children.
    task_events = False


def report(task: Any, status: Outcome | str, key: str, *, message_id: Any = None, reason: str | None = None,
           event: bool = True, **extra: Any) -> None:
    """Tell the log, Flower and metrics what this run of ``task`` came to (never raises). ``extra``: short,
    non-personal fields; ``recorded`` is the state a duplicate replays, or ``False`` (``"false"``) when the ledger
    lacks the outcome. ``event=False``: no ``task-idemmail`` event."""
    status = Outcome(status)
    if extra.get("recorded") in (False, "false"):
        extra["recorded"] = False  # one type for "not recorded" wherever a report is read
    request = task.request
    attempts = (request.retries or 0) + 1
    message_id = None if message_id is None else str(message_id)
    reason = None if reason is None else clean_reason(reason)
    unrecorded = extra.get("recorded") is False
    try:
        level = _level(status, unrecorded, reason, routine=event and reason is None and _routine(status, extra))
        if log.isEnabledFor(level):
            _log(level, status, task.name, key, request.id, message_id, reason, attempts, extra)
        _count(task.name, status, reason, unrecorded=unrecorded)
        if event and _Worker.task_events and request.hostname:
            _maybe_event(task, status, key, message_id, reason, attempts, extra)
    except Exception:  # pragma: no cover - a broken handler or broker must not change the outcome
        log.debug("idemmail: reporting %s for %s failed", status, logsafe(key), exc_info=True)


def _routine(status: Outcome, extra: dict[str, Any]) -> bool:
    """Is this a success Celery's own "succeeded" line already shows (a recorded send, a replayed send)?"""
    if status is Outcome.SENT:
        return extra.get("recorded") is not False
    return status is Outcome.DUPLICATE and extra.get("recorded") == "sent"


def _count(name: str, status: Outcome, reason: str | None, *, unrecorded: bool) -> None:
    active = metrics.active
    if active is None:
        return
    if status is Outcome.RECLAIMED:  # a step, not an outcome: the run goes on to one (counted once)
        active.reclaimed(name)
        return
    active.outcome(name, status.value)
    if status is Outcome.FAILED:
        active.failed(name, reason or "other")
    if unrecorded:
        active.unrecorded(name, status.value, reason or "other")


def _maybe_event(task: Any, status: Outcome, key: str, message_id: str | None, reason: str | None,
                 attempts: int, extra: dict[str, Any]) -> None:
    """Send a ``task-idemmail`` event when Flower needs one (on a worker that sends task events)."""
    recorded = extra.get("recorded")
    replayed_failure = status is Outcome.DUPLICATE and recorded in ("failed", "review")
    if status in _EVENTFUL or recorded is False or replayed_failure:
        _event(task, status, key, message_id, reason, attempts, extra)
    elif status in _SUCCESS and (state_of(task.request, create=False) or RequestState()).rescheduled:
        # Flower keeps an earlier task-retried event's exception after the task succeeds: this event clears it.
        _event(task, status, key, message_id, reason, attempts, extra, clear_exception=True)


def clean_reason(reason: Any) -> str:
    """A reason word as reports carry it: ``[a-z0-9_]{1,40}`` (comma-joined allowed), else ``other`` (free text
    from providers and task code could carry an address or forge a log line)."""
    text = str(reason)
    return text if _REASON.fullmatch(text) else "other"


def _level(status: Outcome, unrecorded: bool, reason: str | None, *, routine: bool) -> int:
    if routine:
        return logging.DEBUG  # Celery's "succeeded" line shows this outcome: the task's result is it
    if status in _ERROR or (unrecorded and status is Outcome.SENT) or (
            status is Outcome.FAILED and reason == RETRY_DEADLINE):
        return logging.ERROR  # dropped, undeliverable for hours, or sent and the ledger does not know it (maybe twice)
    if status in _WARN or unrecorded:
        return logging.WARNING
    return logging.INFO


def _log(level: int, status: Outcome, name: str, key: str, task_id: str | None, message_id: str | None,
         reason: str | None, attempts: int, extra: dict[str, Any]) -> None:
    reasons = {"reason": reason} if reason else {}
    fields: dict[str, Any] = {"status": status.value, "task": name, "key": key, "message_id": message_id,
                              "task_id": task_id, "attempts": attempts, **reasons, **extra}
    line = " ".join(f"{k}={'false' if k == 'recorded' and v is False else _logfmt(v)}" for k, v in fields.items())
    log.log(level, "idemmail outcome %s", line, extra={"idemmail": fields})


def _logfmt(value: Any) -> str:
    """One logfmt value: quoted and escaped when needed, never spanning lines (no forged log lines)."""
    if value is None:
        return "-"
    text = str(value)
    return quoted(text) if not text or " " in text or "=" in text else logsafe(text)


def _event(task: Any, status: Outcome, key: str, message_id: str | None, reason: str | None, attempts: int,
           extra: dict[str, Any], *, clear_exception: bool = False) -> None:
    request = task.request
    fields = {"status": status.value, "key": key, "message_id": message_id, "reason": reason, "attempts": attempts,
              **extra}
    if clear_exception:  # a success: task-succeeded brings the result; the retry's exception goes
        fields.update(exception=None, traceback=None)
    else:  # "result": the one field of Celery's own that Flower lists and an event may fill
        reasons = {"reason": reason} if reason else {}
        fields["result"] = repr({"status": status.value, "key": key, "message_id": message_id, **reasons, **extra})
    _Events.send(task.app, request.hostname, request.id, fields)


class _Events:
    """One event dispatcher per process, shared under a lock; a forked child drops (never closes) its parent's."""

    lock = threading.Lock()
    dispatcher: Any = None
    hostname: str | None = None

    @classmethod
    def send(cls, app: Any, hostname: str, task_id: str | None, fields: dict[str, Any]) -> None:
        with cls.lock:
            if cls.dispatcher is None or cls.hostname != hostname:
                cls.dispatcher = app.events.Dispatcher(app.connection_for_write(), hostname=hostname, enabled=True,
                                                       buffer_while_offline=False)
                cls.hostname = hostname
            try:
                cls.dispatcher.send(EVENT, uuid=task_id, retry=False, **fields)
            except Exception:
                cls.dispatcher = None  # a broken connection: the next event builds a new one
                raise

    @classmethod
    def after_fork(cls) -> None:
        cls.lock, cls.dispatcher = threading.Lock(), None


after_fork(_Events.after_fork)


def _on_worker_init(sender: Any = None, **_: Any) -> None:
    _Worker.task_events = bool(getattr(sender, "task_events", False))
    app = getattr(sender, "app", None)
    if app is not None:
        configure_metrics(app, sender)


def configure_metrics(app: Any, worker: Any) -> None:
    """On ``worker_init``: turn metrics on and serve ``/metrics`` as the app's settings say (never raises)."""
    try:
        settings = Settings.resolve(app.conf)
    except Exception as exc:  # a bad setting elsewhere is the task's to report; metrics stay off
        log.error("idemmail metrics: settings could not be read (%s); metrics are OFF for this worker", logsafe(exc))
        return
    port = settings.metrics_port
    pool = str(getattr(worker, "pool_cls", "") or "")
    if not (settings.metrics or port) or not metrics.prepare_worker(port=port, pool=pool):
        return
    if port:
        try:
            metrics.serve(port, settings.metrics_addr, app_ledger(app))
        except Exception as exc:
            log.error("idemmail metrics: cannot serve /metrics on port %d: %s", port, logsafe(exc))


def app_ledger(app: Any) -> Callable[[], Any]:
    """The app's ledger as the metrics endpoint reads it: opened passive (a scrape never writes the loss markers)."""
    def ledger() -> Any:
        s = Settings.resolve(app.conf, None)
        return shared(s.ledger_url, {**s.ledger_kwargs(), **passive_options(s.ledger_url)})

    return ledger


worker_init.connect(_on_worker_init, weak=False)
