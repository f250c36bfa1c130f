"""The ledger contract: records, states, and the transitions every backend implements.

A ledger maps an intent key to one :class:`Record`; its states and moves are drawn in docs/guarantee.md ("The state
machine"). ``sent`` and ``failed`` records expire after the retention period; the others never expire by time.

Every transition out of ``claimed`` names the fencing token of its claim; a caller whose lease was taken over
gets :class:`StaleTokenError`, except that a late holder that did complete may still record ``sent`` over a
``review`` or ``released`` record or an unfinished newer claim (never over another ``sent``).

Backends implement the abstract methods with one atomic operation per transition; everything else lives here."""

from __future__ import annotations

import functools
import json
import os
import secrets
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from .._common import after_fork
from ..config import DEFAULTS
from ..encoding import canonical_json
from ..errors import IllegalTransitionError, RecordNotFoundError
from .listing import (
    Counts,
    Position,
    RecordPage,
    RecordQuery,
    Selection,
    Summary,
    count_in_memory,
    decode_cursor,
    encode_cursor,
    select_in_memory,
)

# Re-exported: ledger modules import the record values from here.
from .records import UNKNOWN_STAGE as UNKNOWN_STAGE
from .records import Claim as Claim
from .records import ClaimStatus as ClaimStatus
from .records import Mark as Mark
from .records import Record as Record
from .records import State as State

#: Short: a crashed holder's intent waits this long before a takeover; a live holder renews it every third.
DEFAULT_LEASE_SECONDS: float = DEFAULTS["lease_seconds"]
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True)
class ClaimRequest:
    """What a claimer brings: who it is, what it would run, and for how long."""

    key: str
    task_name: str
    payload: str
    fingerprint: str
    owner: str = field(default_factory=lambda: new_owner())
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    #: The claimer promises a write-ahead mark (:meth:`Ledger.write_ahead`) before its side effect.
    writes_ahead: bool = False
    #: The owner this delivery's chain claimed under before: a ``claimed`` record it holds (live or expired) is
    #: taken back as ``RESUMED`` (new token and owner, ``reclaims`` unchanged). A verdict's claim passes its owner.
    resume_owner: str | None = None


@functools.cache
def default_owner() -> str:
    """``host:pid`` of this process (worked out once per process)."""
    return f"{socket.gethostname()}:{os.getpid()}"


after_fork(default_owner.cache_clear)  # a forked child has a pid of its own


def new_owner(detail: str = "") -> str:
    """A unique owner string for one claim: ``host:pid[:detail]:nonce`` (the nonce tells "my row" from "a row")."""
    parts = [default_owner(), detail, secrets.token_hex(4)]
    return ":".join(p for p in parts if p)


def _check_unique(requests: Sequence[ClaimRequest]) -> None:
    if len({r.key for r in requests}) != len(requests):
        raise ValueError("claim_many needs distinct keys")


def dumps_json(value: dict[str, Any] | None) -> str | None:
    """Results and errors as stored: canonical JSON (``UnserializableArgumentsError`` for what JSON cannot hold)."""
    return None if value is None else canonical_json(value)


#: What :meth:`Ledger.forget` keeps of an error: machine-readable words and times, never free text.
FORGET_KEEPS_ERROR = ("type", "reason", "cause", "at", "maybe_sent")
#: ... and of a resolution (who decided, when): its note is free text.
FORGET_KEEPS_RESOLUTION = ("from", "to", "at", "by")


def forgotten(record: Record) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]:
    """A record's result, error and resolution without free text (see :meth:`Ledger.forget`), each marked
    ``"forgotten": True``: the result keeps its ``message_id``, the others the fields ``FORGET_KEEPS_*`` name."""
    result = record.result
    kept_result = None if result is None else {"message_id": result.get("message_id"), "forgotten": True}
    return kept_result, _kept(record.error, FORGET_KEEPS_ERROR), _kept(record.resolution, FORGET_KEEPS_RESOLUTION)


def _kept(value: dict[str, Any] | None, names: tuple[str, ...]) -> dict[str, Any] | None:
    return None if value is None else {**{k: value[k] for k in names if k in value}, "forgotten": True}


def loads_json(text: str | bytes | None) -> dict[str, Any] | None:
    if text is None or text == "" or text == b"":
        return None
    out = json.loads(text)
    return out if isinstance(out, dict) else {"value": out}


@dataclass(frozen=True)
class RosterEntry:
    """One live worker in a ledger's key-secret roster (:meth:`Ledger.announce`)."""

    #: ``host:pid`` of the worker's main process.
    member: str
    #: The ids of the key secrets it holds (:func:`idemmail_celery.keys.secret_id`), newest first.
    secret_ids: tuple[str, ...]
    #: When the entry lapses unless announced again (epoch seconds, the store's clock where it has one).
    expires_at: float


