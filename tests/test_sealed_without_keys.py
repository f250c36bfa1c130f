"""A sealed record met by a process that cannot open it is parked for review, never left claimed by nobody.

On every real backend: a plain ledger (this process has no ``idemmail_payload_keys``) in a
bulk send, and a sealed ledger whose attempt to park fails.
"""

from __future__ import annotations

import inspect
import json
import time
from collections import Counter
from typing import Any

import pytest
from cryptography.fernet import Fernet

from idemmail_celery import LedgerUnavailableError
from idemmail_celery.bulk import send_batch
from idemmail_celery.errors import PayloadKeyError
from idemmail_celery.handler import Delivery, Handler, Outcome, Policy
from idemmail_celery.keys import IntentKeyBuilder, Payload
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, Ledger, State
from idemmail_celery.ledger.sealed import PAYLOAD_KEY_UNKNOWN, SEALED_PREFIX, PayloadCodec, SealedLedger

KEY, STRANGER = Fernet.generate_key().decode(), Fernet.generate_key().decode()


def payload_for(to: str) -> Payload:
    return Payload([], {"to": to, "subject": "Nov", "text": "news", "event_id": "nov"})


def req(key: str, to: str = "ann@example.com", lease: float = 30) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="tests.send", payload=payload_for(to).to_json(),
                        fingerprint="f" * 64, lease_seconds=lease)


class _Mailer:
    """The side effect of a bulk send, as the handler sees it: records who it sent to (no provider de-duplication)."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def check(self, payload: Payload) -> None:
        return None

    def perform(self, payload: Payload, key: str) -> dict[str, Any]:
        self.sent.append(payload.kwargs["to"])
        return {"message_id": f"m-{payload.kwargs['to']}"}

    def carries_key(self) -> bool:
        return False

    def reconcile(self, key: str, payload: Payload) -> None:
        return None

    def report(self, outcome: Outcome, key: str, **fields: Any) -> None:
        return None


def batch_handler(ledger: Ledger) -> tuple[Handler, _Mailer]:
    builder = IntentKeyBuilder(task_name="tests.send", signature=inspect.signature(lambda to, **kw: None))
    mailer = _Mailer()
    return Handler(ledger, builder, Policy(lease_seconds=30), mailer), mailer


def delivery(key: str, to: str) -> Delivery:
    return Delivery(key=key, task_name="tests.send", payload=payload_for(to))


def released_sealed(ledger: Ledger, key: str, to: str = "ann@example.com") -> None:
    """A record another deployment (with payload keys) claimed and released: its payload is sealed."""
    keyed = SealedLedger(ledger, PayloadCodec([KEY]))
    c = keyed.claim(req(key, to))
    keyed.release(key, c.token, {"reason": "connect"})


def test_bulk_without_payload_keys_parks_a_sealed_record_and_sends_the_rest(ledger: Ledger) -> None:
    released_sealed(ledger, "b-sealed", "ann@example.com")
    handler, mailer = batch_handler(ledger)
    batch = send_batch(handler, [delivery("b-sealed", "ann@example.com"), delivery("b-fresh", "bob@example.com")],
                       owner="campaign:1")
    assert batch.tally() == Counter({Outcome.REVIEW: 1, Outcome.SENT: 1}) and mailer.sent == ["bob@example.com"]
    parked = ledger.get("b-sealed")
    assert parked is not None and parked.state is State.REVIEW
    assert parked.error is not None and parked.error["reason"] == PAYLOAD_KEY_UNKNOWN
    assert parked.payload is not None and parked.payload.startswith(SEALED_PREFIX)  # kept for the key holder
    keyed = SealedLedger(ledger, PayloadCodec([KEY]))
    opened = keyed.get("b-sealed")  # with the key, an operator reads both the note and the payload
    assert opened is not None and json.loads(opened.payload or "")["kwargs"]["to"] == "ann@example.com"
    assert opened.error is not None and opened.error["reason"] == PAYLOAD_KEY_UNKNOWN


def test_bulk_ships_this_runs_payload_when_the_stored_one_was_forgotten(ledger: Ledger) -> None:
    c = ledger.claim(req("b-forgot", "cat@example.com"))
    ledger.release("b-forgot", c.token, {"reason": "connect"})
    assert ledger.forget("b-forgot")
    assert ledger.get("b-forgot").payload is None  # type: ignore[union-attr]
    handler, mailer = batch_handler(ledger)
    batch = send_batch(handler, [delivery("b-forgot", "cat@example.com")], owner="campaign:1")
    assert batch.tally() == Counter({Outcome.SENT: 1}) and mailer.sent == ["cat@example.com"]


def _failing_park(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make the backend refuse the next move to review, as a store that just went away would."""
    calls: list[str] = []
    real = ledger._finish

    def finish(key: str, token: int, state: State, **kw: Any) -> None:
        if state is State.REVIEW and not calls:
            calls.append(key)
            raise LedgerUnavailableError("store went away")
        real(key, token, state, **kw)

    monkeypatch.setattr(ledger, "_finish", finish)
    return calls


def test_sealed_ledger_that_cannot_park_reports_busy_and_parks_after_the_lease(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    released_sealed(ledger, "s-park")
    stranger = SealedLedger(ledger, PayloadCodec([STRANGER]))
    failed = _failing_park(ledger, monkeypatch)
    first = stranger.claim(req("s-park", lease=0.3))  # not a held claim that its caller then abandons
    assert failed == ["s-park"] and first.status is ClaimStatus.BUSY and first.record.payload is None
    assert stranger.claim(req("s-park")).status is ClaimStatus.BUSY  # the lease is still live: come back later
    time.sleep(0.5)
    with pytest.raises(PayloadKeyError, match="parked for review"):  # the next delivery after the lease
        stranger.claim(req("s-park"))
    record = ledger.get("s-park")
    assert record is not None and record.state is State.REVIEW
    assert record.error is not None and record.error["reason"] == PAYLOAD_KEY_UNKNOWN


def test_sealed_batch_claim_that_cannot_park_reports_busy(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    released_sealed(ledger, "s-batch")
    stranger = SealedLedger(ledger, PayloadCodec([STRANGER]))
    _failing_park(ledger, monkeypatch)
    claims = stranger.claim_many([req("s-batch", lease=0.3), req("s-fresh")])
    assert [c.status for c in claims] == [ClaimStatus.BUSY, ClaimStatus.ACQUIRED]  # bulk retries it next pass
    time.sleep(0.5)
    again = stranger.claim_many([req("s-batch")])
    assert again[0].status is ClaimStatus.DONE and again[0].record.state is State.REVIEW
