"""The handler's vocabulary: what a delivery is, what a step tells the adapter to do, and what a claim shows.

:class:`Delivery` (in), :class:`Step` (out), :class:`Outcome` and :class:`Action` name them; :class:`Policy`
holds the numbers; :class:`SideEffect` is what an adapter lends. The decisions are in ``handler.py``.
"""

from __future__ import annotations

import datetime as _dt
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .chain import Carry, Verdict, held_by
from .config import DEFAULTS
from .errors import SendError
from .keys import Payload
from .ledger import Claim, ClaimRequest, ClaimStatus, Ledger, Record
from .ledger.base import UNKNOWN_STAGE, Mark
from .redaction import scrub


class Outcome(str, enum.Enum):
    """What one delivery of an intent came to: the one vocabulary of logs, Flower events,
    metrics, bulk tallies, agent tools and the CLI."""

    SENT = "sent"                              #: the side effect ran and its result is recorded
    DUPLICATE = "duplicate"                    #: a final record was replayed; nothing ran
    FAILED = "failed"                          #: failed for good (or refused as invalid); replayed to duplicates
    REVIEW = "review"                          #: parked: the outcome cannot be known, a person decides
    RETRY = "retry"                            #: nothing left the process (or the key travels): retried
    IN_FLIGHT = "in_flight"                    #: another holder's claim is live: rescheduled
    IN_FLIGHT_GAVE_UP = "in_flight_gave_up"    #: ...and the in-flight budget ran out
    COPY_DROPPED = "copy_dropped"              #: a second copy of a reschedule already published: dropped
    LEDGER_UNAVAILABLE = "ledger_unavailable"  #: fail closed: rescheduled until the ledger (or set-up) is back
    LEDGER_GAVE_UP = "ledger_unavailable_gave_up"  #: the outage budget ran out: the message fails
    SETUP_ERROR = "setup_error"                #: a missing API key or driver, a broken install: as above
    RECLAIMED = "reclaimed"                    #: a dead holder's expired lease was taken over (a step)
    KEY_REUSE = "key_reuse"                    #: refused: the key came back with other must-match values
    FAIL_OPEN = "fail_open"                    #: the ledger was down and fail_open ran the body without a claim
    INVALID = "invalid"                        #: refused before anything was enqueued (agent tools)
    PENDING = "pending"                        #: not settled within the caller's wait; asking again is safe
    ERROR = "error"                            #: the task failed in a way none of the above describes

    def __str__(self) -> str:
        return self.value


class Action(enum.Enum):
    """What the adapter does with a :class:`Step`."""

    RETURN = "return"          #: return ``Step.value`` (the task succeeds)
    RAISE = "raise"            #: raise ``Step.error`` (the task fails; re-raised as is)
    RETRY = "retry"            #: retry after ``Step.countdown`` on the task's own retry budget
    RESCHEDULE = "reschedule"  #: publish again after ``Step.countdown``, on no retry budget
    DROP = "drop"              #: acknowledge, record no result: another copy carries on


@dataclass(frozen=True)
class Step:
    """The handler's answer for one delivery."""

    outcome: Outcome
    action: Action
    key: str
    value: Any = None
    error: BaseException | None = None
    countdown: float = 0.0
    #: What the next delivery of this chain gets (RETRY and RESCHEDULE; written as headers by the adapter).
    carry: Carry = field(default_factory=Carry)
    #: RETRY only: does it spend one of the task's ``max_retries``? (Not a retry on the time budget.)
    counted: bool = True
    #: RESCHEDULE only: the hop this reschedule is the one publish of; once published, the adapter calls
    #: :meth:`Handler.published` so that the hop's later copies drop (:meth:`Handler.in_flight`).
    confirms_hop: str = ""