#: The longest member name and secret-id list a roster entry holds.
MAX_MEMBER_LENGTH = 255
MAX_SECRET_IDS_LENGTH = 255


def check_roster_entry(member: str, secret_ids: Sequence[str]) -> str:
    """The secret ids of a roster entry as stored (comma-separated); ``ValueError`` for what no store holds."""
    text = ",".join(secret_ids)
    if not member or len(member) > MAX_MEMBER_LENGTH or "|" in member:
        raise ValueError(f"a roster member is 1 to {MAX_MEMBER_LENGTH} characters without '|'")
    if not secret_ids or len(text) > MAX_SECRET_IDS_LENGTH or any(not i or "," in i for i in secret_ids):
        raise ValueError("a roster entry names 1 or more secret ids, without ',', in at most "
                         f"{MAX_SECRET_IDS_LENGTH} characters")
    return text


@runtime_checkable
class DetectsLoss(Protocol):
    """A ledger that can tell its store lost records (Redis epoch markers); operator tools open it ``passive``."""

    def loss_status(self) -> dict[str, Any]:
        """What the store's markers say (epoch, lost flags, acknowledgements)."""

    def init_store(self, *, actor: str = "") -> dict[str, Any]:
        """Write the markers of a new, empty store."""

    def acknowledge_loss(self, *, note: str, actor: str = "") -> dict[str, Any]:
        """Accept that records were lost and start a new epoch."""


