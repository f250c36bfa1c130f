"""The review queue's list page on Django's ChangeList conventions (docs/django.md): the request as a ledger query
(what does not parse is dropped with a note on the page, never an error), its links, rows and sidebar counts.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar
from urllib.parse import urlencode

from ...ledger import Ledger, Record, State
from ...ledger.listing import MAX_TEXT, Counts, RecordQuery, Summary, label_of, message_id_of, reason_of

_K = TypeVar("_K")
_V = TypeVar("_V")

PER_PAGE = 100  # Django's list_per_page
#: The last page number read as asked: past any queue, its offset still a number every store takes.
MAX_PAGE = 10**9
#: The filters a link keeps, in the order they are written.
FILTERS = ("state", "task", "reason", "age", "updated__year", "updated__month", "updated__day", "q", "o")
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
SUMMARY_SECONDS = 30.0  # how long the sidebar's counts are kept


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
        """``request.GET`` as a query (``now``, epoch seconds, anchors ``age``); never raises."""
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
        params: dict[str, Any] = {**self.params, **changes}
        ordered = [(k, params[k]) for k in (*FILTERS, "p", "c") if params.get(k) not in (None, "")]
        return "?" + urlencode(ordered) if ordered else "?"

    @property
    def filtered(self) -> bool:  # by anything but the state
        return any(k in self.params for k in ("task", "reason", "age", *DATE_PARTS, "q"))


def _taken(get: Mapping[str, str], problems: list[str]) -> dict[str, str]:
    """The filters given, stripped; one too long or not printable is left out (a page never echoes such text)."""
    params: dict[str, str] = {}
    for name in FILTERS:
        value = str(get.get(name, "")).strip()
        if value and (len(value) > MAX_TEXT or not value.isprintable()):
            problems.append(f"{name}: left out (not a value this page takes)")
        elif value:
            params[name] = value
    return params


def _state(params: dict[str, str], problems: list[str]) -> State | None:
    """The state chosen (``review`` by default, ``all``: None; an unknown one: ``review``)."""
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
    """The range ``since``-``until`` narrowed by the ``age`` filter."""
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
    try:
        return min(max(1, int(get.get("p", "1"))), MAX_PAGE)
    except ValueError:
        return 1


def _cursor(get: Mapping[str, str]) -> str | None:
    """The "next" link's cursor; None if too long to be one this page wrote."""
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
        if not text.isdecimal():  # not isdigit(): int() refuses "²"
            problems.append(f"{name} {text!r}: left out")
            break
        parts.append(int(text))
    if parts:
        year, month, day = (*parts, 1, 1)[:3]
        try:
            start = dt.datetime(year, month, day, tzinfo=dt.timezone.utc)
            if len(parts) == 1:
                end = start.replace(year=year + 1)
            elif len(parts) == 2:  # a month ends where the next one starts
                end = (start + dt.timedelta(days=32)).replace(day=1)
            else:
                end = start + dt.timedelta(days=1)
        except (ValueError, OverflowError):  # no such date, or its end is past year 9999
            problems.append("the date: not a date, left out")
            parts = []
    for name in DATE_PARTS[len(parts):]:
        params.pop(name, None)
    return (start.timestamp(), end.timestamp()) if parts else (None, None)


def hierarchy(request: ListRequest, days: dict[int, int] | None) -> dict[str, Any] | None:
    """Django's date hierarchy over the days holding records (UTC): a link back up, and the years, months or
    days below the one chosen, each a link with its count."""
    if not days:
        return None
    dates = sorted((dt.date(1970, 1, 1) + dt.timedelta(days=d), n) for d, n in days.items())
    chosen = [int(request.params[name]) for name in DATE_PARTS if name in request.params]

    def at(*parts: int) -> str:  # the link to a year, month or day (none: every date), other filters kept
        return request.link(**{**dict.fromkeys(DATE_PARTS), **dict(zip(DATE_PARTS, map(str, parts), strict=False))})

    if len(chosen) == 3:
        return {"back": {"title": f"{chosen[0]}-{chosen[1]:02d}", "link": at(*chosen[:2])},
                "choices": [{"title": f"{chosen[0]}-{chosen[1]:02d}-{chosen[2]:02d}", "link": ""}]}
    groups: Counter[tuple[int, ...]] = Counter()
    for d, n in dates:  # inside the one chosen, by the level below it: year, month or day
        if [d.year, d.month][:len(chosen)] == chosen:
            groups[(d.year, d.month, d.day)[:len(chosen) + 1]] += n
    back = {"title": "All dates" if len(chosen) == 1 else str(chosen[0]), "link": at(*chosen[:-1])} if chosen else None
    return {"back": back, "choices": [{"title": "-".join(f"{p:02d}" for p in group) + f" ({n:,})", "link": at(*group)}
                                      for group, n in groups.items()]}


def iso(ts: float | None) -> str:
    """An epoch time in ISO 8601, UTC, to the second (``2026-11-27T17:05:01Z``); ``""`` for none."""
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if ts else ""


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
    if (name == "at" or name.endswith("_at")) and type(value) in (int, float) and 0 < value < 1e11:
        at = dt.datetime.fromtimestamp(value, dt.timezone.utc)
        return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return value


class Summaries:
    """The sidebar's :class:`~idemmail_celery.ledger.listing.Counts` per ledger, state and time range, and the
    records per state (:meth:`~idemmail_celery.ledger.base.Ledger.stats`), each kept :data:`SUMMARY_SECONDS` (on
    Redis each is a pass over the state's records) or until an operator acts (:meth:`forget`)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, RecordQuery], tuple[float, Counts]] = {}
        self._stats: dict[int, tuple[float, dict[str, int]]] = {}
        self._lock = threading.Lock()

    def kept(self, ledger: Ledger, query: RecordQuery) -> Summary | None:
        """The summary of ``query`` from the counts kept, or None."""
        with self._lock:
            kept = self._kept.get(self._key(ledger, query))
        return kept[1].summary(query) if kept is not None and kept[0] > time.monotonic() else None

    def get(self, ledger: Ledger, query: RecordQuery) -> Summary:
        """The summary of ``query``, from the counts kept, else counted now."""
        key = self._key(ledger, query)
        return self._keep(self._kept, key, lambda: ledger.count(key[1])).summary(query)

    def states(self, ledger: Ledger) -> dict[str, int]:
        return self._keep(self._stats, id(ledger), ledger.stats)

    def forget(self) -> None:
        with self._lock:
            self._kept.clear()
            self._stats.clear()

    @staticmethod
    def _key(ledger: Ledger, query: RecordQuery) -> tuple[int, RecordQuery]:
        return id(ledger), RecordQuery(state=query.state, since=query.since, until=query.until)

    def _keep(self, kept: dict[_K, tuple[float, _V]], key: _K, count: Callable[[], _V]) -> _V:
        """What ``kept`` holds for ``key`` while it is fresh, else ``count()``, kept from now on."""
        now = time.monotonic()
        with self._lock:
            held = kept.get(key)
        if held is not None and held[0] > now:
            return held[1]
        value = count()
        with self._lock:
            if len(kept) > 256:
                kept.clear()
            kept[key] = (now + SUMMARY_SECONDS, value)
        return value