@dataclass(frozen=True)
class Policy:
    """The numbers the state machine works with (from :class:`~idemmail_celery.config.Settings`)."""

    lease_seconds: float = DEFAULTS["lease_seconds"]
    max_reclaims: int = DEFAULTS["max_reclaims"]
    inflight_max_retries: int = DEFAULTS["inflight_max_retries"]
    inflight_backoff: float = DEFAULTS["inflight_backoff"]
    inflight_backoff_max: float = DEFAULTS["inflight_backoff_max"]
    retry_backoff: float = DEFAULTS["retry_backoff"]
    retry_backoff_max: float = DEFAULTS["retry_backoff_max"]
    retry_jitter: bool = True
    #: How long after the first enqueue (``Delivery.retry_from``) a failure that sent nothing is still retried.
    retry_deadline_seconds: float = DEFAULTS["retry_deadline_seconds"]
    outage_max_retries: int | None = DEFAULTS["outage_max_retries"]
    fail_open: bool = DEFAULTS["fail_open"]
    #: How long a reschedule's mark is kept (``Ledger.mark_hop``): longer than a copy of the message can come back.
    hop_ttl_seconds: float = 3600.0


@dataclass(frozen=True)
class Delivery:
    """One delivery of an intent, as the adapter knows it."""

    key: str
    task_name: str
    payload: Payload
    #: Who is delivering (a task id): part of every claim owner, so operators can tell them apart.
    attempt_id: str = ""
    #: ``retry()`` calls spent on this intent so far, and how many the task allows (None: no limit).
    retries: int = 0
    max_retries: int | None = 3
    #: When the retry deadline started: a failure that sent nothing is retried for ``Policy.retry_deadline_seconds``
    #: from then, whatever ``max_retries`` says, then ends ``failed`` (``retry_deadline``). None: ``max_retries``.
    retry_from: float | None = None
    #: This chain's reschedules so far: because a claim was busy, and because something was unavailable.
    inflight: int = 0
    outage: int = 0
    #: When the message was enqueued (caller's clock; None: not said): the ledger-loss rule counts from it.
    enqueued_at: float | None = None
    #: When its countdown or ETA first let it run, if later: the retention rule counts from it.
    due_at: float | None = None
    #: The owners this chain may still hold its claim under, newest first (a lost reply may or may not have
    #: landed, so the one before is kept too), and the verdict it could not record.
    resume_owners: tuple[str, ...] = ()
    verdict: Verdict | None = None
    #: The id of the published message this delivery is a copy of (``Ledger.mark_hop``).
    hop: str = ""
    #: The owner this delivery claims under (a new one is made when empty).
    owner: str = ""
    #: During a key-secret rotation: the intent's keys under the older secrets, newest first (one it is recorded
    #: under is claimed there), and, once :meth:`Handler.recorded_key` chose, the others (:meth:`Handler.cross_check`).
    older_keys: tuple[str, ...] = ()
    other_keys: tuple[str, ...] = ()

    def held(self, owner: str | None = None) -> Carry:
        """What this delivery hands the next one when it meets an outage: the owners that may hold its claim
        (``owner``, the one it just claimed under, first) and its verdict."""
        return Carry(owners=held_by(owner, self.resume_owners), verdict=self.verdict)


class SideEffect(Protocol):
    """What an adapter lends the handler: the side effect and what it knows about it."""

    def check(self, payload: Payload) -> None:
        """Refuse a call before anything is stored: bad input (:class:`InvalidEmail`, ``TypeError``, ...) ends
        ``failed``; :class:`ConfigurationError` (no set-up) waits on the outage budget."""

    def perform(self, payload: Payload, key: str) -> Any:
        """Run the side effect once under ``key``; return what to record, raise a :class:`SendError`."""

    def carries_key(self) -> bool:
        """Does the side effect pass the key to a service that de-duplicates on it?"""

    def writes_ahead(self) -> bool:
        """Does ``perform`` call :func:`~idemmail_celery.providers.base.about_to_send` before it can happen?"""

    def reconcile(self, key: str, payload: Payload) -> Any | None:
        """Ask the service whether the intent already happened: its result, or None (not proof)."""

    def report(self, outcome: Outcome, key: str, **fields: Any) -> None:
        """Tell logs, events and metrics (never raises)."""


