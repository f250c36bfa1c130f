"""The review queue's list page, on Django's ChangeList conventions: a request's parameters as a ledger query,
the links that keep them, the rows, and the sidebar's counts.

The parameters are the changelist's: ``q`` (search), ``o`` (order: ``-updated`` for the newest first), ``p`` (the
page, from 1), the filters ``state``, ``task``, ``reason`` and ``age``, the date hierarchy's ``updated__year``,
``updated__month`` and ``updated__day`` (UTC), and ``c``, the cursor of the page the "next" link leads to (a
page reached by its number alone is read from the start of the order). A value that does not parse is dropped
with a note on the page, never an error.

Rows show no personal data: the full key (to copy into the CLI), a label (template, event id, tags,
recipients' domains: :func:`~idemmail_celery.ledger.listing.label_of`), state, task, reason or message id,
attempts and the time in ISO 8601 (UTC).
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlencode

from ...ledger import Ledger, Record, State
from ...ledger.listing import MAX_TEXT, Counts, RecordQuery, Summary, label_of, message_id_of, reason_of

#: Records a page lists (Django's ``list_per_page``).
PER_PAGE = 100
#: The filters a link keeps, in the order they are written.
FILTERS = ("state", "task", "reason", "age", "updated__year", "updated__month", "updated__day", "q", "o")
#: The date hierarchy's parameters, from the widest.
DATE_PARTS = ("updated__year", "updated__month", "updated__day")
#: ``age`` -> (its label, parked at most this many seconds ago, parked at least this many seconds ago).
AGES: dict[str, tuple[str, int | None, int | None]] = {
    "1h": ("In the last hour", 3600, None),
    "24h": ("In the last 24 hours", 86400, None),
    "7d": ("In the last 7 days", 7 * 86400, None),
    "older-1d": ("More than a day ago", None, 86400),
    "older-7d": ("More than 7 days ago", None, 7 * 86400),
    "older-30d": ("More than 30 days ago", None, 30 * 86400),
}
#: How long the sidebar's counts are kept (each is one pass over the state's records in the store).
SUMMARY_SECONDS = 30.0


@dataclass
class ListRequest:
    """A list page's request: its filters as a :class:`RecordQuery`, its page, and what did not parse."""

    params: dict[str, str]
    query: RecordQuery
    page: int = 1
    cursor: str | None = None
    problems: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, get: Mapping[str, str], now: float) -> ListRequest:
        """The request's parameters (``request.GET``) as a query; ``now`` (epoch seconds) anchors ``age``.

        Never raises: what does not parse is left out of ``params`` with a line in ``problems``.
        """
        problems: list[str] = []
        params = _taken(get, problems)
        state = _state(params, problems)
        since, until = _age(params, problems, now, *_dates(params, problems))
        if params.get("o", "-updated") not in ("updated", "-updated"):
            problems.append(f"order {params.pop('o')!r}: left out")
        query = RecordQuery(state=state, task=params.get("task", ""), reason=params.get("reason", ""), since=since,
                            until=until, newest_first=params.get("o") == "-updated")
        if "q" in params:
            try:
                query = replace(query, search=params["q"])
            except ValueError as exc:  # too many words: the rest of the query still lists
                problems.append(f"search: {exc}; left out")
                params.pop("q")
        return cls(params, query, _page_number(get), _cursor(get), problems)

    def link(self, **changes: str | int | None) -> str:
        """This page's query string with ``changes`` (None drops a parameter); a new filter starts at page 1."""
        params: dict[str, Any] = {k: v for k, v in self.params.items()}
        for name, value in changes.items():
            if value is None or value == "":
                params.pop(name, None)
            else:
                params[name] = value
        ordered = [(k, params[k]) for k in (*FILTERS, "p", "c") if k in params]
        return "?" + urlencode(ordered) if ordered else "?"

    @property
    def filtered(self) -> bool:
        """Does any filter but the state narrow the list?"""
        return any(k in self.params for k in ("task", "reason", "age", *DATE_PARTS, "q"))


