"""A ledger whose operations are timed and counted in :mod:`idemmail_celery.metrics`.

Every ledger a task opens is wrapped (see :func:`idemmail_celery.ledger.shared`), so metrics
turned on later (``worker_init``) see it too. While metrics are off each operation costs
one attribute read more than the bare backend, and ``prometheus_client`` is never imported.
A metrics failure never replaces an operation's result or exception.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .. import metrics
from .base import Claim, ClaimRequest, Ledger, Mark, Record, State
from .wrapper import LedgerWrapper

T = TypeVar("T")


class MeteredLedger(LedgerWrapper):
    """Times the operations that matter on a task's path (``idemmail_ledger_operation_seconds``)
    and counts the ones that raise (``idemmail_ledger_errors_total``), labelled ``op`` and ``backend``."""

    def __init__(self, inner: Ledger) -> None:
        super().__init__(inner)
        self.label = type(self.backend).__name__.removesuffix("Ledger").lower() or "ledger"

    def _timed(self, op: str, call: Callable[[], T]) -> T:
        active = metrics.active
        if active is None:
            return call()
        start = time.perf_counter()
        try:
            out = call()
        except Exception as exc:
            active.ledger_call(op, self.label, time.perf_counter() - start, type(exc).__name__)
            raise
        active.ledger_call(op, self.label, time.perf_counter() - start, None)
        return out

    def claim(self, request: ClaimRequest) -> Claim:
        return self._timed("claim", lambda: self.inner.claim(request))

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        return self._timed("claim_many", lambda: self.inner.claim_many(requests))

    def _finish(self, key: str, token: int, state: State, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, mark: Mark | None = None) -> float | None:
        op = _FINISH_OPS[state]
        written: float | None = self._timed(op, lambda: self.inner._finish(key, token, state, result=result,
                                                                           error=error, mark=mark))
        return written

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        return self._timed("renew", lambda: self.inner.renew(key, token, lease_seconds))

    def withdraw(self, key: str, token: int) -> bool:
        return self._timed("withdraw", lambda: self.inner.withdraw(key, token))

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        return self._timed("write_ahead", lambda: self.inner.write_ahead(key, token, lease_seconds, stage, owner=owner))

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool | None:
        return self._timed("mark_hop", lambda: self.inner.mark_hop(key, hop, ttl_seconds))

    def hop_marked(self, key: str, hop: str) -> bool | None:
        return self._timed("hop_marked", lambda: self.inner.hop_marked(key, hop))

    def get(self, key: str) -> Record | None:
        return self._timed("get", lambda: self.inner.get(key))

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        return self._timed("force", lambda: self.inner._force(key, expected_token, new))


#: The operation label of each transition (what ``complete``, ``fail``, ``park`` and ``release`` call).
_FINISH_OPS = {State.SENT: "complete", State.FAILED: "fail", State.REVIEW: "park", State.RELEASED: "release"}
