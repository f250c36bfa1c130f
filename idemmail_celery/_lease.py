"""Lease renewal while a task body runs.

One daemon thread per process renews every held claim each third of its lease.
Tasks shorter than that never cause a renewal; tracking a claim costs a dict
insert. The thread starts lazily, after any fork, in the process that needs it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from .errors import LedgerError
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
    """Renews the leases of claims whose bodies are still running."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, str, int], _Held] = {}
        self._cond = threading.Condition()
        self._pid = 0
        self._wake_at = 0.0  # when the renewal thread next wakes up by itself

    def hold(self, ledger: Ledger, key: str, token: int, lease_seconds: float) -> None:
        entry = _Held(ledger, key, token, lease_seconds, time.monotonic() + lease_seconds / 3)
        with self._cond:
            self._held[(id(ledger), key, token)] = entry
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._wake_at = 0.0
                threading.Thread(target=self._loop, name="idemmail-lease", daemon=True).start()
            elif entry.due < self._wake_at:
                self._cond.notify()  # only then: waking the thread for every task costs a context switch

    def drop(self, ledger: Ledger, key: str, token: int) -> None:
        with self._cond:
            self._held.pop((id(ledger), key, token), None)

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
                try:
                    if not h.ledger.renew(h.key, h.token, h.lease_seconds):
                        log.warning("idemmail: lease on %s lost to another holder (token %s)", h.key, h.token)
                        self.drop(h.ledger, h.key, h.token)
                except LedgerError as exc:
                    log.warning("idemmail: could not renew lease on %s: %s", h.key, exc)


keeper = LeaseKeeper()
