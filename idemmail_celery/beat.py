"""Scheduled digests keyed by the schedule slot they were *due* for, never by the clock of whoever runs them
(docs/outbox-and-digests.md, "Scheduled digests"): :class:`SlotScheduler` (or :class:`SlotMixin`) sends the
due time as the ``idemmail_slot`` header, :func:`slot_of` names the slot in the task, :class:`aligned` is an
interval schedule every beat agrees on, :func:`send_digest` fans out one key per (recipient, slot).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from celery import Celery
from celery.beat import PersistentScheduler
from celery.schedules import schedstate, schedule

from ._common import logsafe
from .chain import KEY_HEADER, SLOT_HEADER
from .errors import InvalidEmail, SlotMissingError
from .keys import untrusted_removed
from .redaction import scrub
from .task import first_run_time

log = logging.getLogger("idemmail_celery")

__all__ = [
    "PERIODS", "SLOT_HEADER", "SlotMissingError", "SlotMixin", "SlotScheduler", "aligned", "due_time", "format_slot",
    "send_digest", "slot_of",
]


#: Slot periods :func:`slot_of` and :func:`format_slot` know, and how each is written.
PERIODS: Mapping[str, str] = {
    "second": "%Y-%m-%dT%H:%M:%S",
    "minute": "%Y-%m-%dT%H:%M",
    "hour": "%Y-%m-%dT%H",
    "day": "%Y-%m-%d",
    "week": "%G-W%V",  # ISO week: "2026-W47" (ISO year, so Dec 29 may be in week 1 of the next year)
    "month": "%Y-%m",
}


# -- the schedule --


class aligned(schedule):  # type: ignore[misc]  # lower case, like celery.schedules.schedule
    """An interval schedule due at whole multiples of ``seconds`` since the Unix epoch (plus ``offset``), so
    every beat agrees on the slots. Aligned to UTC: use ``crontab`` for calendar slots (days, weeks)."""

    def __init__(self, seconds: float | dt.timedelta = 60.0, offset: float = 0.0,
                 nowfun: Callable[[], dt.datetime] | None = None, app: Celery | None = None) -> None:
        period = seconds.total_seconds() if isinstance(seconds, dt.timedelta) else float(seconds)
        if not period > 0:
            raise ValueError("aligned(seconds=...) must be > 0")
        super().__init__(run_every=dt.timedelta(seconds=period), nowfun=nowfun, app=app)
        self.period = period
        self.offset = float(offset) % period

    def due_after(self, last_run_at: dt.datetime) -> dt.datetime:
        """The first due time strictly after ``last_run_at`` (aware, UTC)."""
        last = self.maybe_make_aware(last_run_at).timestamp()
        n = math.floor((last - self.offset) / self.period) + 1
        return dt.datetime.fromtimestamp(n * self.period + self.offset, dt.timezone.utc)

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        now: dt.datetime = self.maybe_make_aware(self.now())
        return self.due_after(last_run_at) - now

    def is_due(self, last_run_at: dt.datetime) -> Any:
        """``(is_due, seconds until the next check)``, as :meth:`celery.schedules.schedule.is_due`."""
        remaining = self.remaining_estimate(last_run_at).total_seconds()
        if remaining > 0:
            return schedstate(is_due=False, next=remaining)
        # Due: check again at the first boundary after now, however late this run is.
        now = self.maybe_make_aware(self.now())
        return schedstate(is_due=True, next=max((self.due_after(now) - now).total_seconds(), 0.0))

    def __repr__(self) -> str:
        offset = f", offset={self.offset:g}" if self.offset else ""
        return f"<aligned: every {self.period:g}s{offset}>"

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, aligned):
            return (self.period, self.offset) == (other.period, other.offset)
        return NotImplemented

    def __reduce__(self) -> tuple[Any, ...]:
        # The shelve of PersistentScheduler pickles entries with their schedules.
        return self.__class__, (self.period, self.offset, self.nowfun)


def due_time(entry: Any, tz: dt.tzinfo | None = None) -> dt.datetime:
    """When ``entry`` was (or will next be) due, from its schedule and ``last_run_at``: aware, in ``tz``
    (after an outage, the first slot missed: Celery runs the entry once, not once per missed slot)."""
    sched = entry.schedule
    # An entry that never ran (RedBeat stores no last run for a new one) is due for the next slot.
    last_run_at = entry.last_run_at or sched.now()
    if isinstance(sched, aligned):
        due: dt.datetime = sched.due_after(last_run_at)
    else:
        remaining = sched.remaining_estimate(last_run_at)
        # Read after the estimate: the time between the two reads can only move the slot later, never earlier.
        due = sched.maybe_make_aware(sched.now()) + remaining
    return due.astimezone(tz) if tz is not None else due


class SlotMixin:
    """Adds the ``idemmail_slot`` header (the entry's :func:`due_time` in the app's timezone, ISO) to every
    task a beat scheduler sends: put it first in the bases of any ``celery.beat.Scheduler`` subclass."""

    app: Celery

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        # Before reserving the entry, which moves last_run_at to now, and the slot with it.
        try:
            slot: str | None = due_time(entry, self.app.timezone).isoformat(timespec="milliseconds")
        except Exception:
            # Beat has already advanced the entry: not sending would lose this run silently.
            # Sent without a slot, a task using slot_of() fails loudly instead (SlotMissingError).
            log.exception("idemmail: cannot compute the due slot of beat entry %r; sending it without one",
                          getattr(entry, "name", entry))
            slot = None
        if advance:
            self.reserve(entry)  # type: ignore[attr-defined]
        # A copy of the options: the header must not be stored with the entry, and its headers dict must not
        # change (Scheduler.apply_async adds to it in place).
        stored = entry.options
        options = dict(stored or {})
        options["headers"] = {**(options.get("headers") or {}), **({SLOT_HEADER: slot} if slot else {})}
        entry.options = options
        try:
            return super().apply_async(entry, producer=producer, advance=False, **kwargs)  # type: ignore[misc]
        finally:
            entry.options = stored


class SlotScheduler(SlotMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler with the ``idemmail_slot`` header: ``beat -S idemmail_celery.beat:SlotScheduler``."""


