"""Lease renewal while a side effect runs: one daemon thread per process (a greenlet under ``-P gevent``),
started lazily and again in a forked child, renews every held claim each third of its lease; a failed
renewal is tried again within seconds, and a claim dropped only when the ledger says another holder has it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ._common import after_fork, logsafe
from .ledger import Ledger

log = logging.getLogger(__name__)


@dataclass
class _Held:
    ledger: Ledger
    key: str
    token: int
    lease_seconds: float
    due: float


class LeaseKeeper:
    """Renews the leases of claims whose side effects are still running."""

    def __init__(self) -> None:
        self._reset()
        after_fork(self._reset)

    def _reset(self) -> None:
        # In a forked child: the parent's thread does not exist here and its lock may be held.
        self._held: dict[tuple[int, str, int], _Held] = {}
        # hold() and drop() take the plain lock (cheaper on every send); the Condition shares it for the waits.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._running = False
        self._wake_at = 0.0  # when the renewal thread next wakes up by itself

    def hold(self, ledger: Ledger, key: str, token: int, lease_seconds: float) -> None:
        """Renew this claim every third of ``lease_seconds`` until :meth:`drop`."""
        entry = _Held(ledger, key, token, lease_seconds, time.monotonic() + lease_seconds / 3)
        with self._lock:
            self._held[(id(ledger), key, token)] = entry
            if not self._running:
                self._running = True
                self._wake_at = 0.0
                threading.Thread(target=self._loop, name="idemmail-lease", daemon=True).start()
            elif entry.due < self._wake_at:
                self._cond.notify()  # only then: waking the thread for every task costs a context switch

    def drop(self, ledger: Ledger, key: str, token: int) -> None:
        """Stop renewing this claim (its side effect ended)."""
        with self._lock:
            self._held.pop((id(ledger), key, token), None)

    def holding(self) -> int:
        """How many claims are being renewed (for tests and metrics)."""
        with self._cond:
            return len(self._held)

    def _loop(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [h for h in self._held.values() if h.due <= now]
                if not due:
                    self._wake_at = min((h.due for h in self._held.values()), default=now + 60)
                    self._cond.wait(timeout=max(self._wake_at - now, 0.01))
                    continue
                for h in due:
                    h.due = now + h.lease_seconds / 3
            for h in due:
                self._renew(h)

    def _renew(self, h: _Held) -> None:
        try:
            if not h.ledger.renew(h.key, h.token, h.lease_seconds):
                log.warning("idemmail: lease on %s lost to another holder (token %s)", logsafe(h.key), h.token)
                self.drop(h.ledger, h.key, h.token)
        except Exception as exc:  # any error: keep the claim and try again soon, well within the lease
            log.warning("idemmail: could not renew lease on %s (%s: %s); trying again", logsafe(h.key),
                        type(exc).__name__, logsafe(exc))
            with self._cond:
                h.due = min(h.due, time.monotonic() + min(h.lease_seconds / 6, 2.0))


keeper = LeaseKeeper()
