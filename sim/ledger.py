"""The simulator's stores: a ledger in memory that honours the :class:`~idemmail_celery.ledger.Ledger`
contract (the SQL backend's rules, one dict operation per transition), and the fault layer every
world wraps its store in (each call a scheduling point where the scheduler may fail it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from idemmail_celery.errors import LedgerLostError, LedgerUnavailableError, RecordNotFoundError, StaleTokenError
from idemmail_celery.ledger import Claim, ClaimRequest, ClaimStatus, Ledger, Record, State
from idemmail_celery.ledger.base import (
    UNKNOWN_STAGE,
    Mark,
    RosterEntry,
    check_roster_entry,
    dumps_json,
    loads_json,
)
from idemmail_celery.ledger.wrapper import LedgerWrapper


def _stored(value: dict[str, Any] | None) -> dict[str, Any] | None:
    return loads_json(dumps_json(value))


class MemLedger(Ledger):
    """A ledger in a dict, on the world's clock: the SQL ledger's rules (resume by owner, the late
    holder's ``sent``, the ``unknown`` mark a takeover writes), each transition atomic."""

    marks_takeovers = True

    def __init__(self, clock: Callable[[], float], **options: Any) -> None:
        super().__init__(**options)
        self.now = clock
        self.records: dict[str, Record] = {}
        self.hops: dict[str, float] = {}
        self.members: dict[str, RosterEntry] = {}

    def announce(self, member: str, secret_ids: Sequence[str], ttl_seconds: float) -> None:
        check_roster_entry(member, secret_ids)
        now = self.now()
        if ttl_seconds <= 0:
            self.members.pop(member, None)
        else:
            self.members[member] = RosterEntry(member, tuple(secret_ids), now + ttl_seconds)
        for gone in [m for m, e in self.members.items() if e.expires_at <= now]:  # reads never write
            del self.members[gone]

    def roster(self) -> list[RosterEntry]:
        now = self.now()
        return [e for e in self.members.values() if e.expires_at > now]

    def claim(self, request: ClaimRequest) -> Claim:
        now = self.now()
        seen = self.records.get(request.key)
        if seen is not None and seen.state.expires and (seen.expires_at or 0) <= now:
            seen = None  # an expired final record: a new intent
        if seen is None:
            old = self.records.get(request.key)
            record = Record(key=request.key, task_name=request.task_name, state=State.CLAIMED,
                            token=old.token + 1 if old else 1, owner=request.owner,
                            lease_expires_at=now + request.lease_seconds, attempts=1, reclaims=0,
                            payload=request.payload, fingerprint=request.fingerprint, created_at=now, updated_at=now,
                            writes_ahead=request.writes_ahead)
            self.records[request.key] = record
            return Claim(ClaimStatus.ACQUIRED, record)
        resume = seen.state is State.CLAIMED and seen.owner in (request.owner, request.resume_owner)
        if seen.state is State.CLAIMED and (seen.lease_expires_at or 0) > now and not resume:
            return Claim(ClaimStatus.BUSY, seen)
        if seen.state.is_final:
            return Claim(ClaimStatus.DONE, seen)
        if resume:
            status = ClaimStatus.RESUMED
        elif seen.state is State.CLAIMED:
            status = ClaimStatus.RECLAIMED
        else:
            status = ClaimStatus.REOPENED
        mark = seen.mark
        if status is ClaimStatus.RECLAIMED and not seen.writes_ahead and mark is None:
            mark = Mark(UNKNOWN_STAGE, int(now), seen.token)
        record = replace(seen, state=State.CLAIMED, token=seen.token + 1, owner=request.owner,
                         lease_expires_at=now + request.lease_seconds, attempts=seen.attempts + 1,
                         reclaims=seen.reclaims + (status is ClaimStatus.RECLAIMED), updated_at=now, mark=mark,
                         writes_ahead=request.writes_ahead)
        self.records[request.key] = record
        if seen.state is not State.CLAIMED:
            return Claim(status, record)
        return Claim(status, record, previous_owner=seen.owner, previous_writes_ahead=seen.writes_ahead)

    def _finish(self, key: str, token: int, state: State, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, mark: Mark | None = None) -> float | None:
        now = self.now()
        seen = self.records.get(key)
        if seen is None:
            raise RecordNotFoundError(f"no ledger record for key {key}")
        mine = seen.state is State.CLAIMED and seen.token == token
        late = state is State.SENT and seen.token > token and seen.state in (State.REVIEW, State.RELEASED,
                                                                             State.CLAIMED)
        if not (mine or late):
            if seen.state is state and seen.token == token:
                return seen.updated_at
            raise StaleTokenError(f"token {token} no longer holds {key}: it is {seen.state.value} "
                                  f"with token {seen.token}")
        result, error = _stored(result), _stored(error)  # as a store keeps them: JSON, refused if it cannot be
        self.records[key] = replace(
            seen, state=state, lease_expires_at=None, updated_at=now,
            expires_at=now + self.retention_seconds if state.expires else None,
            result=result if result is not None else seen.result,
            error=error if error is not None else seen.error, mark=mark,
            payload=None if state is State.SENT and not self.keep_payload else seen.payload)
        return now

    def _held(self, key: str, token: int) -> Record | None:
        seen = self.records.get(key)
        return seen if seen is not None and seen.state is State.CLAIMED and seen.token == token else None

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        seen = self._held(key, token)
        if seen is None:
            return False
        self.records[key] = replace(seen, lease_expires_at=self.now() + lease_seconds)
        return True

    def withdraw(self, key: str, token: int) -> bool:
        if self._held(key, token) is None:
            return False
        del self.records[key]
        return True

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        seen = self._held(key, token)
        if seen is None:
            return False
        now = self.now()
        self.records[key] = replace(seen, mark=Mark(stage, now, token, owner), lease_expires_at=now + lease_seconds)
        return True

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool | None:
        now, name = self.now(), f"{key}\0{hop}"
        if self.hops.get(name, 0.0) > now:
            return False
        self.hops[name] = now + ttl_seconds
        return True

    def hop_marked(self, key: str, hop: str) -> bool | None:
        return self.hops.get(f"{key}\0{hop}", 0.0) > self.now()

    def get(self, key: str) -> Record | None:
        seen = self.records.get(key)
        if seen is not None and seen.state.expires and (seen.expires_at or 0) <= self.now():
            return None
        return seen

    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        now = self.now()
        for record in list(self.records.values()):
            if (state is None or record.state is state) and not (record.state.expires
                                                                 and (record.expires_at or 0) <= now):
                yield record

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        seen = self.records.get(key)
        if seen is None or seen.token != expected_token:
            return False
        new = replace(new, result=_stored(new.result), error=_stored(new.error), resolution=_stored(new.resolution))
        self.records[key] = replace(new, payload=None) if new.state is State.SENT and not self.keep_payload else new
        return True

    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None, resolution: dict[str, Any] | None) -> bool:
        seen = self.records.get(key)
        if seen is None or seen.token != expected_token or seen.state is not expected_state:
            return False
        self.records[key] = replace(seen, payload=None, result=_stored(result), error=_stored(error),
                                    resolution=_stored(resolution))
        return True

    def purge_expired(self, now: float | None = None) -> int:
        cutoff = self.now() if now is None else now
        gone = [k for k, r in self.records.items() if r.state.expires and (r.expires_at or 0) <= cutoff]
        for k in gone:
            del self.records[k]
        return len(gone)

    def ping(self) -> None:
        return None

    def lose_everything(self) -> None:
        """The store came back empty (a Redis restart without persistence)."""
        self.records.clear()
        self.hops.clear()


