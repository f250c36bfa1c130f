"""Lease renewal survives any single error: a claim whose renewal fails once is renewed again in time."""

from __future__ import annotations

import time

from idemmail_celery._lease import LeaseKeeper
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, Ledger
from idemmail_celery.ledger.wrapper import LedgerWrapper


class FailsOnce(LedgerWrapper):
    """A real ledger whose first renewal raises something no ledger error class covers."""

    def __init__(self, inner: Ledger) -> None:
        super().__init__(inner)
        self.calls = 0

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a driver bug, a broken socket, anything")
        return self.inner.renew(key, token, lease_seconds)


def request(key: str, owner: str, lease: float) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="t", payload='{"args":[],"kwargs":{}}', fingerprint="", owner=owner,
                        lease_seconds=lease)


def test_the_keeper_survives_an_error_and_keeps_the_claim_alive(ledger: Ledger) -> None:
    failing = FailsOnce(ledger)
    keeper = LeaseKeeper()
    claim = ledger.claim(request("lk1", "holder:1", 0.6))
    keeper.hold(failing, "lk1", claim.token, 0.6)
    try:
        time.sleep(1.0)  # past the lease: alive only if renewals went on after the first one failed
        assert failing.calls >= 2
        assert ledger.claim(request("lk1", "other:2", 0.6)).status is ClaimStatus.BUSY
    finally:
        keeper.drop(failing, "lk1", claim.token)
    assert keeper.holding() == 0
