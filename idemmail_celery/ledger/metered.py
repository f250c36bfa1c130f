"""A ledger whose operations are timed and counted in :mod:`idemmail_celery.metrics`.

Every ledger a task opens is wrapped (:func:`idemmail_celery.ledger.shared`), so metrics turned on later see it
too; while they are off, an operation costs one attribute read more."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from .. import metrics
from .base import Ledger, Mark, State
from .wrapper import LedgerWrapper, forwarded

T = TypeVar("T")


def _timed_call(wrapper: MeteredLedger, name: str, call: Callable[[], T]) -> T:
    """Run a forwarded call timed, labelled by the operation's name (``_force`` as ``force``)."""
    return wrapper._timed(name.lstrip("_"), call)


class MeteredLedger(LedgerWrapper):
    """Times operations (``idemmail_ledger_operation_seconds``), counts failures (``idemmail_ledger_errors_total``)."""

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

    # Timed forwards (see _timed_call); ``_finish`` is labelled by the move it makes.
    claim = forwarded("claim", _timed_call)
    claim_many = forwarded("claim_many", _timed_call)
    renew = forwarded("renew", _timed_call)
    withdraw = forwarded("withdraw", _timed_call)
    write_ahead = forwarded("write_ahead", _timed_call)
    mark_hop = forwarded("mark_hop", _timed_call)
    hop_marked = forwarded("hop_marked", _timed_call)
    get = forwarded("get", _timed_call)
    _force = forwarded("_force", _timed_call)

    def _finish(self, key: str, token: int, state: State, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, mark: Mark | None = None) -> float | None:
        return self._timed(_FINISH_OPS[state],
                           lambda: self.inner._finish(key, token, state, result=result, error=error, mark=mark))


#: The operation label of each transition (what ``complete``, ``fail``, ``park`` and ``release`` call).
_FINISH_OPS = {State.SENT: "complete", State.FAILED: "fail", State.REVIEW: "park", State.RELEASED: "release"}
