"""The ledger contract: records, states, and the transitions every backend implements.

A ledger maps an intent key to one :class:`Record`. Its states::

                claim (new key)
                     |
                     v
    released --> claimed --(complete)--> sent     (final; result replayed)
        ^          |  |  \\--(fail)-----> failed   (final; error replayed)
        |          |  |   \\-(park)-----> review   (final until a person resolves it)
        +-(release)+  |
                      +-- lease expired: reclaimed by the next claimer (new token)
                      +-- claimed by the caller's own earlier delivery: resumed (new token, new owner)

``sent`` and ``failed`` records expire after the retention period; ``claimed``,
``released`` and ``review`` never expire by time, because an expiring record
would silently reopen its key.

Every transition out of ``claimed`` names the fencing token the caller got from
its claim; a caller whose lease was taken over gets :class:`StaleTokenError`,
with one exception that loses nothing: a late holder that did complete its side
effect may still record ``sent`` over a ``review`` record, a ``released`` one, or
a newer claim that has not finished, because that is the truth. It never
overwrites another ``sent``.

Backends implement the abstract methods with one atomic operation per
transition; everything else lives here.
"""

from __future__ import annotations

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

# The values a ledger holds and answers live in records.py; every ledger module has always imported them from here.
from .records import UNKNOWN_STAGE as UNKNOWN_STAGE
from .records import Claim as Claim
from .records import ClaimStatus as ClaimStatus
from .records import Mark as Mark
from .records import Record as Record
from .records import State as State

#: Short, because a crashed holder's intent waits this long before anyone may take it over; the
#: holder renews it every third of its length while its body runs (see ``_lease``), so a long
#: send never loses it. 30 s: a SIGKILLed worker's intents are recovered within about a minute.
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
    #: The claimer promises a write-ahead mark (:meth:`Ledger.write_ahead`) before its side effect can happen,
    #: so that a claim it leaves without one is known not to have run it (:attr:`Record.writes_ahead`).
    writes_ahead: bool = False
    #: The owner this delivery's own chain claimed under before (carried in the message's headers),
    #: when it may hold a claim it could not settle: the claim's reply was lost, or its release
    #: failed. A ``claimed`` record whose owner is this, live or expired, is taken back as
    #: ``RESUMED``: the token goes up, ``owner`` becomes :attr:`owner` (so a second copy of the
    #: same message, carrying the same ``resume_owner``, finds it busy), ``reclaims`` stays. A
    #: delivery that only records a verdict claims with ``owner == resume_owner``, so that the claim
    #: stays with its holder whether or not this claim's reply arrives: two copies of it may then
    #: both resume it, and both record the same verdict (the body never runs on that path).
    resume_owner: str | None = None


_owner = ""


def default_owner() -> str:
    """``host:pid`` of this process (worked out once per process)."""
    global _owner
    if not _owner:
        _owner = f"{socket.gethostname()}:{os.getpid()}"
    return _owner


@after_fork
def _forget_owner() -> None:
    global _owner
    _owner = ""  # a forked child has a pid of its own




def new_owner(detail: str = "") -> str:
    """A unique owner string for one claim: ``host:pid[:detail]:nonce``.

    The nonce makes every claim's owner distinct, even two deliveries of the
    same task id in one process, so a store can tell "my row" from "a row".
    It names a holder and says nothing else (a promise of write-ahead marks is
    :attr:`ClaimRequest.writes_ahead`).
    """
    parts = [default_owner(), detail, secrets.token_hex(4)]
    return ":".join(p for p in parts if p)


def _check_unique(requests: Sequence[ClaimRequest]) -> None:
    if len({r.key for r in requests}) != len(requests):
        raise ValueError("claim_many needs distinct keys")


def dumps_json(value: dict[str, Any] | None) -> str | None:
    """Results and errors as the ledger stores them: canonical JSON, the same encoding as keys.

    Raises :class:`~idemmail_celery.errors.UnserializableArgumentsError` for values JSON cannot hold.
    """
    return None if value is None else canonical_json(value)


#: What :meth:`Ledger.forget` keeps of an error: machine-readable words and times, never free text. (A
#: write-ahead mark is no error: it lives in a field of its own, which forget leaves as it is.)
FORGET_KEEPS_ERROR = ("type", "reason", "cause", "at", "maybe_sent")
#: ... and of a resolution (who decided, when): its note is free text.
FORGET_KEEPS_RESOLUTION = ("from", "to", "at", "by")


