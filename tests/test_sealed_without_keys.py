"""A sealed record met by a process that cannot open it is parked for review, never left claimed by nobody.

On every real backend: a plain ledger (this process has no ``idemmail_payload_keys``) in a
bulk send, and a sealed ledger whose attempt to park fails.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest
from cryptography.fernet import Fernet

from idemmail_celery import LedgerUnavailableError, PayloadKeyError, Settings
from idemmail_celery.bulk import _Recipient, send_batch
from idemmail_celery.keys import Payload
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, Ledger, State
from idemmail_celery.ledger.sealed import PAYLOAD_KEY_UNKNOWN, SEALED_PREFIX, PayloadCodec, SealedLedger

KEY, STRANGER = Fernet.generate_key().decode(), Fernet.generate_key().decode()


def payload_for(to: str) -> Payload:
    return Payload([], {"to": to, "subject": "Nov", "text": "news", "event_id": "nov"})


def req(key: str, to: str = "ann@example.com", lease: float = 30) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="tests.send", payload=payload_for(to).to_json(),
                        fingerprint="f" * 64, lease_seconds=lease)


class _Result:
    def __init__(self, to: str) -> None:
        self.to = to

    def to_dict(self) -> dict[str, Any]:
        return {"message_id": f"m-{self.to}"}


class _Provider:
    accepts_idempotency_key = False

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, message: dict[str, Any], key: str) -> _Result:
        self.sent.append(message["to"])
        return _Result(message["to"])


class _Sender:
    """What send_batch uses of send_email: its ledger, provider, settings, reconcile and message_from."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger, self.provider, self.idem_settings = ledger, _Provider(), Settings(lease_seconds=30)

    def reconcile(self, key: str, payload: Payload) -> None:
        return None

    def message_from(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs


def released_sealed(ledger: Ledger, key: str, to: str = "ann@example.com") -> None:
    """A record another deployment (with payload keys) claimed and released: its payload is sealed."""
    keyed = SealedLedger(ledger, PayloadCodec([KEY]))
    c = keyed.claim(req(key, to))
    keyed.release(key, c.token, {"reason": "connect"})


def test_bulk_without_payload_keys_parks_a_sealed_record_and_sends_the_rest(ledger: Ledger) -> None:
    released_sealed(ledger, "b-sealed", "ann@example.com")
    rcpts = [_Recipient(to, f"b-{name}", {"to": to}, payload_for(to))
             for name, to in (("sealed", "ann@example.com"), ("fresh", "bob@example.com"))]
    claims = ledger.claim_many([req(r.key, r.to) for r in rcpts])
    assert claims[0].status is ClaimStatus.REOPENED and claims[0].record.payload.startswith(SEALED_PREFIX)
    sender, tally = _Sender(ledger), Counter[str]()
    send_batch(sender, list(zip(claims, rcpts, strict=True)), tally)  # type: ignore[arg-type]
    assert tally == Counter(review=1, sent=1) and sender.provider.sent == ["bob@example.com"]
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
    rcpt = _Recipient("cat@example.com", "b-forgot", {"to": "cat@example.com"}, payload_for("cat@example.com"))
    claims = ledger.claim_many([req(rcpt.key, rcpt.to)])
    assert claims[0].status is ClaimStatus.REOPENED and claims[0].record.payload is None
    sender, tally = _Sender(ledger), Counter[str]()
    send_batch(sender, [(claims[0], rcpt)], tally)  # type: ignore[arg-type]
    assert tally == Counter(sent=1) and sender.provider.sent == ["cat@example.com"]


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
