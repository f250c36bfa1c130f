"""Scheduled digests keyed by their schedule slot, not by the clock of whoever runs them.

A daily digest's intent is "the digest for user X for day D". Beat can fire an
entry twice (two beat processes, a restart with an old schedule file), late (a
stalled beat wakes up in the next window) or a person re-triggers it; the key
must name the slot the schedule was *due* for, so every one of those runs gets
the same key and the next slot a new one. Celery 5.7 puts no scheduled time in
the message (only a ``celery_beat_task`` header), and ``BeatLazyFunc`` is
evaluated at send time, which is beat's ``now()``: a late beat would push it
into the next window.

* :class:`SlotScheduler` (``celery beat -S idemmail_celery.beat:SlotScheduler``)
  is Celery's default scheduler plus one header, ``idemmail_slot``: the time the
  entry was due, in the app's timezone, as an ISO timestamp. :class:`SlotMixin`
  adds the same to any other scheduler class (django-celery-beat, RedBeat).
* :func:`slot_of` turns the header into a slot name (``"2026-11-21"``,
  ``"2026-W47"``, ...) inside the task, or takes an explicit ``slot=`` for a
  manual run. It never falls back to the wall clock.
* :class:`aligned` is an interval schedule whose due times are multiples of its
  period since the epoch, so two beat processes agree on the slots (Celery's
  plain interval counts from each beat's own last run).
* :func:`send_digest` fans a digest out, one ``send_email`` per recipient under
  ``event_id=f"{template}:{slot}"``: one key per (recipient, slot), so a retried
  or doubled fan-out resends to nobody who already got theirs.

::

    @app.task(bind=True)
    def daily_digest(self, slot=None):
        day = slot_of(self.request, "day", slot=slot)     # "2026-11-21"
        send_digest(app, slot=day, recipients=subscribers(), subject=f"Your digest for {day}",
                    build_body=lambda to, day: {"html": render_digest(to, day)})

    app.conf.beat_schedule = {"daily-digest": {"task": "shop.daily_digest", "schedule": crontab(hour=7, minute=0)}}
    # celery -A shop beat -S idemmail_celery.beat:SlotScheduler
    # a manual re-run names its slot:  daily_digest.delay(slot="2026-11-21")
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
    "PERIODS",
    "SLOT_HEADER",
    "SlotMissingError",
    "SlotMixin",
    "SlotScheduler",
    "aligned",
    "due_time",
    "format_slot",
    "send_digest",
    "slot_of",
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
    """An interval schedule due at whole multiples of ``seconds`` since the Unix epoch (plus ``offset``).

    ``aligned(seconds=300)`` is due at :00, :05, :10, ... of every hour on every
    beat process, whenever each started, so two beats agree on the slot. Slots
    longer than an hour are aligned to UTC, not to local midnight: use
    ``crontab`` for calendar slots (days, weeks), and ``aligned`` for intervals.
    """

    def __init__(
        self,
        seconds: float | dt.timedelta = 60.0,
        offset: float = 0.0,
        nowfun: Callable[[], dt.datetime] | None = None,
        app: Celery | None = None,
    ) -> None:
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
    """When ``entry`` was (or will next be) due, from its schedule and ``last_run_at``: aware, in ``tz``.

    For a due or late entry this is at or before now. Schedules that know their
    exact due time (:class:`aligned`) are asked for it; for the others it is
    ``now + schedule.remaining_estimate(last_run_at)``, with ``now`` read *after*
    the estimate so the microseconds between the two reads can only move the
    result later, never into the previous slot. After an outage longer than one
    period this is the first slot that was missed: Celery runs the entry once,
    not once per missed slot.
    """
    sched = entry.schedule
    # An entry that never ran (RedBeat stores no last run for a new one) is due for the next slot.
    last_run_at = entry.last_run_at or sched.now()
    if isinstance(sched, aligned):
        due: dt.datetime = sched.due_after(last_run_at)
    else:
        remaining = sched.remaining_estimate(last_run_at)
        now = sched.maybe_make_aware(sched.now())
        due = now + remaining
    return due.astimezone(tz) if tz is not None else due


class SlotMixin:
    """Adds the ``idemmail_slot`` header to every task a beat scheduler sends.

    Put it first in the bases of any ``celery.beat.Scheduler`` subclass::

        class SlotDatabaseScheduler(SlotMixin, DatabaseScheduler): ...   # django-celery-beat
        class SlotRedBeatScheduler(SlotMixin, RedBeatScheduler): ...     # celery-redbeat

    The header is the entry's due time (:func:`due_time`) in the app's timezone,
    as an ISO timestamp with its UTC offset. Tasks read it with :func:`slot_of`.
    """

    app: Celery

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any) -> Any:
        # The due time comes from the entry as it stood before this run: reserving it
        # moves last_run_at to now, and the slot with it.
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
        # Send with a copy of the options: the header must not be stored with the
        # entry (the schedule file, the database row), and the entry's own headers
        # dict must not change (Scheduler.apply_async adds to it in place).
        stored = entry.options
        options = dict(stored or {})
        options["headers"] = {**(options.get("headers") or {}), **({SLOT_HEADER: slot} if slot else {})}
        entry.options = options
        try:
            return super().apply_async(entry, producer=producer, advance=False, **kwargs)  # type: ignore[misc]
        finally:
            entry.options = stored


class SlotScheduler(SlotMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (schedule kept in a shelve file) with the ``idemmail_slot`` header.

    ``celery -A proj beat -S idemmail_celery.beat:SlotScheduler``, or
    ``app.conf.beat_scheduler = "idemmail_celery.beat:SlotScheduler"``.
    """