Texts = tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]


def forgotten(record: Record) -> Texts:
    """A record's result, error and resolution with every free text erased (see :meth:`Ledger.forget`).

    The result keeps its ``message_id`` (what a duplicate is told), the error its
    :data:`FORGET_KEEPS_ERROR` fields, the resolution its :data:`FORGET_KEEPS_RESOLUTION`.
    Each is marked ``"forgotten": True``.
    """
    result, error, resolution = record.result, record.error, record.resolution
    kept_result = None if result is None else {"message_id": result.get("message_id"), "forgotten": True}
    kept_error = None
    if error is not None:
        kept_error = {**{k: error[k] for k in FORGET_KEEPS_ERROR if k in error}, "forgotten": True}
    kept_resolution = None
    if resolution is not None:
        kept_resolution = {**{k: resolution[k] for k in FORGET_KEEPS_RESOLUTION if k in resolution}, "forgotten": True}
    return kept_result, kept_error, kept_resolution


def loads_json(text: str | bytes | None) -> dict[str, Any] | None:
    if text is None or text == "" or text == b"":
        return None
    out = json.loads(text)
    return out if isinstance(out, dict) else {"value": out}


@dataclass(frozen=True)
class RosterEntry:
    """One live worker in a ledger's key-secret roster (:meth:`Ledger.announce`)."""

    #: Who: ``host:pid`` of the worker's main process.
    member: str
    #: The ids of the key secrets it holds (:func:`idemmail_celery.keys.secret_id`), newest first.
    secret_ids: tuple[str, ...]
    #: When the entry lapses unless announced again (epoch seconds, the store's clock where it has one).
    expires_at: float


#: The longest member name and secret-id list a roster entry holds (both are short: ``host:pid``, and
#: 12 hex digits per secret, at most a few secrets).
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
    """A ledger that can tell when its store lost records (the Redis ledger's epoch markers).

    Operator tools open such a ledger ``passive`` (reading markers, never writing them) and
    offer ``init`` and ``ack-loss``; ``recovered_at`` says when a loss was acknowledged.
    """

    def loss_status(self) -> dict[str, Any]:
        """What the store's markers say (epoch, lost flags, acknowledgements)."""

    def init_store(self, *, actor: str = "") -> dict[str, Any]:
        """Write the markers of a new, empty store."""

    def acknowledge_loss(self, *, note: str, actor: str = "") -> dict[str, Any]:
        """Accept that records were lost and start a new epoch."""


