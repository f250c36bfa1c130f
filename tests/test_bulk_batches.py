"""A campaign's batches survive errors per recipient, on every real backend.

``send_batch`` claims a batch in one round trip and settles each recipient with the same
handler a single send uses. These tests make one recipient's ledger move or provider call
fail (the store refusing one move, another holder taking one claim over, a reconcile search
that errors) and check that exactly that recipient is settled accordingly and the rest of
the batch is sent, once.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from celery import Celery

from idemmail_celery.bulk import CAMPAIGN_TASK, send_batch
from idemmail_celery.handler import Delivery, Outcome
from idemmail_celery.keys import Payload
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, Ledger, State

from .test_handler import Mailbox, Refusing, build


def recipients(n: int, prefix: str) -> list[Delivery]:
    return [Delivery(key=f"{prefix}-{i}", task_name="tests.mail",
                     payload=Payload([], {"to": f"r{i}@example.com", "body": f"to r{i}"}), attempt_id="camp-1",
                     max_retries=30) for i in range(n)]


def test_a_ledger_blip_recording_one_recipient_settles_it_and_the_batch_goes_on(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idemmail_celery.errors import LedgerUnavailableError

    monkeypatch.setattr("idemmail_celery.handler.time.sleep", lambda s: None)
    blip_key = "b1-2"

    class BlipOne(Refusing):
        def _finish(self, key: str, token: int, state: State, **kw: Any) -> None:
            if key == blip_key and self.down:
                raise LedgerUnavailableError("connection reset")
            self.inner._finish(key, token, state, **kw)

    refusing = BlipOne(ledger)
    refusing.down.add("on")
    handler, box = build(refusing)
    batch = send_batch(handler, recipients(5, "b1"), owner="camp:1:aaaa")
    assert batch.tally() == Counter({Outcome.SENT: 4, Outcome.PENDING: 1})
    assert len(box.sent) == 5 and set(batch.verdicts()) == {blip_key}
    # The next pass takes its own claim back and records the verdict: nothing is sent again.
    refusing.down.clear()
    again = [replace(d, resume_owner="camp:1:aaaa", verdict=batch.verdicts().get(d.key), retries=1)
             for d in recipients(5, "b1")]
    second = send_batch(handler, again, owner="camp:1:bbbb")
    assert second.tally() == Counter({Outcome.SENT: 1, Outcome.DUPLICATE: 4}) and len(box.sent) == 5
    assert Counter(r.state for r in (ledger.get(d.key) for d in again) if r) == Counter({State.SENT: 5})


def test_a_recipient_another_holder_took_over_mid_batch_does_not_stop_the_batch(ledger: Ledger) -> None:
    handler, box = build(ledger)
    stolen = "b2-1"

    class TakeOver(Mailbox):
        def perform(self, payload: Payload, key: str) -> Any:
            if key == stolen:  # a single send_email took this recipient's claim over meanwhile, and sent
                record = ledger.get(key)
                assert record is not None
                ledger._force(key, record.token, replace(record, token=record.token + 1, owner="single:1"))
                ledger.complete(key, record.token + 1, {"message_id": "m-single", "value": None})
            return super().perform(payload, key)

    handler.effect = box = TakeOver()
    batch = send_batch(handler, recipients(3, "b2"), owner="camp:2")
    assert [s.outcome for s in batch.steps] == [Outcome.SENT] * 3 and len(box.sent) == 3
    lost = [fields for outcome, fields in box.reports if fields.get("reason") == "lease_lost"]
    assert len(lost) == 1 and lost[0]["recorded"] == "false"  # said loudly: the newer holder's record stands
    assert ledger.get(stolen).result["message_id"] == "m-single"  # type: ignore[union-attr,index]
    assert ledger.get("b2-2").state is State.SENT  # type: ignore[union-attr]


def test_a_reconcile_search_that_fails_parks_that_recipient_and_the_batch_goes_on(ledger: Ledger) -> None:
    handler, box = build(ledger)

    class SearchDown(Mailbox):
        def reconcile(self, key: str, payload: Payload) -> Any:
            raise ConnectionError("search API down")

    handler.effect = box = SearchDown()
    ds = recipients(3, "b3")
    ledger.claim(ClaimRequest(key=ds[1].key, task_name="tests.mail", payload=ds[1].payload.to_json(),
                              fingerprint="", owner="dead:1", lease_seconds=0.2))  # a crashed campaign copy
    time.sleep(0.35)
    batch = send_batch(handler, ds, owner="camp:3")
    assert [s.outcome for s in batch.steps] == [Outcome.SENT, Outcome.REVIEW, Outcome.SENT]
    parked = ledger.get(ds[1].key)
    assert parked is not None and parked.state is State.REVIEW and parked.error["reason"] == "lease_expired"  # type: ignore[index]
    assert [k for k, _ in box.sent] == [ds[0].key, ds[2].key]


def test_every_claim_of_a_batch_is_renewed_until_it_is_settled(ledger: Ledger) -> None:
    handler, box = build(ledger, lease_seconds=0.6)
    ds = recipients(3, "b4")
    seen: list[ClaimStatus] = []

    class Slow(Mailbox):
        def perform(self, payload: Payload, key: str) -> Any:
            time.sleep(0.5)
            if key == ds[1].key:  # 0.5 s in, the last recipient's lease (0.6 s) would be near its end...
                time.sleep(0.5)   # ...and past it by now, were it not renewed
                probe = ledger.claim(ClaimRequest(key=ds[2].key, task_name="tests.mail", fingerprint="",
                                                  payload=ds[2].payload.to_json(), owner="other:1"))
                seen.append(probe.status)
            return super().perform(payload, key)

    handler.effect = box = Slow()
    batch = send_batch(handler, ds, owner="camp:4")
    assert seen == [ClaimStatus.BUSY]  # another copy could not take it over: no second send
    assert [s.outcome for s in batch.steps] == [Outcome.SENT] * 3 and len(box.sent) == 3


def test_two_spellings_of_one_mailbox_are_one_recipient(tmp_path: Any) -> None:
    app = Celery("bulk-spell", set_as_current=False)
    app.conf.update(idemmail_ledger_url=f"sqlite:///{tmp_path / 'l.sqlite3'}", idemmail_key_secret="s",
                    idemmail_provider_url=f"file://{tmp_path / 'out'}", idemmail_default_from="shop@example.com")
    from idemmail_celery.bulk import _send_campaign
    from idemmail_celery.mail import register

    register(app)
    campaign = app.task(bind=True, name=CAMPAIGN_TASK, max_retries=None)(_send_campaign)
    out = campaign.apply(kwargs={"campaign_id": "c2", "subject": "Hi", "text": "x", "recipients": [
        "ann@example.com", "ann@EXAMPLE.com", "Ann Smith <ann@example.com>", "bob@example.com"]}).get()
    assert (out["total"], out["sent"]) == (2, 2)
    assert len(list((tmp_path / "out").iterdir())) == 2
