"""What a ledger holds and answers: the states of an intent (:class:`State`), a record (:class:`Record`), and what a
claim found (:class:`ClaimStatus`, :class:`Claim`). Plain values, importing nothing of the ledger: the base class
(``base.py``), the listing (``listing.py``) and every backend build on them."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class State(str, enum.Enum):
    """Where an intent stands. The only place state names are defined."""

    CLAIMED = "claimed"
    RELEASED = "released"
    SENT = "sent"
    FAILED = "failed"
    REVIEW = "review"

    @property
    def is_final(self) -> bool:
        """``sent``, ``failed`` and ``review`` end an attempt; duplicates replay them."""
        return self in (State.SENT, State.FAILED, State.REVIEW)

    @property
    def expires(self) -> bool:
        """Only ``sent`` and ``failed`` records get the retention TTL."""
        return self in (State.SENT, State.FAILED)


class ClaimStatus(str, enum.Enum):
    """What a call to :meth:`Ledger.claim <idemmail_celery.ledger.base.Ledger.claim>` found and did."""

    ACQUIRED = "acquired"    # no record (or an expired final one): the caller holds a new claim
    REOPENED = "reopened"    # a released claim: the caller holds it; run the stored payload
    RECLAIMED = "reclaimed"  # a claim whose lease expired: the caller holds it with a new token
    RESUMED = "resumed"      # a claim held by ``request.resume_owner`` (live or not): the caller holds it again
    BUSY = "busy"            # another holder's lease is live: try later
    DONE = "done"            # a final record: replay it

    @property
    def holds(self) -> bool:
        """Does the caller now hold the claim (and must settle it)?"""
        return self in (ClaimStatus.ACQUIRED, ClaimStatus.REOPENED, ClaimStatus.RECLAIMED, ClaimStatus.RESUMED)


@dataclass(frozen=True)
class Record:
    """One intent's ledger entry. Times are Unix epoch seconds (floats)."""

    key: str
    task_name: str
    state: State
    token: int
    owner: str
    lease_expires_at: float | None
    attempts: int
    reclaims: int
    payload: str | None
    fingerprint: str
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    expires_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (for the CLI and logs); ``payload`` is left out."""
        return {
            "key": self.key, "task_name": self.task_name, "state": self.state.value,
            "token": self.token, "owner": self.owner, "lease_expires_at": self.lease_expires_at,
            "attempts": self.attempts, "reclaims": self.reclaims, "fingerprint": self.fingerprint,
            "result": self.result, "error": self.error, "created_at": self.created_at,
            "updated_at": self.updated_at, "expires_at": self.expires_at,
        }


@dataclass(frozen=True)
class Claim:
    """The answer to :meth:`Ledger.claim <idemmail_celery.ledger.base.Ledger.claim>`: what happened, and the record as
    it now is."""

    status: ClaimStatus
    record: Record
    #: Who held the claim just before this one took it (``reclaimed`` and ``resumed`` claims; None
    #: otherwise, or when the store cannot say): whether that holder promised a write-ahead mark
    #: (:func:`~idemmail_celery.ledger.base.owner_writes_ahead`) tells a claim it left unmarked from one that may
    #: have run.
    previous_owner: str | None = None

    @property
    def token(self) -> int:
        return self.record.token
