"""A ledger that wraps another: the base of :class:`~.sealed.SealedLedger` and :class:`~.metered.MeteredLedger`.

Every operation goes to ``inner`` unchanged unless the subclass overrides it; any other
attribute (``prefix``, ``table``, ``recovered_at``, ``loss_status``, ...) is the inner
backend's own, read through, so wrapper and backend can never disagree. Wrappers compose:
``MeteredLedger(SealedLedger(RedisLedger(...)))``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .base import Claim, ClaimRequest, Ledger, Mark, Record, RosterEntry, State
from .listing import Counts, Position, RecordQuery, Selection


class LedgerWrapper(Ledger):
    """Forwards every :class:`Ledger` operation to ``inner``."""

    # No Ledger.__init__: retention_seconds, keep_payload, recovered_at and the rest are the
    # backend's, read through __getattr__.
    def __init__(self, inner: Ledger) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling, a failed __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def marks_takeovers(self) -> bool:  # type: ignore[override]
        return self.inner.marks_takeovers

    @property
    def backend(self) -> Ledger:
        """The innermost ledger: the store itself."""
        inner = self.inner
        return inner.backend if isinstance(inner, LedgerWrapper) else inner

    def claim(self, request: ClaimRequest) -> Claim:
        return self.inner.claim(request)

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        return self.inner.claim_many(requests)

    def _finish(self, key: str, token: int, state: State, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, mark: Mark | None = None) -> float | None:
        return self.inner._finish(key, token, state, result=result, error=error, mark=mark)

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        return self.inner.renew(key, token, lease_seconds)

    def withdraw(self, key: str, token: int) -> bool:
        return self.inner.withdraw(key, token)

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        return self.inner.write_ahead(key, token, lease_seconds, stage, owner=owner)

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool | None:
        return self.inner.mark_hop(key, hop, ttl_seconds)

    def hop_marked(self, key: str, hop: str) -> bool | None:
        return self.inner.hop_marked(key, hop)

    def announce(self, member: str, secret_ids: Sequence[str], ttl_seconds: float) -> None:
        self.inner.announce(member, secret_ids, ttl_seconds)

    def roster(self) -> list[RosterEntry]:
        return self.inner.roster()

    def get(self, key: str) -> Record | None:
        return self.inner.get(key)

    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        return self.inner.iter_records(state)

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        return self.inner._force(key, expected_token, new)

    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None, resolution: dict[str, Any] | None) -> bool:
        return self.inner._erase(key, expected_token, expected_state, result, error, resolution)

    def stats(self) -> dict[str, int]:
        return self.inner.stats()

    def purge_expired(self, now: float | None = None) -> int:
        return self.inner.purge_expired(now)

    def ping(self) -> None:
        self.inner.ping()

    def close(self) -> None:
        self.inner.close()

    def prepare(self) -> None:
        self.inner.prepare()

    def count(self, query: RecordQuery | None = None) -> Counts:
        return self.inner.count(query)

    def _listing_window(self, query: RecordQuery, position: Position | None, want: int, skip: int) -> Selection:
        return self.inner._listing_window(query, position, want, skip)
