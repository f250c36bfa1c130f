"""Raw ``idempotency_key`` headers are checked, namespaced and hashed like ``idempotency_key=`` (issue 14).

Real publishes to the Redis broker (the raw message read back from its queue); the worker side runs
the task in process (``Task.apply``) against a real SQLite ledger.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pytest
import redis
from celery import Celery

from idemmail_celery import IdempotentTask
from idemmail_celery.chain import ENQUEUED_HEADER, KEY_HEADER, KEY_MARK_HEADER, MAX_OLDER_KEYS
from idemmail_celery.errors import IdempotencyKeyError, InvalidEmail, PermanentSendError
from idemmail_celery.keys import Seal, is_derived_key
from idemmail_celery.ledger import ClaimRequest
from idemmail_celery.ledger.wrapper import LedgerWrapper
from idemmail_celery.mail import register

from .conftest import REDIS_URL, unique


@pytest.fixture
def app(redis_broker_app: Celery) -> Celery:
    return redis_broker_app


def published(app: Celery) -> list[dict[str, Any]]:
    raw = redis.Redis.from_url(REDIS_URL).lrange(app.conf.task_default_queue, 0, -1)
    return [json.loads(m)["headers"] for m in reversed(raw)]


def charge_task(app: Celery) -> Any:
    @app.task(base=IdempotentTask, shared=False, name=unique("charge"), bind=True)
    def charge(self: Any, order_id: int) -> str:
        if order_id < 0:
            raise ValueError("card of ann.private@example.com refused")
        return str(self.request.idempotency_key)

    return charge


def test_a_raw_header_key_is_hashed_like_an_explicit_one(app: Celery) -> None:
    charge = charge_task(app)
    charge.apply_async((1,), headers={KEY_HEADER: "ann@example.com:order-1"})
    charge.apply_async((1,), idempotency_key="ann@example.com:order-1")
    raw, explicit = published(app)
    assert raw[KEY_HEADER] == explicit[KEY_HEADER] == charge.key_builder.explicit_key("ann@example.com:order-1")
    assert "ann@" not in json.dumps(raw)


@pytest.mark.parametrize("bad", ["order\n1", "x" * 300, 42, ""])
def test_a_bad_raw_header_key_is_refused_before_anything_is_published(app: Celery, bad: Any) -> None:
    charge = charge_task(app)
    with pytest.raises(IdempotencyKeyError):
        charge.apply_async((1,), headers={KEY_HEADER: bad})
    assert published(app) == []


def test_a_caller_header_shaped_like_a_derived_key_is_hashed_too(app: Celery) -> None:
    """64 lower-case hex digits (a SHA-256 of the caller's own) is still the caller's key, not a ledger key."""
    charge = charge_task(app)
    raw = hashlib.sha256(b"order-1").hexdigest()
    charge.apply_async((1,), headers={KEY_HEADER: raw})
    charge.apply_async((1,), idempotency_key=raw)
    [from_header, explicit] = published(app)
    assert from_header[KEY_HEADER] == explicit[KEY_HEADER] == charge.key_builder.explicit_key(raw) != raw
    assert charge.key_builder.check_seal(from_header, charge.key_builder.payload((1,), {})) is Seal.VALID


def test_a_caller_header_shaped_like_a_derived_key_is_validated_before_anything_is_published(app: Celery) -> None:
    app.conf.update(idemmail_provider_url="console://", idemmail_default_from="shop@example.com")
    send_email = register(app)
    bad = {"to": "ann@x.com, eve@y.com", "subject": "s", "text": "t"}
    with pytest.raises(InvalidEmail, match="more than one address"):
        send_email.apply_async(kwargs=bad, headers={KEY_HEADER: "ab" * 32})
    assert published(app) == []


def test_a_key_the_library_sealed_travels_unchanged_and_a_forged_or_borrowed_seal_does_not(app: Celery) -> None:
    """A retry, a reschedule or a copy re-enqueued by `ledger resolve --release` keeps its key (and the
    seal says so); a seal made for another task, or for other arguments (issue 24: a key and seal copied
    from a queued message and replayed with another recipient), vouches for nothing."""
    charge = charge_task(app)
    other = charge_task(app)
    derived = charge.intent_key(1)
    one = charge.key_builder.payload((1,), {})
    charge.apply_async((1,), headers=charge.key_headers(derived, one))
    charge.apply_async((1,), headers={KEY_HEADER: derived, KEY_MARK_HEADER: "0" * 64})
    charge.apply_async((1,), headers=other.key_headers(derived, one))
    charge.apply_async((2,), headers=charge.key_headers(derived, one))  # the victim's headers, other arguments
    kept, forged, borrowed, replayed = published(app)
    assert kept[KEY_HEADER] == derived and kept[KEY_MARK_HEADER] == charge.key_headers(derived, one)[KEY_MARK_HEADER]
    assert forged[KEY_HEADER] == borrowed[KEY_HEADER] == replayed[KEY_HEADER] == charge.key_builder.explicit_key(
        derived)
    assert charge.key_builder.check_seal(replayed, charge.key_builder.payload((2,), {})) is Seal.VALID


def test_a_raw_64_hex_key_beside_idemmail_enqueued_is_hashed_and_never_marked_as_it_is(app: Celery) -> None:
    """Issue 24: ``apply_async(headers={"idempotency_key": <64 hex>, "idemmail_enqueued": "1"})`` kept the raw
    key and gave it a valid mark (a key any Message-ID shows became the ledger key of attacker content)."""
    charge = charge_task(app)
    victims = charge.intent_key(1)
    charge.apply_async((2,), headers={KEY_HEADER: victims, ENQUEUED_HEADER: "1"})
    [row] = published(app)
    assert row[KEY_HEADER] == charge.key_builder.explicit_key(victims) != victims
    assert charge.key_builder.check_seal(row, charge.key_builder.payload((2,), {})) is Seal.VALID
    app.conf.update(idemmail_provider_url="console://", idemmail_default_from="shop@example.com")
    send_email = register(app)
    with pytest.raises(InvalidEmail):  # still validated
        send_email.apply_async(kwargs={"to": "ann@x.com, eve@y.com", "subject": "s", "text": "t"},
                               headers={KEY_HEADER: "cd" * 32, ENQUEUED_HEADER: "1700000000.000"})
    assert len(published(app)) == 1


def test_a_seal_naming_an_unknown_secret_does_not_let_invalid_arguments_through(app: Celery) -> None:
    """A seal under a secret this process lacks travels unchanged (a rotation deployed web processes first),
    but the text before its ':' is anyone's to write: the arguments are still validated at apply_async."""
    app.conf.update(idemmail_provider_url="console://", idemmail_default_from="shop@example.com")
    send_email = register(app)
    unknown = {KEY_HEADER: "cd" * 32, KEY_MARK_HEADER: "0123456789ab:" + "0" * 64}
    with pytest.raises(InvalidEmail, match="more than one address"):
        send_email.apply_async(kwargs={"to": "ann@x.com, eve@y.com", "subject": "s", "text": "t"}, headers=unknown)
    assert published(app) == []
    newer = dataclasses.replace(send_email.key_builder, secret=["new", "s"])  # a web process already rotated
    good = {"to": "ann@x.com", "subject": "s", "text": "t"}
    sealed = {KEY_HEADER: "ef" * 32}
    sealed[KEY_MARK_HEADER] = newer.seal(sealed, newer.payload((), good))
    send_email.apply_async(kwargs=good, headers=sealed)  # valid arguments: the sealed key travels as it is
    [row] = published(app)
    assert row[KEY_HEADER] == "ef" * 32 and row[KEY_MARK_HEADER] == sealed[KEY_MARK_HEADER]


def test_the_worker_hashes_an_unmarked_64_hex_key(app: Celery) -> None:
    """Issue 24: a raw ``"f" * 64`` became the ledger key as given; another intent's key (a Message-ID shows
    it) then sent attacker content under it, and the victim's own call answered duplicate."""
    charge = charge_task(app)
    victims = charge.intent_key(1)
    forged = charge.apply((2,), headers={KEY_HEADER: victims}).get()
    assert forged["status"] == "sent" and forged["key"] == charge.key_builder.explicit_key(victims) != victims
    own = charge.apply((1,)).get()
    assert own["status"] == "sent" and own["key"] == victims  # delivered, not "duplicate"
    own_headers = charge.key_headers(victims, charge.key_builder.payload((1,), {}))
    assert charge.apply((1,), headers=own_headers).get()["status"] == "duplicate"


def test_the_worker_hashes_a_raw_header_and_never_reads_a_record_under_the_raw_text(app: Celery) -> None:
    charge = charge_task(app)
    hashed = charge.apply((1,), headers={KEY_HEADER: "order-1"}).get()["key"]
    assert hashed == charge.key_builder.explicit_key("order-1") and is_derived_key(hashed)
    led = charge.ledger
    claim = led.claim(ClaimRequest(key="order-2", task_name=charge.name, payload='{"args":[2],"kwargs":{}}',
                                   fingerprint=""))
    led.complete("order-2", claim.token, {"value": "first", "message_id": None})
    again = charge.apply((2,), headers={KEY_HEADER: "order-2"}).get()
    assert again["status"] == "sent" and again["key"] == charge.key_builder.explicit_key("order-2")


def test_an_exception_text_reaches_the_ledger_without_addresses(app: Celery) -> None:
    charge = charge_task(app)
    outcome = charge.apply((-1,))
    record = charge.ledger.get(charge.intent_key(-1))
    assert record is not None and record.error is not None
    assert "ann.private@example.com" not in json.dumps(record.error) and "<address>" in record.error["message"]
    assert isinstance(outcome.result, (PermanentSendError, Exception))


def test_a_sealed_list_of_older_keys_is_cut_to_max_older_keys(app: Celery) -> None:
    """A rotation has at most a few older secrets; a sealed list longer than MAX_OLDER_KEYS (a defect, or
    a publisher that holds the secret) costs at most that many ledger reads, the first ones listed."""
    charge = charge_task(app)
    key = charge.intent_key(1)
    older = [hashlib.sha256(f"older-{i}".encode()).hexdigest() for i in range(20)]
    headers = charge.key_headers(key, charge.key_builder.payload((1,), {}), older)
    reads: list[str] = []

    class CountingReads(LedgerWrapper):
        def get(self, k: str) -> Any:
            reads.append(k)
            return self.inner.get(k)

    charge._idem_ledger = CountingReads(charge.ledger)  # before the handler is made: it keeps this ledger
    out = charge.apply((1,), headers=headers).get()
    assert out["status"] == "sent" and out["key"] == key
    assert set(reads) == set(older[:MAX_OLDER_KEYS]) and len(reads) <= 2 * MAX_OLDER_KEYS, reads
