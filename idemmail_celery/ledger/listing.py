"""Listing records a page at a time (an operator's review queue): a :class:`RecordQuery` says which, ordered by
``updated_at`` then key; ``Ledger.list_records`` answers a :class:`RecordPage`, ``Ledger.summarize`` the counts.
A search word is found in the key's start, task, message id or :class:`Label`, never in a subject, body or address.
Backends answer through ``_listing_window`` and ``count``, whose defaults read every record."""

from __future__ import annotations

import base64
import binascii
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from ..keys import Payload
from ..redaction import scrub

if TYPE_CHECKING:
    from .records import Record, State

#: The longest task name, reason or search a query takes (what a request may hand over).
MAX_TEXT = 255
#: The most words a search holds (more are refused).
MAX_WORDS = 8
#: The keyword arguments a record's :class:`Label` is read from, in a ``send_email``-shaped payload.
RECIPIENT_FIELDS = ("to", "cc", "bcc")


@dataclass(frozen=True)
class RecordQuery:
    """Which records to list, and in which order. Every field is optional: all records, oldest first."""

    #: Only records in this state (None: every state).
    state: State | None = None
    #: Only records of this task (its full name).
    task: str = ""
    #: Only records whose error has this ``reason`` (``lease_expired``, ``after_data``, ...).
    reason: str = ""
    #: Only records that entered their state at or after this time (epoch seconds)...
    since: float | None = None
    #: ... and before this one.
    until: float | None = None
    #: Words, each to be found in the key's start, task, message id or label.
    search: str = ""
    #: The newest first (by default the oldest: a queue is worked from its front).
    newest_first: bool = False

    def __post_init__(self) -> None:
        for name in ("task", "reason", "search"):
            if len(getattr(self, name)) > MAX_TEXT:
                raise ValueError(f"a query's {name} is at most {MAX_TEXT} characters")
        if len(self.search.split()) > MAX_WORDS:
            raise ValueError(f"a search is at most {MAX_WORDS} words")

    @property
    def words(self) -> tuple[str, ...]:
        """The search's words, lower case, each once."""
        return tuple(dict.fromkeys(self.search.lower().split()))

    @property
    def plain_words(self) -> tuple[str, ...]:
        """What a store may look for in its raw text to narrow a search: each word's parts between ``=`` (a tag
        is stored as a JSON pair) that JSON writes as they are (printable ASCII, no quotes or backslashes)."""
        parts = (p for w in self.words for p in w.split("=") if p)
        return tuple(dict.fromkeys(p for p in parts if p.isascii() and p.isprintable() and not {'"', "\\"} & set(p)))

    def without(self, *, task: bool = False, reason: bool = False, search: bool = False) -> RecordQuery:
        """This query with the named filters dropped."""
        return replace(self, task="" if task else self.task, reason="" if reason else self.reason,
                       search="" if search else self.search)

    def matches(self, record: Record, now: float | None = None) -> bool:
        """Does ``record`` answer this query (an expired ``sent``/``failed`` record never does, given ``now``)?"""
        return ((self.state is None or record.state is self.state)
                and not (now is not None and record.state.expires and (record.expires_at or 0) <= now)
                and (self.since is None or record.updated_at >= self.since)
                and (self.until is None or record.updated_at < self.until)
                and (not self.task or record.task_name == self.task)
                and (not self.reason or reason_of(record) == self.reason)
                and searched(record, self.words))


def reason_of(record: Record) -> str:
    """The ``reason`` of a record's error (a string), or ``""``."""
    reason = (record.error or {}).get("reason")
    return reason if isinstance(reason, str) else ""


def message_id_of(record: Record) -> str:
    """The provider's message id in a record's result (a string), or ``""``."""
    mid = (record.result or {}).get("message_id")
    return mid if isinstance(mid, str) else ""


@dataclass(frozen=True)
class Label:
    """Which send a record is, without personal data: template, event id, tags (scrubbed), recipients' domains."""

    template: str = ""
    event_id: str = ""
    tags: tuple[tuple[str, str], ...] = ()
    domains: tuple[str, ...] = ()

    def __str__(self) -> str:
        parts = [self.template, self.event_id, *(f"{k}={v}" for k, v in self.tags)]
        if self.domains:
            parts.append("@" + ", @".join(self.domains))
        return " · ".join(p for p in parts if p)

    def texts(self) -> Iterator[str]:
        """Every text a search word may be found in."""
        yield from (self.template, self.event_id, *self.domains)
        for name, value in self.tags:
            yield from (name, value, f"{name}={value}")


def label_of(record: Record) -> Label:
    """The :class:`Label` of a record's stored first payload; empty without one, or for another shape."""
    if not record.payload or record.payload.startswith("fernet:"):
        return Label()
    try:
        kwargs = Payload.from_json(record.payload).kwargs
    except (ValueError, KeyError, TypeError):
        return Label()
    tags = kwargs.get("tags")
    pairs = tuple((_text(k), _text(v)) for k, v in sorted(tags.items())) if isinstance(tags, dict) else ()
    domains = sorted({d for name in RECIPIENT_FIELDS for d in _domains(kwargs.get(name)) if d})
    return Label(template=_text(kwargs.get("template")), event_id=_text(kwargs.get("event_id")), tags=pairs,
                 domains=tuple(domains))