class Ledger(ABC):
    """Base of every backend (:func:`idemmail_celery.ledger.from_url`); thread-safe, reconnects after ``fork()``."""

    def __init__(self, *, retention_seconds: float = DEFAULT_RETENTION_SECONDS, keep_payload: bool = False) -> None:
        self.retention_seconds = float(retention_seconds)
        #: Keep the first payload (personal data) after ``sent``, for audit; by default erased with ``sent``.
        self.keep_payload = bool(keep_payload)
        #: When a loss of the store's contents was acknowledged (Redis ``ledger ack-loss``), else None: an intent
        #: enqueued before then may have been sent and forgotten, so the task parks it unless its key travels on.
        self.recovered_at: float | None = None

    # -- the hot path: one atomic operation each --

    @abstractmethod
    def claim(self, request: ClaimRequest) -> Claim:
        """Claim ``request.key``, or report what holds it. Never blocks on another holder."""

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim distinct keys as :meth:`claim` does, one :class:`Claim` each in order, just before sending them."""
        _check_unique(requests)
        return [self.claim(r) for r in requests]

    @abstractmethod
    def _finish(self, key: str, token: int, state: State, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, mark: Mark | None = None) -> float | None:
        """Move the claim held with ``token`` to ``state`` atomically, under the module docstring's fencing rule.

        ``sent`` erases the payload unless ``keep_payload``; any move drops the mark (a release may leave ``mark``);
        ``result``/``error`` of None keep the record's. Returns ``updated_at`` as :meth:`get` reads it, or None.
        :class:`StaleTokenError` when it refuses, :class:`RecordNotFoundError` without a record."""

    @abstractmethod
    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        """Extend the lease of a claim still held with ``token``. False if it is not."""

    def withdraw(self, key: str, token: int) -> bool:
        """Delete a ``claimed`` record held with ``token`` that never ran (payload too); False if not held. For a claim
        just ``acquired`` (:meth:`~idemmail_celery.handler.Handler.cross_check`). Default: NotImplementedError (never
        done other than atomically)."""
        raise NotImplementedError(f"{type(self).__name__} cannot withdraw a claim")

    #: Does a reclaim from a holder with no write-ahead promise and no mark write ``Mark(UNKNOWN_STAGE, ...)``
    #: with that holder's token? (The built-in backends do; without it such a resumed claim is parked.)
    marks_takeovers: bool = False

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        """Before a side effect carrying no key: mark the claim held with ``token`` ``Mark(stage, time, token, owner)``
        and renew its lease; False if ``token`` no longer holds it. The mark stays until the claim moves (a reclaim
        keeps it); ``owner`` lets the chain know it (:func:`~idemmail_celery.handler.live_mark`). Default: 3 trips."""
        record = self.get(key)
        if record is None or record.state is not State.CLAIMED or record.token != token:
            return False
        now = time.time()
        marked = replace(record, mark=Mark(stage, now, token, owner), lease_expires_at=now + lease_seconds)
        return self._force(key, token, marked) and self.renew(key, token, lease_seconds)

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool | None:
        """Mark the reschedule ``hop`` of ``key`` as being published: True the first time, False for every later call
        within ``ttl_seconds`` (copies of a message never multiply), None when this backend keeps no marks."""
        return None

    def hop_marked(self, key: str, hop: str) -> bool | None:
        """Is ``(key, hop)`` marked (:meth:`mark_hop`) and live? None when this backend keeps no marks."""
        return None

    # -- the key-secret roster: which secrets the live workers hold --

    def announce(self, member: str, secret_ids: Sequence[str], ttl_seconds: float) -> None:
        """Put ``member`` (``host:pid``) holding ``secret_ids`` in the roster (:mod:`idemmail_celery.roster`) for
        ``ttl_seconds`` (0 or less: take it out). ``ValueError``: :func:`check_roster_entry`. Default: not kept."""
        raise NotImplementedError(f"{type(self).__name__} keeps no key-secret roster")

    def roster(self) -> list[RosterEntry]:
        """The live roster entries (:meth:`announce`), unordered. :class:`NotImplementedError` by default."""
        raise NotImplementedError(f"{type(self).__name__} keeps no key-secret roster")

    # -- reads and operator actions --

    @abstractmethod
    def get(self, key: str) -> Record | None:
        """The record for ``key``, or None (an expired ``sent``/``failed`` record is None)."""

    @abstractmethod
    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        """All records, or those in ``state``, in no particular order."""

    @abstractmethod
    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        """Replace the record if its token is still ``expected_token`` (operator changes)."""

    def forget(self, key: str) -> bool:
        """Erase the payload and free text of ``key`` (:func:`forgotten`), idempotently; False without a record. The
        record, state, fingerprint and mark stay, so the key still stops a resend; lands only on the record as read."""
        for _ in range(5):
            record = self._readable(key)
            if record is None:
                return False
            if self._erase(key, record.token, record.state, *forgotten(record)):
                return True
        raise IllegalTransitionError(f"record {key} kept changing while forgetting; try again")

    def _readable(self, key: str) -> Record | None:
        """The record as :meth:`forget` reads it (a sealed ledger leaves out what it cannot open)."""
        return self.get(key)

    @abstractmethod
    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None, resolution: dict[str, Any] | None) -> bool:
        """Atomically drop the payload and set ``result``, ``error`` and ``resolution`` if the record still has
        ``expected_token`` and ``expected_state``; False (nothing written) otherwise. Changes nothing else."""

    def stats(self) -> dict[str, int]:
        """How many records are in each state (expired ``sent``/``failed`` excluded)."""
        counts = {s.value: 0 for s in State}
        for record in self.iter_records():
            counts[record.state.value] += 1
        return counts

    @abstractmethod
    def purge_expired(self, now: float | None = None) -> int:
        """Delete ``sent``/``failed`` records past retention; return how many went."""

    @abstractmethod
    def ping(self) -> None:
        """Raise :class:`LedgerUnavailableError` if the store cannot be reached."""

    @property
    def backend(self) -> Ledger:
        """The store itself, under any wrappers: ask it for capabilities (``isinstance(x.backend, DetectsLoss)``)."""
        return self

    def close(self) -> None:
        """Release connections. The ledger reconnects if used again."""
        return None

    def prepare(self) -> None:
        """Check the store and read what a process holds before its first claim (the Redis epoch), before the pool
        forks so every child inherits it. :class:`LedgerUnavailableError` when unreachable; default: nothing."""
        return None

    # -- transitions, in words --

    def complete(self, key: str, token: int, result: dict[str, Any]) -> float | None:
        """``claimed`` -> ``sent`` with the side effect's result; returns ``updated_at`` as written, or None."""
        return self._finish(key, token, State.SENT, result=result)

    def fail(self, key: str, token: int, error: dict[str, Any]) -> None:
        """``claimed`` -> ``failed``: nothing was or will be sent; the error is replayed."""
        self._finish(key, token, State.FAILED, error=error)

    def park(self, key: str, token: int, error: dict[str, Any]) -> None:
        """``claimed`` -> ``review``: the outcome cannot be known; a person decides."""
        self._finish(key, token, State.REVIEW, error=error)

    def release(self, key: str, token: int, error: dict[str, Any] | None = None, *, mark: Mark | None = None) -> None:
        """``claimed`` -> ``released``: the next claim runs the stored payload, and finds ``mark`` if given."""
        self._finish(key, token, State.RELEASED, error=error, mark=mark)

    def confirm_sent(self, key: str, result: dict[str, Any], *, note: str = "", actor: str = "",
                     expect: Record | None = None) -> Record:
        """Outside evidence (a webhook, a search) the intent went out: any record but ``sent`` (returned as is) moves to
        ``sent`` with ``result``, the holder's token stale; with ``expect``, only that record (state and token)."""
        for _ in range(5):
            record = self.get(key)
            if record is None:
                raise RecordNotFoundError(f"no ledger record for key {key}")
            if record.state is State.SENT:
                return record
            if expect is not None and (record.state, record.token) != (expect.state, expect.token):
                raise IllegalTransitionError(f"record {key} is {record.state.value} with token {record.token} now, "
                                             f"not {expect.state.value} with token {expect.token}: left as it is")
            new = self._decided(record, State.SENT, result, note, actor, time.time())
            if self._force(key, record.token, new):
                return new
        raise IllegalTransitionError(f"record {key} kept changing while confirming; look again")

    def resolve(self, key: str, state: State | str, *, result: dict[str, Any] | None = None, note: str = "",
                actor: str = "") -> Record:
        """Operator decision on a record not live: ``sent`` (it went out; ``result`` may carry the message id),
        ``failed`` (it must not) or ``released`` (the next claim sends it); who, when, why: ``Record.resolution``."""
        target = State(state)
        if target not in (State.SENT, State.FAILED, State.RELEASED):
            raise IllegalTransitionError(f"cannot resolve to {target.value!r}")
        record = self.get(key)
        if record is None:
            raise RecordNotFoundError(f"no ledger record for key {key}")
        now = time.time()
        live = record.state is State.CLAIMED and (record.lease_expires_at or 0) > now
        if record.state is State.SENT or live:
            raise IllegalTransitionError(
                f"record {key} is {record.state.value}{' with a live lease' if live else ''}; it cannot be resolved")
        new = self._decided(record, target, result, note, actor, now)
        if not self._force(key, record.token, new):
            raise IllegalTransitionError(f"record {key} changed while resolving; look again")
        return new

    def _decided(self, record: Record, target: State, result: dict[str, Any] | None, note: str, actor: str,
                 now: float) -> Record:
        """``record`` moved to ``target`` by a person (or outside evidence), who is named in its resolution."""
        sent = target is State.SENT
        return replace(record, state=target, token=record.token + 1, lease_expires_at=None,
                       payload=None if sent and not self.keep_payload else record.payload,
                       result=result if sent else record.result, mark=None,
                       resolution={"from": record.state.value, "to": target.value, "at": now,
                                   "by": actor or default_owner(), "note": note},
                       updated_at=now, expires_at=now + self.retention_seconds if target.expires else None)

    # -- listing: the review queue (see ``listing``) --

    def list_records(self, query: RecordQuery | None = None, *, cursor: str | None = None, offset: int = 0,
                     limit: int = 100) -> RecordPage:
        """A page of ``query``'s records in its order: ``limit`` after ``cursor`` (a page's ``next_cursor``, good while
        records come and go) and ``offset`` more; :class:`ValueError` for a cursor made for another order."""
        query = query or RecordQuery()
        if limit < 1 or offset < 0:
            raise ValueError("a page lists at least 1 record, from an offset of 0 or more")
        position = decode_cursor(cursor, query) if cursor else None
        skip, found = offset, list[tuple[Position, Record]]()
        now = time.time()
        while True:
            # Ask for what is missing, and one more: does a next page exist?
            selection = self._listing_window(query, position, limit + 1 - len(found), skip)
            skip -= selection.skipped
            for at, record in selection.items:
                position = at
                if not query.matches(record, now):
                    continue
                if skip:
                    skip -= 1
                    continue
                found.append((at, record))
                if len(found) > limit:
                    return RecordPage([r for _, r in found[:limit]], encode_cursor(found[limit - 1][0], query))
            if selection.resume is None:
                return RecordPage([r for _, r in found], None)
            position = selection.resume

    def summarize(self, query: RecordQuery | None = None) -> Summary:
        """How many records ``query`` names, and how they divide by reason, task and day (:class:`Summary`)."""
        query = query or RecordQuery()
        return self.count(query).summary(query)

    def count(self, query: RecordQuery | None = None) -> Counts:
        """The records in ``query``'s state and time range, counted by reason, task and UTC day (:class:`Counts`)."""
        query = query or RecordQuery()
        return count_in_memory(self.iter_records(query.state), query, time.time())

    def _listing_window(self, query: RecordQuery, position: Position | None, want: int, skip: int) -> Selection:
        """At least ``want`` records after ``position`` in ``query``'s order (fewer at the end; non-matching ones may
        be among them), less up to ``skip`` matching ones (:attr:`Selection.skipped`). Default: sorts every record."""
        return select_in_memory(self.iter_records(query.state), query, position, skip, time.time())
