"""What a ledger holds and answers: the states of an intent (:class:`State`), a record (:class:`Record`) and its
write-ahead mark (:class:`Mark`), and what a claim found (:class:`ClaimStatus`, :class:`Claim`). Plain values,
importing nothing of the ledger: the base class (``base.py``), the listing (``listing.py``) and every backend build
on them."""

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


#: The stage of the mark a ledger writes when a claim is taken over from a holder that made no
#: write-ahead promise and left no mark (``Ledger.marks_takeovers``): it may have run.
UNKNOWN_STAGE = "unknown"


@dataclass(frozen=True)
class Mark:
    """A write-ahead mark: the holder of a claim said, before a side effect that carries no key could begin,
    that it was about to begin it (see :meth:`Ledger.write_ahead <idemmail_celery.ledger.base.Ledger.write_ahead>`).

    Kept in a field of its own on a ``claimed`` record (never in its ``error``) until the claim moves on; a
    reclaim keeps it, so that the next claimer sees how far the holder it took over from had got. It holds no
    free text: a stage name, a time, and the token and owner of the claim that wrote it.
    """

    #: What the holder was about to begin (``"sending"``, ...), or :data:`UNKNOWN_STAGE`.
    stage: str
    #: When it was written (Unix seconds).
    at: float
    #: The token of the claim that wrote it.
    token: int
    #: The owner of the claim that wrote it, when that holder promised marks (:attr:`Record.writes_ahead`) and wrote
    #: it before its side effect (``Ledger.write_ahead``); "" for the marks a ledger or a release leaves (a takeover's
    #: ``unknown``, a maybe-send's ``maybe_sent``).
    owner: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The mark as a store keeps it (JSON)."""
        out: dict[str, Any] = {"stage": self.stage, "at": self.at, "token": self.token}
        if self.owner:
            out["owner"] = self.owner
        return out

    @classmethod
    def from_dict(cls, value: dict[str, Any] | None) -> Mark | None:
        """The mark a store read back (:meth:`to_dict`), or None for none."""
        if not value:
            return None
        return cls(stage=str(value["stage"]), at=value.get("at", 0), token=int(value.get("token", 0)),
                   owner=str(value.get("owner") or ""))


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
    #: The write-ahead mark of a ``claimed`` record (:class:`Mark`), or None; any move out of ``claimed``
    #: drops it, and only a release may carry one on to the next claimer.
    mark: Mark | None = None
    #: Did the holder of the record's latest claim promise a write-ahead mark before its side effect
    #: (:attr:`ClaimRequest.writes_ahead <idemmail_celery.ledger.base.ClaimRequest.writes_ahead>`)? A claim it left
    #: without a mark is then known not to have run it. Redis field ``p``, SQL column ``writes_ahead``.
    writes_ahead: bool = False
    #: An operator's decision on the record (:meth:`Ledger.resolve <idemmail_celery.ledger.base.Ledger.resolve>`,
    #: ``confirm_sent``): ``{"from", "to", "at", "by", "note"}``, or None. Kept apart from the error it decided on.
    resolution: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (for the CLI and logs); ``payload`` is left out."""
        return {
            "key": self.key, "task_name": self.task_name, "state": self.state.value,
            "token": self.token, "owner": self.owner, "lease_expires_at": self.lease_expires_at,
            "attempts": self.attempts, "reclaims": self.reclaims, "fingerprint": self.fingerprint,
            "result": self.result, "error": self.error, "created_at": self.created_at,
            "updated_at": self.updated_at, "expires_at": self.expires_at,
            "mark": None if self.mark is None else self.mark.to_dict(), "resolution": self.resolution,
            "writes_ahead": self.writes_ahead,
        }


@dataclass(frozen=True)
class Claim:
    """The answer to :meth:`Ledger.claim <idemmail_celery.ledger.base.Ledger.claim>`: what happened, and the record as
    it now is."""

    status: ClaimStatus
    record: Record
    #: Who held the claim just before this one took it (``reclaimed`` and ``resumed`` claims; None
    #: otherwise, or when the store cannot say).
    previous_owner: str | None = None
    #: Did that holder promise a write-ahead mark (:attr:`Record.writes_ahead`)? Tells a claim it left unmarked
    #: (it never began its side effect) from one that may have run. False without a previous holder.
    previous_writes_ahead: bool = False

    @property
    def token(self) -> int:
        return self.record.token