def _text(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return ""
    return scrub(str(value))[:MAX_TEXT]


def _domains(value: Any) -> Iterable[str]:
    """The domain of each address in a recipient argument (one address, or a list of them)."""
    for item in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(item, str) and "@" in item:
            domain = item.rsplit("@", 1)[1].strip().rstrip(">").strip().lower()
            if domain and "@" not in domain and " " not in domain:
                yield domain


def searched(record: Record, words: Iterable[str]) -> bool:
    """Is every one of ``words`` (lower case) found in the record's key start, task, message id or label?"""
    key, task, mid = record.key.lower(), record.task_name.lower(), message_id_of(record).lower()
    texts: list[str] | None = None  # the label's, read from the payload only when needed
    for word in words:
        if key.startswith(word) or word in task or word in mid:
            continue
        if texts is None:
            texts = [text.lower() for text in label_of(record).texts()]
        if not any(word in text for text in texts):
            return False
    return True


class Position(NamedTuple):
    """Where a record stands in a listing's order: the store's time for it, then its key."""

    at: float
    key: str


def encode_cursor(position: Position, query: RecordQuery) -> str:
    """An opaque, URL-safe cursor: continue after ``position`` in ``query``'s order."""
    text = json.dumps([1 if query.newest_first else 0, position.at, position.key], separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(cursor: str, query: RecordQuery) -> Position:
    """The position a cursor holds; :class:`ValueError` unless :func:`encode_cursor` made it for ``query``'s order."""
    try:
        newest, at, key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError("not a listing cursor") from exc
    if newest not in (0, 1) or bool(newest) is not query.newest_first or not isinstance(key, str) \
            or isinstance(at, bool) or not isinstance(at, (int, float)):
        raise ValueError("not a listing cursor for this order")
    return Position(float(at), key)


def after(position: Position, bound: Position | None, newest_first: bool) -> bool:
    """Does ``position`` come after ``bound`` in the order (anything does when there is no bound)?"""
    return bound is None or (position < bound if newest_first else position > bound)


@dataclass(frozen=True)
class Selection:
    """What a backend's ``_listing_window`` hands back: records in the query's order, each with its position."""

    items: list[tuple[Position, Record]]
    #: Where the next call starts (after this position); None: nothing follows.
    resume: Position | None
    #: How many matching records the store left out before ``items`` (of the ``skip`` asked for).
    skipped: int = 0


@dataclass(frozen=True)
class RecordPage:
    """One page of a listing."""

    records: list[Record]
    #: The cursor of the next page (:meth:`~idemmail_celery.ledger.base.Ledger.list_records`), None on the last.
    next_cursor: str | None


@dataclass(frozen=True)
class Summary:
    """How a query's records divide (an admin's sidebar), as far as the store can tell."""

    #: How many records match the query; None with search words (each record is checked apart).
    total: int | None
    #: Reason -> records matching the query but for its reason and search; None for a sealed ledger.
    reasons: dict[str, int] | None = None
    #: Task name -> records, over the records matching the query but for its task and search.
    tasks: dict[str, int] | None = None
    #: UTC day (``updated_at // 86400``) -> records matching the query but for its search (a date hierarchy).
    days: dict[int, int] | None = None


#: A record's cell in :class:`Counts`: its reason (``""`` for none), its task, its UTC day.
Cell = tuple[str, str, int]


@dataclass(frozen=True)
class Counts:
    """Records of one state and time range counted by reason, task and day; every :class:`Summary` follows from it."""

    cells: dict[Cell, int]
    #: False when the store cannot read reasons (a sealed ledger counts every record under ``""``).
    reasons_known: bool = True

    def summary(self, query: RecordQuery) -> Summary:
        reasons, tasks, days, total = Counter[str](), Counter[str](), Counter[int](), 0
        for (reason, task, day), n in self.cells.items():
            task_ok = not query.task or task == query.task
            reason_ok = not query.reason or reason == query.reason
            if task_ok:
                reasons[reason] += n
            if reason_ok:
                tasks[task] += n
                if task_ok:
                    days[day] += n
                    total += n
        if not self.reasons_known:
            return Summary(None if query.reason or query.words else total, None,
                           *((None, None) if query.reason else (dict(tasks), dict(days))))
        return Summary(None if query.words else total, dict(reasons), dict(tasks), dict(days))


def cell_of(record: Record) -> Cell:
    return reason_of(record), record.task_name, int(record.updated_at // 86400)


def count_in_memory(records: Iterable[Record], query: RecordQuery, now: float) -> Counts:
    """The default count: ``records`` in the query's state and time range, counted here."""
    plain = RecordQuery(state=query.state, since=query.since, until=query.until)
    return Counts(dict(Counter(cell_of(record) for record in records if plain.matches(record, now))))


def select_in_memory(records: Iterable[Record], query: RecordQuery, position: Position | None, skip: int,
                     now: float) -> Selection:
    """The default ``_listing_window``: ``records`` filtered, ordered and cut after ``position``, all in one."""
    found = sorted(((Position(r.updated_at, r.key), r) for r in records if query.matches(r, now)),
                   key=lambda item: item[0], reverse=query.newest_first)
    rest = [item for item in found if after(item[0], position, query.newest_first)]
    skipped = min(skip, len(rest))
    return Selection(rest[skipped:], None, skipped)
