"""A worker without payload keys meets a record sealed by one with them: parked for review, not stuck claimed."""

from __future__ import annotations

from typing import Any

from cryptography.fernet import Fernet

from idemmail_celery.errors import PayloadKeyError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, State
from idemmail_celery.ledger.sealed import PAYLOAD_KEY_UNKNOWN, SEALED_PREFIX, PayloadCodec, SealedLedger

from .conftest import results


def test_worker_without_payload_keys_parks_a_sealed_released_record(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    send = app_module.send  # this deployment configures no idemmail_payload_keys: its ledger is plain
    ledger = send.ledger
    assert not isinstance(ledger, SealedLedger)
    args = ("sealed.elsewhere@example.com", 21)
    key = send.intent_key(*args)
    payload = send.key_builder.payload(args, {})
    # Another deployment, with payload keys, claimed it first and released it (a transient failure).
    keyed = SealedLedger(ledger, PayloadCodec([Fernet.generate_key().decode()]))
    c = keyed.claim(ClaimRequest(key=key, task_name=send.name, payload=payload.to_json(),
                                 fingerprint=send.key_builder.fingerprint(payload), lease_seconds=30))
    assert c.status is ClaimStatus.ACQUIRED
    keyed.release(key, c.token, {"reason": "connect"})
    assert ledger.get(key).payload.startswith(SEALED_PREFIX)

    start_worker("-P", "prefork", "-c", "1")
    out = results([send.delay(*args)])[0]
    assert isinstance(out, PayloadKeyError) and "parked for review" in str(out), out
    record = ledger.get(key)
    assert record.state is State.REVIEW, record  # not left claimed with no delivery to finish it
    assert record.error["reason"] == PAYLOAD_KEY_UNKNOWN and record.payload.startswith(SEALED_PREFIX)
    assert sink.deliveries() == [] and sink.attempts() == []  # nothing ran
    # A duplicate now replays the review.
    again = results([send.delay(*args)])[0]
    assert type(again).__name__ == "SendNeedsReview" and again.reason == PAYLOAD_KEY_UNKNOWN