# -- the task's side --


def format_slot(when: dt.datetime | dt.date, period: str = "day") -> str:
    """Name the ``period`` containing ``when``: ``"2026-11-21"`` (day), ``"2026-W47"`` (ISO week),
    ``"2026-11-21T08"`` (hour), ``"2026-11-21T08:05"`` (minute), ``"2026-11-21T08:05:03"`` (second),
    ``"2026-11"`` (month). An aware ``when`` is named in its own offset: pass it in your timezone."""
    try:
        fmt = PERIODS[period]
    except KeyError:
        raise ValueError(f"unknown slot period {period!r}; known: {', '.join(PERIODS)}") from None
    return when.strftime(fmt)


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


def slot_of(
    request: Any, period: str = "day", *, slot: str | dt.datetime | dt.date | None = None
) -> str:
    """The slot this run is for: from the ``idemmail_slot`` header beat sent, else the explicit ``slot``.

    Inside a task: ``slot_of(self.request, "day", slot=slot)``. A run beat sent
    (with :class:`SlotScheduler` or :class:`SlotMixin`) is named by the time its
    entry was due, so a late or doubled tick gets the same slot. A manual run
    must name the slot (``task.delay(slot="2026-11-21")``): a string must be
    written exactly as this function writes the period (anything else would make
    another key, and a second digest), a datetime or date is formatted. A run
    with both, disagreeing, raises ``ValueError``; with neither,
    :class:`SlotMissingError`. It never falls back to the wall clock.
    """
    if period not in PERIODS:
        raise ValueError(f"unknown slot period {period!r}; known: {', '.join(PERIODS)}")
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
        raise SlotMissingError(
            "no schedule slot: this run was not sent by a slot-aware beat scheduler "
            "(idemmail_celery.beat:SlotScheduler or SlotMixin); a manual run must pass slot=..."
        )
    return explicit


def send_digest(
    app: Celery,
    *,
    slot: str,
    recipients: Iterable[str],
    subject: str | Callable[[str, str], str],
    build_body: Callable[[str, str], Mapping[str, Any]],
    template: str = "digest",
    options: Mapping[str, Any] | None = None,
    **email: Any,
) -> dict[str, Any]:
    """Enqueue one ``send_email`` per recipient for ``slot``: the fan-out of a scheduled digest.

    ``build_body(recipient, slot)`` returns the message's content keywords
    (``{"html": ...}``, ``{"text": ..., "attachments": [...]}``); ``subject`` is a
    string or ``subject(recipient, slot)``. Every message has
    ``event_id=f"{template}:{slot}"`` and ``template=template``, so its key is one
    per (tenant, recipient, slot): run the fan-out again (a retry, a second beat,
    a manual re-run of the same slot) and every recipient who has theirs gets a
    ``duplicate``, nobody a second email. ``email`` holds the other ``send_email``
    keywords, the same for everyone (``from_``, ``tenant``, ``tags``, ...);
    ``options`` goes to ``apply_async`` (``{"queue": "digests"}``).

    A recipient whose message is invalid (:class:`~idemmail_celery.errors.InvalidEmail`)
    is skipped and reported, so one bad address does not hold back everyone
    else's digest. Returns ``{"slot", "event_id", "enqueued": [key, ...], "invalid":
    [{"position": i, "reason": text}, ...]}``: the intent key of each message enqueued, in
    the order of ``recipients``, and each skipped recipient by its position in
    ``recipients``. No address is in the result or the log (the result is stored by the
    result backend and shown by Flower): find a recipient by its position in your own list.
    """
    from .mail import TASK_NAME

    if not slot:
        raise SlotMissingError("send_digest needs the slot (use slot_of(self.request, ...))")
    task = app.tasks[TASK_NAME]
    event_id = f"{template}:{slot}"
    enqueued: list[str] = []
    invalid: list[dict[str, Any]] = []
    for position, recipient in enumerate(recipients):
        kwargs: dict[str, Any] = {
            **email,
            **build_body(recipient, slot),
            "to": recipient,
            "subject": subject(recipient, slot) if callable(subject) else subject,
            "event_id": event_id,
            "template": template,
        }
        try:
            # Derived once here and sent as the header, so apply_async does not derive it again.
            due = first_run_time(task.app, (options or {}).get("countdown"), (options or {}).get("eta"))
            headers = task.intent_headers((), kwargs, due=due)
        except InvalidEmail as exc:
            # InvalidEmail never quotes the address; scrubbed all the same, as every text that reaches a log.
            reason = scrub(str(exc), (str(recipient), *str(recipient).rpartition("@")[::2]))
            log.error("idemmail: digest %s: skipping recipient #%d: %s", logsafe(event_id), position, logsafe(reason))
            invalid.append({"position": position, "reason": reason})
            continue
        publish = dict(options or {})
        # A header only the library writes (chain state copied from another message) would break the key's
        # seal, and apply_async would hash the key again: the recipient's intent under another key than returned.
        publish["headers"] = {**untrusted_removed(publish.get("headers") or {}, keep=()), **headers}
        task.apply_async((), kwargs, **publish)
        enqueued.append(headers[KEY_HEADER])
    return {"slot": slot, "event_id": event_id, "enqueued": enqueued, "invalid": invalid}