class Ledger(ABC):
    """Base class of every ledger backend.

    Construct one with :func:`idemmail_celery.ledger.from_url`. Instances are
    safe to share between threads; after ``fork()`` a backend reconnects.
    """

    def __init__(self, *, retention_seconds: float = DEFAULT_RETENTION_SECONDS, keep_payload: bool = False) -> None:
        self.retention_seconds = float(retention_seconds)
        #: Keep the first payload (personal data) after ``sent``, for audit. Off by default:
        #: backends erase it in the same atomic step that records ``sent``.
        self.keep_payload = bool(keep_payload)
        #: After an acknowledged loss of the store's contents (Redis ``ledger ack-loss``): when it
        #: was acknowledged. A new claim for an intent enqueued before then may be a copy of one
        #: sent and forgotten; :class:`~idemmail_celery.IdempotentTask` parks those for review
        #: unless the key travels downstream. None for a store that lost nothing.
        self.recovered_at: float | None = None

    # -- the hot path: one atomic operation each --

    @abstractmethod
    def claim(self, request: ClaimRequest) -> Claim:
        """Claim ``request.key``, or report what holds it. Never blocks on another holder."""

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """Claim a batch of distinct keys; one :class:`Claim` per request, in order.

        Backends batch the round trips (a Redis pipeline, a multi-row SQL insert);
        each claim is as atomic as :meth:`claim`. Claim a batch just before
        sending it: claims taken long before would let their leases run out.
        """
        _check_unique(requests)
        return [self.claim(r) for r in requests]

    @abstractmethod
    def _finish(
        self,
        key: str,
        token: int,
        state: State,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        mark: Mark | None = None,
    ) -> float | None:
        """Move the claim held with ``token`` to ``state`` (sent/failed/review/released).

        Moving to ``sent`` also erases the stored payload unless ``self.keep_payload``. The record's
        write-ahead mark (:attr:`Record.mark`) goes with any move; a release may leave ``mark`` in its
        place, for the next claimer (a holder that may have sent, retried with its key). ``result`` and
        ``error`` of None keep what the record has.
        Returns the time written as the record's ``updated_at``, exactly as :meth:`get` will read
        it back (a store keeping milliseconds says milliseconds), or None when it cannot say (a
        move that had already landed).

        Implements the fencing rule in the module docstring atomically; raises
        :class:`StaleTokenError` when it refuses, :class:`RecordNotFoundError`
        when there is no record.
        """

    @abstractmethod
    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        """Extend the lease of a claim still held with ``token``. False if it is not."""

    def withdraw(self, key: str, token: int) -> bool:
        """Take back a claim that never ran, as if it had never been made: the record (and its stored
        payload) goes, and the next claim of ``key`` is ``acquired``. Only a ``claimed`` record held
        with ``token``; False (nothing changed) for any other token or state, or without a record.

        For a claim the caller has just ``acquired`` and decided not to run: during a key-secret
        rotation, another delivery of the same intent claimed it under another key meanwhile (see
        :meth:`~idemmail_celery.handler.Handler.cross_check`). A claim whose side effect may have
        begun must never be withdrawn: it would leave no trace of a send.

        This default raises :class:`NotImplementedError` (a backend that cannot delete a record
        under its token atomically must not pretend to); the built-in backends do it in one
        atomic operation.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot withdraw a claim")

    #: Does a reclaim from a holder that made no write-ahead promise (:attr:`Record.writes_ahead`) and
    #: left no mark write the mark ``Mark(UNKNOWN_STAGE, ...)`` with that holder's token? The built-in
    #: backends do; then a claim resumed after this chain's own reclaim, carrying no mark, is known
    #: not to have been sent by the holder it took over from. Without it such a claim is parked.
    marks_takeovers: bool = False

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        """Record, before a side effect that carries no key can happen, that the holder is about to
        begin it: the claim held with ``token`` gets the mark ``Mark(stage, time, token, owner)`` (its
        :attr:`Record.mark`) and a fresh lease. False (nothing written) if ``token`` no longer holds it.
        ``owner``, the holder's (as its claim returned it), goes in the mark too: a later delivery of the
        holder's own chain, which carries it, knows the mark for its own (see
        :func:`~idemmail_celery.handler.live_mark`).

        A claim whose holder promised marks (:attr:`Record.writes_ahead`) and died without one is known
        not to have run its side effect: the next claimer runs it instead of parking it for
        review. The mark stays until the claim moves on (any move drops it; a release may leave another);
        a reclaim keeps it, so the next claimer sees it.

        This default reads the record, replaces it under its token and renews the lease (a
        backend's ``_force`` need not keep leases): three round trips. The built-in backends
        override it with one atomic operation.
        """
        record = self.get(key)
        if record is None or record.state is not State.CLAIMED or record.token != token:
            return False
        now = time.time()
        marked = replace(record, mark=Mark(stage, now, token, owner), lease_expires_at=now + lease_seconds)
        return self._force(key, token, marked) and self.renew(key, token, lease_seconds)

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool | None:
        """Note that the reschedule ``hop`` of a copy of ``key`` is being published, once.

        True the first time ``(key, hop)`` is marked, False for every later call within
        ``ttl_seconds``: of the copies of one broker message (redelivered by a Redis or SQS
        transport while the first still waited for its countdown), only the first publishes a
        reschedule, so waiting copies never multiply; the others drop once it has said its
        reschedule is out (see :meth:`hop_marked`). None: this backend
        keeps no marks (the caller reschedules; countdowns below the visibility timeout keep
        copies from multiplying). One round trip; called only when a claim is busy.
        """
        return None

    def hop_marked(self, key: str, hop: str) -> bool | None:
        """Is ``(key, hop)`` marked (:meth:`mark_hop`), its mark still live? A read: it marks nothing.

        How a copy that found its hop marked learns whether the copy that marked it has said since that
        its reschedule is out (see :meth:`~idemmail_celery.handler.Handler.in_flight`). None: this backend
        keeps no marks. One round trip; called only by such a copy.
        """
        return None

    # -- the key-secret roster: which secrets the live workers hold --

    def announce(self, member: str, secret_ids: Sequence[str], ttl_seconds: float) -> None:
        """Put ``member`` (a live worker, ``host:pid``) in the roster of this ledger's workers, holding the
        key secrets ``secret_ids``, for ``ttl_seconds`` unless announced again (a heartbeat); 0 or less
        takes it out (a warm shutdown). Replaces the member's earlier entry. One round trip.

        A process configured with several key secrets makes keys and seals under the newest one that
        every live worker of the ledger holds (:mod:`idemmail_celery.roster`): that is what makes a
        key-secret rotation safe in one rolling deploy. ``ValueError`` for a member or ids no store holds
        (:func:`check_roster_entry`). This default raises :class:`NotImplementedError`: without a roster,
        processes make keys under their first secret, and a rotation takes two deploys.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no key-secret roster")

    def roster(self) -> list[RosterEntry]:
        """The live entries of the roster (:meth:`announce`), in no particular order; lapsed ones are left out
        (and may be deleted). :class:`NotImplementedError` by default, like :meth:`announce`."""
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
        """Erase the personal data of ``key`` (a data-subject request); False if there is no record.

        Erases the stored first payload and every free text the record holds: the result is
        cut down to its message id, the error to its machine-readable fields (type, reason,
        cause, times), the resolution to who and when (see :func:`forgotten`). The record, its
        state and fingerprint stay, so the key keeps protecting against a resend; an operator
        can no longer re-enqueue the first payload. Idempotent.

        The erase is made of what was read, so it lands only on the record as read (its token and
        state). A write-ahead mark is left as it is (one written in between too): it holds no free
        text, and without it the next claimer would take a claim that may have sent for one that
        never ran.
        """
        for _ in range(5):
            record = self._readable(key)
            if record is None:
                return False
            if self._erase(key, record.token, record.state, *forgotten(record)):
                return True
        raise IllegalTransitionError(f"record {key} kept changing while forgetting; try again")

    def _readable(self, key: str) -> Record | None:
        """The record as :meth:`forget` reads it: every field this process can read (a sealed
        ledger's override leaves out those sealed with keys it does not hold)."""
        return self.get(key)

    @abstractmethod
    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None, resolution: dict[str, Any] | None) -> bool:
        """Drop the stored payload and set ``result``, ``error`` and ``resolution``, atomically, if the record's
        token and state are still ``expected_token`` and ``expected_state``; False (nothing written)
        otherwise or without a record.

        Never creates a record and changes nothing else (state, lease, token, expiry, write-ahead mark).
        """

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
        """The store itself: this ledger, or what a wrapper (sealed, metered) wraps. Ask it for an
        optional capability (``isinstance(ledger.backend, DetectsLoss)``): since Python 3.12 a
        runtime-checkable protocol no longer sees what a wrapper forwards through ``__getattr__``."""
        return self

    def close(self) -> None:
        """Release connections. The ledger reconnects if used again."""
        return None

    def prepare(self) -> None:
        """Check the store and read what a process must hold before its first claim.

        A worker calls this in its main process before the pool forks, so that every
        pool child, and every child started later in its place, inherits it (the Redis
        ledger's epoch: a child that only met the store after it was emptied could not
        tell a loss from a new ledger). Raises :class:`LedgerUnavailableError` when the
        store cannot be reached; the default does nothing.
        """
        return None

    # -- transitions, in words --

    def complete(self, key: str, token: int, result: dict[str, Any]) -> float | None:
        """``claimed`` -> ``sent`` with the side effect's result. Returns when it was recorded, as a
        duplicate will read it (``Record.updated_at``), or None when the store cannot say."""
        return self._finish(key, token, State.SENT, result=result)

    def fail(self, key: str, token: int, error: dict[str, Any]) -> None:
        """``claimed`` -> ``failed``: nothing was or will be sent; the error is replayed."""
        self._finish(key, token, State.FAILED, error=error)

    def park(self, key: str, token: int, error: dict[str, Any]) -> None:
        """``claimed`` -> ``review``: the outcome cannot be known; a person decides."""
        self._finish(key, token, State.REVIEW, error=error)

    def release(self, key: str, token: int, error: dict[str, Any] | None = None, *, mark: Mark | None = None) -> None:
        """``claimed`` -> ``released``: the next claim runs the stored payload. ``mark``: the write-ahead mark the
        next claimer finds (the holder may have sent, and is retried with its key); none by default."""
        self._finish(key, token, State.RELEASED, error=error, mark=mark)

    def confirm_sent(self, key: str, result: dict[str, Any], *, note: str = "", actor: str = "",
                     expect: Record | None = None) -> Record:
        """Evidence from outside (a provider webhook, a search) that the intent was delivered.

        Moves ``review``, ``released``, ``failed`` or ``claimed`` (live or not) to ``sent`` with
        ``result``; a ``sent`` record is returned unchanged. The holder of a live claim then
        finds its token stale when it records, and keeps the confirmed result. With ``expect``,
        only that record as it was (its state and token): anything that moved it since (an
        operator's decision, a new claim) stands, and :class:`IllegalTransitionError` says so.
        """
        for _ in range(5):
            record = self.get(key)
            if record is None:
                raise RecordNotFoundError(f"no ledger record for key {key}")
            if record.state is State.SENT:
                return record
            if expect is not None and (record.state, record.token) != (expect.state, expect.token):
                raise IllegalTransitionError(f"record {key} is {record.state.value} with token {record.token} now, "
                                             f"not {expect.state.value} with token {expect.token}: left as it is")
            now = time.time()
            new = replace(
                record, state=State.SENT, token=record.token + 1, lease_expires_at=None, result=result,
                payload=record.payload if self.keep_payload else None, mark=None,
                resolution={"from": record.state.value, "to": "sent", "at": now, "by": actor or default_owner(),
                            "note": note},
                updated_at=now, expires_at=now + self.retention_seconds,
            )
            if self._force(key, record.token, new):
                return new
        raise IllegalTransitionError(f"record {key} kept changing while confirming; look again")

    def resolve(
        self,
        key: str,
        state: State | str,
        *,
        result: dict[str, Any] | None = None,
        note: str = "",
        actor: str = "",
    ) -> Record:
        """Operator decision on a record that is not live: ``review``/``failed``/``released``/expired claim.

        ``state`` is ``sent`` (it did go out; ``result`` may carry the message id),
        ``failed`` (it did not and must not), or ``released`` (it did not; let the
        next claim send the stored payload). Who, when and why are kept in the record's
        :attr:`~Record.resolution`. A live claim or a ``sent`` record cannot be changed.
        """
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
                f"record {key} is {record.state.value}{' with a live lease' if live else ''}; "
                "it cannot be resolved"
            )
        resolution = {"from": record.state.value, "to": target.value, "at": now,
                      "by": actor or default_owner(), "note": note}
        new = replace(
            record,
            state=target,
            token=record.token + 1,
            lease_expires_at=None,
            payload=None if target is State.SENT and not self.keep_payload else record.payload,
            result=result if target is State.SENT else record.result,
            mark=None,
            resolution=resolution,
            updated_at=now,
            expires_at=now + self.retention_seconds if target.expires else None,
        )
        if not self._force(key, record.token, new):
            raise IllegalTransitionError(f"record {key} changed while resolving; look again")
        return new

    # -- listing: the review queue (see ``listing``) --

    def list_records(self, query: RecordQuery | None = None, *, cursor: str | None = None, offset: int = 0,
                     limit: int = 100) -> RecordPage:
        """One page of the records ``query`` names, in its order (by the time each entered its state):
        ``limit`` of them after ``cursor`` (a page's ``next_cursor``) and ``offset`` more.

        The Django admin's pages and ``idemmail ledger list`` are this call. A cursor stays good while
        records come and go (each page starts after the last record of the one before); ``offset`` serves a
        page picked by its number. :class:`ValueError` for a cursor not made for this query's order.
        """
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
        """How many records ``query`` names, and how they divide by reason, task and day (see :class:`Summary`):
        read from :meth:`count` of its state and time range."""
        query = query or RecordQuery()
        return self.count(query).summary(query)

    def count(self, query: RecordQuery | None = None) -> Counts:
        """The records in ``query``'s state and time range (its other filters aside), counted by reason, task and
        UTC day (:class:`Counts`). This default reads every record with :meth:`iter_records`; the built-in
        backends count in the store."""
        query = query or RecordQuery()
        return count_in_memory(self.iter_records(query.state), query, time.time())

    def _listing_window(self, query: RecordQuery, position: Position | None, want: int, skip: int) -> Selection:
        """The records after ``position`` in ``query``'s order: at least ``want`` of them unless fewer
        follow, each with its position; records the query does not match may be among them (the caller
        checks), none that it matches may be left out. ``skip``: matching records the store may leave out
        first, saying how many in :attr:`Selection.skipped` (0 is always right).

        This default reads every record of the state with :meth:`iter_records` and sorts them here.
        """
        return select_in_memory(self.iter_records(query.state), query, position, skip, time.time())