# -- the task's side --


def format_slot(when: dt.datetime | dt.date, period: str = "day") -> str:
    """Name the ``period`` containing ``when``: ``"2026-11-21"`` (day), ``"2026-W47"`` (ISO week),
    ``"2026-11-21T08"`` (hour), ``"2026-11-21T08:05"`` (minute), ``"2026-11-21T08:05:03"`` (second),
    ``"2026-11"`` (month). An aware ``when`` is named in its own offset: pass it in your timezone."""
    return when.strftime(_format_of(period))


def _format_of(period: str) -> str:
    try:
        return PERIODS[period]
    except KeyError:
        raise ValueError(f"unknown slot period {period!r}; known: {', '.join(PERIODS)}") from None


def _parse_slot(text: str, period: str) -> str:
    """Check that ``text`` names a ``period`` exactly as :func:`format_slot` would; return it."""
    fmt = PERIODS[period]
    # A week needs a weekday to parse; Monday names the same ISO week.
    text_in, fmt_in = (text + "-1", fmt + "-%u") if period == "week" else (text, fmt)
    try:
        parsed: dt.datetime | None = dt.datetime.strptime(text_in, fmt_in)
    except ValueError:
        parsed = None
    if parsed is None or format_slot(parsed, period) != text:
        example = format_slot(dt.datetime(2026, 11, 21, 8, 5, 3), period)
        raise ValueError(f"slot {text!r} is not a {period} written like {example!r}: it would make another key")
    return text


def slot_of(request: Any, period: str = "day", *, slot: str | dt.datetime | dt.date | None = None) -> str:
    """The slot this run is for: from the ``idemmail_slot`` header beat sent, else the explicit ``slot`` (a
    string written as :func:`format_slot` writes it, or a datetime or date). Both, disagreeing: ``ValueError``;
    neither: :class:`SlotMissingError`, never the wall clock."""
    _format_of(period)  # an unknown period raises whatever the run carries
    explicit: str | None = None
    if isinstance(slot, str):
        explicit = _parse_slot(slot, period)
    elif slot is not None:
        explicit = format_slot(slot, period)
    header = getattr(request, SLOT_HEADER, None) or (getattr(request, "headers", None) or {}).get(SLOT_HEADER)
    if header:
        from_beat = format_slot(dt.datetime.fromisoformat(str(header)), period)
        if explicit is not None and explicit != from_beat:
            raise ValueError(f"slot={explicit!r} disagrees with the slot beat sent ({from_beat!r})")
        return from_beat
    if explicit is None:
        raise SlotMissingError("no schedule slot: this run was not sent by a slot-aware beat scheduler "
                               "(idemmail_celery.beat:SlotScheduler or SlotMixin); a manual run must pass slot=...")
    return explicit


def send_digest(app: Celery, *, slot: str, recipients: Iterable[str], subject: str | Callable[[str, str], str],
                build_body: Callable[[str, str], Mapping[str, Any]], template: str = "digest",
                options: Mapping[str, Any] | None = None, **email: Any) -> dict[str, Any]:
    """Enqueue one ``send_email`` per recipient with ``event_id=f"{template}:{slot}"`` (docs/outbox-and-digests.md).

    ``subject`` is a string or ``subject(recipient, slot)``; ``email`` holds the other ``send_email`` keywords,
    the same for everyone; ``options`` go to ``apply_async``. Returns ``{"slot", "event_id", "enqueued",
    "invalid"}``, an invalid recipient skipped and named by its position, never by address."""
    from .mail import TASK_NAME

    if not slot:
        raise SlotMissingError("send_digest needs the slot (use slot_of(self.request, ...))")
    task = app.tasks[TASK_NAME]
    event_id = f"{template}:{slot}"
    options = dict(options or {})
    enqueued: list[str] = []
    invalid: list[dict[str, Any]] = []
    for position, recipient in enumerate(recipients):
        kwargs: dict[str, Any] = {**email, **build_body(recipient, slot), "to": recipient,
                                  "subject": subject(recipient, slot) if callable(subject) else subject,
                                  "event_id": event_id, "template": template}
        try:
            # Derived once here and sent as the header, so apply_async does not derive it again.
            due = first_run_time(task.app, options.get("countdown"), options.get("eta"))
            headers = task.intent_headers((), kwargs, due=due)
        except InvalidEmail as exc:
            # InvalidEmail never quotes the address; scrubbed all the same, as every text reaching a log.
            reason = scrub(str(exc), (str(recipient), *str(recipient).rpartition("@")[::2]))
            log.error("idemmail: digest %s: skipping recipient #%d: %s", logsafe(event_id), position, logsafe(reason))
            invalid.append({"position": position, "reason": reason})
            continue
        # A header only the library writes would break the key's seal: the intent under another key than returned.
        kept = untrusted_removed(options.get("headers") or {}, keep=())
        task.apply_async((), kwargs, **{**options, "headers": {**kept, **headers}})
        enqueued.append(headers[KEY_HEADER])
    return {"slot": slot, "event_id": event_id, "enqueued": enqueued, "invalid": invalid}
