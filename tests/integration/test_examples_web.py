"""examples/flask_shop.py through Flask's test client, with a real worker subprocess (its own queue), Redis broker
and ledger, PostgreSQL (a schema of its own) for orders and the outbox, and a fake provider that does **not**
de-duplicate, so every delivery it counts is one the library let through."""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import sqlalchemy as sa
from celery import current_app
from celery.result import AsyncResult
from celery.signals import before_task_publish

from examples._stack import celery_worker
from idemmail_celery.ledger import Ledger, State, from_url
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider

from ..conftest import REDIS_URL, unique, wait_for
from .conftest import drop_schema, results, web_services

WEBHOOK_SECRET = "postmark:s3cret"
PAYMENT_SECRET = "payments-s3cret"


@dataclass
class Shop:
    module: Any
    fake: FakeProvider
    ledger: Ledger
    published: list[str] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)
    sent_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)  # task id: send_email's kwargs

    def post(self, path: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> Any:
        reply = self.module.app.test_client().post(path, json=body or {}, headers=headers or {})
        if reply.is_json and isinstance(reply.json, dict) and "task_id" in reply.json:
            self.task_ids.append(reply.json["task_id"])
        return reply

    def outcomes(self, replies: list[Any]) -> list[dict[str, Any]]:
        """What each reply's task ended with (waits for all of them: no later delivery can follow)."""
        return results([AsyncResult(r.json["task_id"], app=self.module.celery) for r in replies], timeout=30)

    def paid(self, order_id: int, *, secret: str | None = PAYMENT_SECRET, body: bytes | None = None) -> Any:
        """The payment provider's webhook, signed with ``secret`` (None: unsigned)."""
        raw = json.dumps({"order_id": order_id}).encode() if body is None else body
        headers = {"Content-Type": "application/json"}
        if secret is not None:
            headers["X-Shop-Signature"] = "sha256=" + hmac.new(secret.encode(), raw, hashlib.sha256).hexdigest()
        return self.module.app.test_client().post(f"/orders/{order_id}/paid", data=raw, headers=headers)

    def resets(self, nonce: str) -> list[str]:
        """The ids of the send_email tasks the password-reset requests with ``nonce`` published, in order."""
        return [task_id for task_id, kw in self.sent_kwargs.items() if kw.get("event_id") == f"password-reset:{nonce}"]

    def task_outcomes(self, task_ids: list[str]) -> list[Any]:
        return results([AsyncResult(t, app=self.module.celery) for t in task_ids], timeout=30)

    def reset_token(self, task_id: str) -> str:
        match = re.search(r"/reset/(\S+)$", self.sent_kwargs[task_id]["text"])
        assert match, self.sent_kwargs[task_id]
        return match.group(1)

    def key(self, **email: Any) -> str:
        return str(self.module.send_email.intent_key(**email))

    def delivered_to(self, address: str) -> list[str]:
        return [d.subject for d in self.fake.deliveries() if address in d.recipients]


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    ns = unique("web").replace("_", "")
    r, db_url = web_services(ns)
    fake = FakeProvider(dedupe=False).start()
    env = {
        "CELERY_BROKER_URL": REDIS_URL, "CELERY_RESULT_BACKEND": REDIS_URL, "CELERY_TASK_DEFAULT_QUEUE": f"q.{ns}",
        "IDEMMAIL_LEDGER_URL": REDIS_URL, "IDEMMAIL_LEDGER_OPTIONS": json.dumps({"prefix": f"led.{ns}"}),
        "IDEMMAIL_KEY_SECRET": "test-secret", "IDEMMAIL_PROVIDER_URL": fake.url,
        "IDEMMAIL_PROVIDER_API_KEY": DEFAULT_API_KEY, "IDEMMAIL_INFLIGHT_BACKOFF": "0.2",
        "IDEMMAIL_INFLIGHT_BACKOFF_MAX": "1", "SHOP_DATABASE_URL": db_url.render_as_string(hide_password=False),
        "INBOUND_WEBHOOK_SECRET": WEBHOOK_SECRET, "PAYMENT_WEBHOOK_SECRET": PAYMENT_SECRET,
    }
    previous = current_app._get_current_object()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        sys.modules.pop("examples.flask_shop", None)
        module = importlib.import_module("examples.flask_shop")  # creates the tables before the worker starts
    shop = Shop(module, fake, from_url(REDIS_URL, prefix=f"led.{ns}"))

    def count(sender: Any = None, headers: Any = None, body: Any = None, **_: Any) -> None:
        shop.published.append(str(sender))
        if str(sender).endswith("send_email") and headers and isinstance(body, (list, tuple)):
            shop.sent_kwargs[headers["id"]] = dict(body[1])

    before_task_publish.connect(count, weak=False)
    try:
        log = tmp_path_factory.mktemp("flask-shop") / "worker.log"
        with celery_worker("examples.flask_shop:celery", env, log=log, args=("-P", "prefork", "-c", "2")):
            yield shop
    finally:
        before_task_publish.disconnect(count)
        fake.stop()
        module.engine.dispose()
        sys.modules.pop("examples.flask_shop", None)
        previous.set_current()
        drop_schema(ns)
        keys = [*r.scan_iter(f"led.{ns}:*", count=1000), f"q.{ns}", f"_kombu.binding.q.{ns}",
                *(f"celery-task-meta-{t}" for t in shop.task_ids)]
        r.delete(*keys)


def account(shop: Shop, email: str) -> int:
    reply = shop.post("/accounts", {"email": email})
    assert reply.status_code == 201, reply.json
    return int(reply.json["account_id"])


def test_double_clicked_password_reset_sends_one_email(shop: Shop) -> None:
    account(shop, "Ann <ann@example.com>")
    before = len(shop.published)
    replies = [shop.post("/password-reset", {"email": "ann@example.com"}, {"Idempotency-Key": "nonce-1"})
               for _ in range(2)]
    assert [r.status_code for r in replies] == [202, 202]
    assert len(shop.published) - before == 2  # both clicks enqueued a message; the ledger decides

    sends = shop.resets("nonce-1")
    outcomes = shop.task_outcomes(sends)
    key = shop.key(to="Ann <ann@example.com>", event_id="password-reset:nonce-1", template="password_reset")
    assert sorted(o["status"] for o in outcomes) == ["duplicate", "sent"]
    assert {o["key"] for o in outcomes} == {key}
    assert shop.fake.delivery_count(key) == 1
    assert shop.delivered_to("Ann <ann@example.com>") == ["Reset your password"]
    record = shop.ledger.get(key)
    assert record is not None and record.state is State.SENT

    # The link: the server's random token, good once, for ann's account only.
    shipped = next(t for t, o in zip(sends, outcomes, strict=True) if o["status"] == "sent")
    token = shop.reset_token(shipped)
    redeem = shop.module.app.test_client().post
    assert redeem(f"/password-reset/{token}").json == {"email": "Ann <ann@example.com>"}
    assert redeem(f"/password-reset/{token}").status_code == 404  # used
    assert redeem("/password-reset/" + "A" * 43).status_code == 404


def test_knowing_anothers_nonce_gives_a_link_for_ones_own_address_only(shop: Shop) -> None:
    """The nonce de-duplicates; it never made the link. Same nonce, other account: another email, another token."""
    account(shop, "ann@example.com")
    account(shop, "mallory@example.com")
    shop.post("/password-reset", {"email": "ann@example.com"}, {"Idempotency-Key": "nonce-3"})
    shop.post("/password-reset", {"email": "mallory@example.com"}, {"Idempotency-Key": "nonce-3"})
    sends = shop.resets("nonce-3")
    assert sorted(o["status"] for o in shop.task_outcomes(sends)) == ["sent", "sent"]  # two intents
    assert shop.key(to="ann@example.com", event_id="password-reset:nonce-3", template="password_reset") != shop.key(
        to="mallory@example.com", event_id="password-reset:nonce-3", template="password_reset")
    tokens = [shop.reset_token(t) for t in sends]
    assert tokens[0] != tokens[1]
    assert shop.module.app.test_client().post(f"/password-reset/{tokens[1]}").json == {"email": "mallory@example.com"}


@pytest.mark.parametrize("typed", [
    "ann@example.com, mallory@example.com",  # issue 14: a second recipient riding along
    "ann@example.com;mallory@example.com",
    "Ann <ann@example.com> <mallory@example.com>",
    "ann@example.com\r\nBcc: mallory@example.com",
])
def test_a_reset_never_goes_to_an_address_the_requester_typed_for_anothers_account(shop: Shop, typed: str) -> None:
    """Text that is not one address is a 400 and enqueues nothing; one address only finds the account."""
    account(shop, "ann@example.com")
    before = len(shop.published)
    reply = shop.post("/password-reset", {"email": typed}, {"Idempotency-Key": "nonce-4"})
    assert reply.status_code == 400 and reply.json["error"] == "InvalidEmail" and reply.json["field"] == "email"
    assert len(shop.published) == before


def test_a_reset_goes_to_the_address_on_file_and_says_nothing_about_who_has_an_account(shop: Shop) -> None:
    account(shop, "Zoë Doe <zoe@exämple.com>")
    spelled = shop.post("/password-reset", {"email": "ZOE <zoe@XN--EXMPLE-CUA.com>"}, {"Idempotency-Key": "nonce-5"})
    nobody = shop.post("/password-reset", {"email": "nobody@example.com"}, {"Idempotency-Key": "nonce-5"})
    assert (spelled.status_code, spelled.json) == (nobody.status_code, nobody.json) == (
        202, {"status": "if an account has this address, a reset link is on its way"})
    sends = shop.resets("nonce-5")
    assert [shop.sent_kwargs[t]["to"] for t in sends] == ["Zoë Doe <zoe@exämple.com>"]  # as on file, not as typed
    assert [o["status"] for o in shop.task_outcomes(sends)] == ["sent"]


def test_invalid_address_is_a_400_with_the_typed_error_and_nothing_enqueued(shop: Shop) -> None:
    before = len(shop.published)
    reply = shop.post("/password-reset", {"email": "ann@@example"}, {"Idempotency-Key": "nonce-2"})
    assert reply.status_code == 400
    assert reply.json["error"] == "InvalidEmail" and reply.json["field"] == "email"
    assert len(shop.published) == before
    assert shop.resets("nonce-2") == []


def test_outbox_order_and_email_commit_together_and_a_thrice_delivered_payment_sends_one_receipt(shop: Shop) -> None:
    module, before = shop.module, len(shop.published)
    ann = shop.post("/orders", {"email": "bob@example.com", "total_cents": 4200})
    failed = shop.post("/orders", {"email": "cat@example.com", "total_cents": 900, "simulate_failure": True})
    assert (ann.status_code, failed.status_code) == (201, 503)
    order_id = ann.json["order_id"]
    forged = [shop.paid(order_id, secret=None), shop.paid(order_id, secret="guessed"),
              shop.post(f"/orders/{order_id}/paid")]
    assert [r.status_code for r in forged] == [401, 401, 401]
    signed_for_another = shop.paid(order_id, body=json.dumps({"order_id": order_id + 1}).encode())
    assert signed_for_another.status_code == 400
    with module.engine.connect() as conn:  # refused: the order is not paid, no receipt waits in the outbox
        assert conn.execute(sa.select(module.orders.c.paid).where(module.orders.c.id == order_id)).scalar_one() is False
        assert conn.execute(sa.select(sa.func.count()).select_from(module.outbox)).scalar_one() == 1  # confirmation
    assert [shop.paid(order_id).status_code for _ in range(3)] == [200, 200, 200]
    assert len(shop.published) == before  # the requests only wrote rows; the relay publishes

    module.celery.tasks["idemmail_celery.outbox_relay"].delay()  # what beat runs every 2 s, run by the worker
    keys = [shop.key(to="bob@example.com", event_id=f"order-{order_id}", template="order_confirmation"),
            shop.key(to="bob@example.com", event_id=f"payment-{order_id}", template="receipt")]
    wait_for(lambda: all(
        (rec := shop.ledger.get(k)) is not None and rec.state is State.SENT for k in keys), timeout=30)
    assert [shop.fake.delivery_count(k) for k in keys] == [1, 1]
    assert sorted(shop.delivered_to("bob@example.com")) == [f"Order {order_id} confirmed",
                                                            f"Receipt for order {order_id}"]
    assert shop.delivered_to("cat@example.com") == []
    with module.engine.connect() as conn:
        assert [tuple(row) for row in conn.execute(sa.select(module.orders.c.email, module.orders.c.paid))] == [
            ("bob@example.com", True)]
        assert sorted(conn.execute(sa.select(module.outbox.c.intent_key, module.outbox.c.state))) == sorted(
            (k, "dispatched") for k in keys)


BASIC = {"Authorization": "Basic " + base64.b64encode(WEBHOOK_SECRET.encode()).decode()}


def test_replayed_inbound_webhook_sends_one_auto_reply(shop: Shop) -> None:
    account(shop, "Dan <dan@example.com>")
    event = {"MessageID": "7f3c9a10-5b7e-4c1e-9d2a-2a1f0c6b8e41", "From": "dan@EXAMPLE.com",
             "Subject": "Where is my parcel?", "TextBody": "It has been a week."}
    before = len(shop.published)
    assert shop.post("/webhooks/inbound", event).status_code == 401
    assert shop.post("/webhooks/inbound", event, {"Authorization": "Basic Zm9vOmJhcg=="}).status_code == 401
    assert len(shop.published) == before  # unauthenticated: nothing read, nothing enqueued

    replies = [shop.post("/webhooks/inbound", event, BASIC) for _ in range(2)]  # Postmark delivers it again
    assert [r.status_code for r in replies] == [200, 200]
    outcomes = shop.outcomes(replies)
    assert sorted(o["status"] for o in outcomes) == ["duplicate", "sent"]
    key = shop.key(to="Dan <dan@example.com>", event_id=f"inbound:{event['MessageID']}", template="auto_reply")
    assert shop.fake.delivery_count(key) == 1
    assert shop.delivered_to("Dan <dan@example.com>") == ["We received your message"]  # to the address on file
    record = shop.ledger.get(key)
    assert record is not None and record.state is State.SENT


@pytest.mark.parametrize("event", [
    # A stranger, or a forged From: answering would mail anyone the shop's reply (backscatter).
    {"MessageID": "m-stranger", "From": "victim@example.net", "Subject": "Cheap pills at evil.example"},
    # Automatic mail (RFC 3834): an auto-reply loop, a bounce, a list.
    {"MessageID": "m-auto", "From": "ann@example.com", "Subject": "Out of office",
     "Headers": [{"Name": "Auto-Submitted", "Value": "auto-replied"}]},
    {"MessageID": "m-list", "From": "ann@example.com", "Subject": "[list] news",
     "Headers": [{"Name": "List-Id", "Value": "<news.example.net>"}]},
    {"MessageID": "m-bad", "From": "ann@example.com, victim@example.net", "Subject": "two"},
], ids=["stranger", "auto-submitted", "mailing-list", "not-one-address"])
def test_inbound_mail_from_a_stranger_or_a_machine_gets_no_reply(shop: Shop, event: dict[str, Any]) -> None:
    account(shop, "ann@example.com")
    before = len(shop.published)
    reply = shop.post("/webhooks/inbound", event, BASIC)
    assert reply.status_code == 200 and reply.json["replied"] is False  # 200: Postmark must not redeliver it
    assert len(shop.published) == before


def test_an_auto_reply_never_carries_the_inbound_subject(shop: Shop) -> None:
    account(shop, "erin@example.com")
    event = {"MessageID": "m-echo", "From": "erin@example.com", "Subject": "Cheap pills at evil.example"}
    [task_id] = [shop.post("/webhooks/inbound", event, BASIC).json["task_id"]]
    assert [o["status"] for o in shop.task_outcomes([task_id])] == ["sent"]
    assert shop.delivered_to("erin@example.com") == ["We received your message"]
    assert shop.sent_kwargs[task_id]["headers"] == {"Auto-Submitted": "auto-replied"}