#: How a ledger call may go: it lands and answers; it fails before the store saw it; it lands and
#: its reply is lost (a timeout looks the same to the caller).
OK, BEFORE, AFTER = "ok", "before", "after"


class FaultLedger(LedgerWrapper):
    """The store as the handler sees it: every call hands control to the scheduler first, which says
    whether it lands, fails before the write, or lands with its reply lost; a lost store answers
    :class:`LedgerLostError` until an operator acknowledges the loss."""

    def __init__(self, inner: Ledger, point: Callable[[str, str], str], world: Any) -> None:
        super().__init__(inner)
        self._point, self._world = point, world

    def _call(self, op: str, key: str, fn: Callable[[], Any]) -> Any:
        how = self._point(op, key)
        if self._world.store_lost:
            raise LedgerLostError("the store lost its records and the loss is not acknowledged yet")
        if how == BEFORE:
            raise LedgerUnavailableError(f"connection refused ({op})")
        out = fn()
        if how == AFTER:
            raise LedgerUnavailableError(f"timed out waiting for the reply ({op})")
        return out

    def claim(self, request: ClaimRequest) -> Claim:
        out: Claim = self._call("claim", request.key, lambda: self.inner.claim(request))
        return out

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        out: list[Claim] = self._call("claim_many", ",".join(r.key for r in requests),
                                      lambda: self.inner.claim_many(requests))
        return out

    def _finish(self, key: str, token: int, state: State, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, mark: Mark | None = None) -> float | None:
        if state is State.REVIEW:
            self._world.parking(key)
        out: float | None = self._call(state.value, key, lambda: self.inner._finish(
            key, token, state, result=result, error=error, mark=mark))
        return out

    def withdraw(self, key: str, token: int) -> bool:
        return bool(self._call("withdraw", key, lambda: self.inner.withdraw(key, token)))

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        self._world.note_mark(key, token)
        return bool(self._call("write_ahead", key, lambda: self.inner.write_ahead(key, token, lease_seconds, stage,
                                                                                   owner=owner)))

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool | None:
        out: bool | None = self._call("mark_hop", key, lambda: self.inner.mark_hop(key, hop, ttl_seconds))
        return out

    def hop_marked(self, key: str, hop: str) -> bool | None:
        out: bool | None = self._call("hop_marked", key, lambda: self.inner.hop_marked(key, hop))
        return out

    def get(self, key: str) -> Record | None:
        out: Record | None = self._call("get", key, lambda: self.inner.get(key))
        return out

    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        out: list[Record] = self._call("scan", "", lambda: list(self.inner.iter_records(state)))
        return iter(out)

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        return bool(self._call("force", key, lambda: self.inner._force(key, expected_token, new)))

    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None, resolution: dict[str, Any] | None) -> bool:
        return bool(self._call("erase", key, lambda: self.inner._erase(key, expected_token, expected_state, result,
                                                                       error, resolution)))

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        return self.inner.renew(key, token, lease_seconds)  # the keeper's: a scheduler event, not a point