class Settling(Protocol):
    """What ``rotation.py``, ``recovery.py`` and ``batch.py`` use of the
    :class:`~idemmail_celery.handler.Handler` (so they need not import it)."""

    ledger: Ledger
    policy: Policy
    effect: SideEffect

    def writes_ahead(self) -> bool: ...
    def check(self, d: Delivery) -> Step | None: ...
    def recorded_key(self, d: Delivery) -> Delivery: ...
    def request(self, d: Delivery, owner: str) -> ClaimRequest: ...
    def take_back(self, d: Delivery, claim: Claim, owner: str) -> Claim: ...
    def settle(self, d: Delivery, claim: Claim) -> Step: ...
    def in_flight(self, d: Delivery, record: Record) -> Step: ...
    def unavailable(self, d: Delivery, exc: Exception, *, carry: Carry | None = None,
                    value: Any = None, error: BaseException | None = None) -> Step: ...
    def record_sent(self, d: Delivery, claim: Claim, value: Any, *, reconciled: bool = False) -> Step: ...
    def park_unknown(self, d: Delivery, claim: Claim, reason: str, message: str, **extra: Any) -> Step: ...
    def reconciled(self, d: Delivery, record: Record) -> Any | None: ...
    def guarded(self, move: Callable[[], Any], report: Callable[..., None] | None = None) -> None: ...


# -- what a claim shows --

def live_mark(claim: Claim, owners: tuple[str, ...] = ()) -> Mark | None:
    """The write-ahead mark a claim came back with, unless it is void: written by an owner of this chain
    (``owners``), or, for a resumed claim, by the claim it resumed. Such a holder ended with a step: had it
    sent, or maybe sent, it would have carried a verdict; it carried none, so it sent nothing."""
    mark = claim.record.mark
    if mark is None:
        return None
    # Only a keyless holder's mark names its owner (a keyed one is retried with its key after a maybe-send).
    if mark.owner and owned_by(mark.owner, owners):
        return None
    if claim.status is not ClaimStatus.RESUMED:
        return mark
    # The one before, or any earlier one while never reclaimed (only ever passed between this chain's deliveries).
    if mark.token == claim.token - 1 or claim.record.reclaims == 0:
        return None
    return mark


def first_of_its_tokens(claim: Claim) -> bool:
    """Has this claim's record been held by this chain alone (``acquired``, or ``resumed`` and never reclaimed)?
    Only then may it be withdrawn: a holder it was taken from, only paused, could act with a restarted token."""
    return claim.status is ClaimStatus.ACQUIRED or (claim.status is ClaimStatus.RESUMED and claim.record.reclaims == 0)


def may_have_run(claim: Claim) -> bool:
    """Does a held claim show its side effect may have run under its key: a release, or a write-ahead mark
    other than the ``unknown`` one a takeover writes (during a rotation every holder marks before it runs)."""
    if claim.status is ClaimStatus.REOPENED:
        return True
    mark = claim.record.mark
    return mark is not None and mark.stage != UNKNOWN_STAGE


def owned_by(holder: str, owners: tuple[str, ...]) -> bool:
    """Is ``holder`` (a record's owner) one of ``owners``? (A store may add a suffix: the SQL ledgers' nonce.)"""
    return any(holder.startswith(o) for o in owners)


def writes_ahead(effect: SideEffect) -> bool:
    """Does ``effect`` mark the ledger before it can happen (only a keyless one does)? False when it cannot say."""
    try:
        return not effect.carries_key() and effect.writes_ahead()
    except Exception:
        return False


def snake(name: str) -> str:
    """``LedgerUnavailableError`` -> ``ledger_unavailable_error`` (exception types as reason words)."""
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


# -- what a step records and returns --

def error_record(exc: BaseException, reason: str, kind: type[SendError] | str) -> dict[str, Any]:
    """The ``error`` a ledger stores for a failed, parked or released attempt."""
    return {
        "type": kind if isinstance(kind, str) else kind.__name__,
        "reason": reason,
        "message": scrub(str(exc))[:500],  # no address of a task's own exception reaches the ledger
        "cause": type(exc).__name__,
        "at": time.time(),
    }


def message_id_of(value: Any) -> Any:
    """The provider's message id in a side effect's result, if it says one."""
    if isinstance(value, dict):
        return value.get("message_id") or value.get("id")
    return None


def sent_outcome(status: str, key: str, stored: dict[str, Any], at: float) -> dict[str, Any]:
    """What a task returns for a ``sent`` or ``duplicate`` outcome (and agent tools show)."""
    return {
        "status": status,
        "key": key,
        "message_id": stored.get("message_id"),
        "sent_at": _iso(at),
        "result": stored.get("value"),
    }


def _iso(ts: float | None) -> str | None:
    return None if not ts else _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).isoformat()