def _taken(get: Mapping[str, str], problems: list[str]) -> dict[str, str]:
    """The filters given, stripped; one too long or not printable is left out (a page never echoes such text)."""
    params: dict[str, str] = {}
    for name in FILTERS:
        value = str(get.get(name, "")).strip()
        if not value:
            continue
        if len(value) > MAX_TEXT or not value.isprintable():
            problems.append(f"{name}: left out (not a value this page takes)")
        else:
            params[name] = value
    return params


def _state(params: dict[str, str], problems: list[str]) -> State | None:
    """The state chosen (``review`` by default, ``all``: None); an unknown one shows ``review``."""
    chosen = params.get("state", State.REVIEW.value)
    if chosen == "all":
        return None
    if chosen not in {s.value for s in State}:
        problems.append(f"state {chosen!r}: no such state, review shown")
        params.pop("state")
        return State.REVIEW
    return State(chosen)


def _age(params: dict[str, str], problems: list[str], now: float, since: float | None,
         until: float | None) -> tuple[float | None, float | None]:
    """The range ``since``-``until`` narrowed by the ``age`` filter, if one of :data:`AGES` is chosen."""
    age = params.get("age")
    if age is None:
        return since, until
    if age not in AGES:
        problems.append(f"age {age!r}: left out")
        params.pop("age")
        return since, until
    # Whole minutes: the same filter a minute long is one query (and one set of counts).
    minute = math.floor(now / 60) * 60
    _, newer, older = AGES[age]
    since = max(since or 0.0, minute - newer) if newer else since
    until = min(until or math.inf, minute - older) if older else until
    return since, until


def _page_number(get: Mapping[str, str]) -> int:
    """The page number, from 1 (1 when it is not a number)."""
    try:
        return max(1, int(get.get("p", "1")))
    except ValueError:
        return 1


def _cursor(get: Mapping[str, str]) -> str | None:
    """The "next" link's cursor, or None (none given, or too long to be one this page wrote)."""
    cursor = str(get.get("c", ""))
    return cursor if cursor and len(cursor) < 2 * MAX_TEXT else None


def _dates(params: dict[str, str], problems: list[str]) -> tuple[float | None, float | None]:
    """The date hierarchy's year, month and day as a time range (UTC); a part that does not parse, or comes
    without the one above it, is left out with those below it."""
    parts: list[int] = []
    for name in DATE_PARTS:
        text = params.get(name)
        if text is None:
            break
        if not text.isdigit():
            problems.append(f"{name} {text!r}: left out")
            break
        parts.append(int(text))
    for name in DATE_PARTS[len(parts):]:
        params.pop(name, None)
    if not parts:
        return None, None
    year, month, day = (*parts, 1, 1)[:3]
    try:
        start = dt.datetime(year, month, day, tzinfo=dt.timezone.utc)
    except (ValueError, OverflowError):
        problems.append("the date: not a date, left out")
        for name in DATE_PARTS:
            params.pop(name, None)
        return None, None
    if len(parts) == 1:
        end = start.replace(year=start.year + 1)
    elif len(parts) == 2:
        end = (start + dt.timedelta(days=32)).replace(day=1)
    else:
        end = start + dt.timedelta(days=1)
    return start.timestamp(), end.timestamp()


def hierarchy(request: ListRequest, days: dict[int, int] | None) -> dict[str, Any] | None:
    """Django's date hierarchy over the days that hold records (UTC): a link back up, and the years, months
    or days below the one chosen, each a link with its count."""
    if not days:
        return None
    dates = sorted((dt.date(1970, 1, 1) + dt.timedelta(days=d), n) for d, n in days.items())
    chosen = [int(request.params[name]) for name in DATE_PARTS if name in request.params]

    def at(*parts: int) -> str:  # the link to a year, month or day (none: every date), other filters kept
        return request.link(**{**dict.fromkeys(DATE_PARTS), **dict(zip(DATE_PARTS, map(str, parts), strict=False))})

    if len(chosen) == 3:
        return {"back": {"title": f"{chosen[0]}-{chosen[1]:02d}", "link": at(*chosen[:2])},
                "choices": [{"title": f"{chosen[0]}-{chosen[1]:02d}-{chosen[2]:02d}", "link": ""}]}
    groups: dict[tuple[int, ...], int] = {}
    for d, n in dates:  # inside the one chosen, by the level below it: year, month or day
        if [d.year, d.month][:len(chosen)] == chosen:
            group = (d.year, d.month, d.day)[:len(chosen) + 1]
            groups[group] = groups.get(group, 0) + n
    back = None
    if chosen:
        back = {"title": "All dates" if len(chosen) == 1 else str(chosen[0]), "link": at(*chosen[:-1])}
    choices = [{"title": "-".join(f"{p:02d}" for p in group) + f" ({n:,})", "link": at(*group)}
               for group, n in groups.items()]
    return {"back": back, "choices": choices}


