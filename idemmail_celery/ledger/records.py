"""What a ledger holds and answers: :class:`State`, :class:`Record`, :class:`Mark`, :class:`ClaimStatus` and
:class:`Claim`. Plain values, importing nothing of the ledger."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
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


#: The stage of the mark a takeover writes for a holder without promise or mark (``Ledger.marks_takeovers``).
UNKNOWN_STAGE = "unknown"


@dataclass(frozen=True)
class Mark:
    """A write-ahead mark: the claim's holder was about to begin a side effect that carries no key. No free text."""

    #: What the holder was about to begin (``"sending"``, ...), or :data:`UNKNOWN_STAGE`.
    stage: str
    #: When it was written (Unix seconds).
    at: float
    #: The token of the claim that wrote it.
    token: int
    #: The owner of the claim that wrote it with ``Ledger.write_ahead``; "" for marks a ledger or a release leaves.
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
    #: The write-ahead mark of a ``claimed`` record, or None; only a release may carry one past ``claimed``.
    mark: Mark | None = None
    #: Did the latest claim's holder promise a write-ahead mark (``ClaimRequest.writes_ahead``)? Then a claim it
    #: left without one never ran its side effect.
    writes_ahead: bool = False
    #: An operator's decision (``Ledger.resolve``, ``confirm_sent``): ``{"from", "to", "at", "by", "note"}``, or None.
    resolution: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view (for the CLI and logs); ``payload`` is left out."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "payload"}
        return {**out, "state": self.state.value, "mark": None if self.mark is None else self.mark.to_dict()}


@dataclass(frozen=True)
class Claim:
    """The answer to ``Ledger.claim``: what happened, and the record as it now is."""

    status: ClaimStatus
    record: Record
    #: Who held the claim just before this one took it (``reclaimed`` and ``resumed`` claims), or None.
    previous_owner: str | None = None
    #: Did that holder promise a write-ahead mark (:attr:`Record.writes_ahead`)? False without one.
    previous_writes_ahead: bool = False

    @property
    def token(self) -> int:
        return self.record.token