def iso(ts: float | None) -> str:
    """An epoch time in ISO 8601, UTC, to the second (``2026-11-27T17:05:01Z``); ``""`` for none."""
    if not ts:
        return ""
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def row(record: Record) -> dict[str, Any]:
    """A record as the list shows it: nothing personal."""
    sent = record.state is State.SENT
    return {"key": record.key, "label": str(label_of(record)), "state": record.state.value,
            "task_name": record.task_name, "attempts": record.attempts,
            "said": message_id_of(record) if sent else reason_of(record) or message_id_of(record),
            "said_is_message_id": sent or not reason_of(record), "when": iso(record.updated_at)}


def readable(value: Any, name: str = "") -> Any:
    """A record's result or error with every time in it (``at``, ``*_at``: epoch seconds) in ISO 8601."""
    if isinstance(value, dict):
        return {k: readable(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [readable(v) for v in value]
    if (name == "at" or name.endswith("_at")) and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and 0 < value < 1e11:
        return dt.datetime.fromtimestamp(value, dt.timezone.utc).isoformat(timespec="milliseconds").replace(
            "+00:00", "Z")
    return value


class Summaries:
    """The sidebar's counts: the :class:`~idemmail_celery.ledger.listing.Counts` of a state and time range, kept
    :data:`SUMMARY_SECONDS` per ledger (on Redis each is a pass over the state's records), so that choosing a
    reason or a task, or the next page, counts nothing again; an operator's action here forgets them at once."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, RecordQuery], tuple[float, Counts]] = {}
        self._stats: dict[int, tuple[float, dict[str, int]]] = {}
        self._lock = threading.Lock()

    def kept(self, ledger: Ledger, query: RecordQuery) -> Summary | None:
        """The summary of ``query`` from the counts kept for its state and time range; None if none are."""
        with self._lock:
            kept = self._kept.get(self._key(ledger, query))
        return kept[1].summary(query) if kept is not None and kept[0] > time.monotonic() else None

    def get(self, ledger: Ledger, query: RecordQuery) -> Summary:
        """The summary of ``query``, from the counts kept for its state and time range, else counted now."""
        summary = self.kept(ledger, query)
        if summary is not None:
            return summary
        key = self._key(ledger, query)
        now = time.monotonic()
        counts = ledger.count(key[1])
        with self._lock:
            if len(self._kept) > 256:
                self._kept.clear()
            self._kept[key] = (now + SUMMARY_SECONDS, counts)
        return counts.summary(query)

    @staticmethod
    def _key(ledger: Ledger, query: RecordQuery) -> tuple[int, RecordQuery]:
        return id(ledger), RecordQuery(state=query.state, since=query.since, until=query.until)

    def states(self, ledger: Ledger) -> dict[str, int]:
        """The records per state (:meth:`~idemmail_celery.ledger.base.Ledger.stats`), kept as long."""
        now = time.monotonic()
        with self._lock:
            kept = self._stats.get(id(ledger))
        if kept is not None and kept[0] > now:
            return kept[1]
        counts = ledger.stats()
        with self._lock:
            self._stats[id(ledger)] = (now + SUMMARY_SECONDS, counts)
        return counts

    def forget(self) -> None:
        with self._lock:
            self._kept.clear()
            self._stats.clear()
