"""A Flask shop that sends email through idemmail-celery: each email once, however often a request comes.

Routes (JSON in, JSON out):

* ``POST /accounts`` ``{"email"}``: a customer account (the shop's sign-up), its address checked
  with :func:`idemmail_celery.email.parse_address` and stored with its de-duplication form
  (:func:`idemmail_celery.keys.normalize_address`), so two spellings are one account.
* ``POST /password-reset`` ``{"email"}``: **the typed address only finds the account; the email
  goes to the address the account has on file**, never to what the requester typed (typing
  ``"ann@example.com, me@evil.example"`` or a look-alike spelling must never copy anyone on
  Ann's link). The reply is the same 202 whether or not an account exists, so the route tells
  nobody who has one; text that is not one address is a 400 with the typed error. The form's
  nonce travels as the ``Idempotency-Key`` header, so a double-click or a client retry
  repeats it: one email (the intent is that nonce and the account's address). The link's
  token is random, made by the server, and stored (as a SHA-256 digest) with the account it
  was made for, an expiry and a used flag; ``POST /password-reset/<token>`` redeems it once.
  The nonce only de-duplicates the email: it never goes into the link, so knowing it gives nothing.
* ``POST /orders`` ``{"email", "total_cents"}``: the order and its confirmation are written in
  one transaction (the outbox): a request that fails after writing sends nothing.
  ``POST /orders/<id>/paid`` is the payment provider's webhook, delivered at least once: one
  receipt. It must carry ``X-Shop-Signature: sha256=<hex HMAC-SHA256(PAYMENT_WEBHOOK_SECRET, raw
  body)>`` and a body ``{"order_id": <id>}`` (so a signed body cannot pay another order): else
  401 (or 400), and nothing is written. The relay task (on beat, every 2 s) publishes committed
  outbox rows.
* ``POST /webhooks/inbound``: Postmark's inbound-email webhook (HTTP basic auth, checked with
  :func:`idemmail_celery.webhooks.verify`): a customer gets one auto-reply per inbound
  message, keyed on its ``MessageID``, however often Postmark delivers the event. Anyone can
  write any ``From``, so the reply is never an echo: it goes only to a customer on file (at
  the address on file), carries a fixed subject and text (nothing of the inbound message),
  is marked ``Auto-Submitted: auto-replied``, and is not sent to automatic mail (RFC 3834:
  ``Auto-Submitted``, ``Precedence: bulk``, mailing lists). Otherwise an attacker could
  make the shop mail anyone, under its name, a subject of the attacker's choosing (backscatter).

Run it: ``docker compose up`` (docs/deployment.md), or by hand with Redis on
loopback, from the repository root::

    python -m idemmail_celery.testing --port 8025 &                          # the mail catcher
    export IDEMMAIL_PROVIDER_URL=http://127.0.0.1:8025 IDEMMAIL_PROVIDER_API_KEY=re_fake_test_key
    export SHOP_DEV=1                                                        # dev-only webhook secrets (a warning)
    celery -A examples.flask_shop:celery worker -B &                         # worker and beat
    flask --app examples.flask_shop:app run --port 8000
    curl -X POST localhost:8000/accounts -d '{"email": "ann@example.com"}' -H 'Content-Type: application/json'
    curl -X POST localhost:8000/password-reset -H 'Idempotency-Key: n-1' -d '{"email": "ann@example.com"}' \\
         -H 'Content-Type: application/json'

Settings come from the environment (``examples/_stack.py``); ``SHOP_DATABASE_URL`` (default
SQLite ``shop.sqlite3``) holds the accounts, the orders, the reset tokens and the outbox;
``INBOUND_WEBHOOK_SECRET`` (``user:password``) guards the inbound webhook and
``PAYMENT_WEBHOOK_SECRET`` signs the payment one. The module refuses to load without the two
secrets unless ``SHOP_DEV=1`` (then, with a warning, it uses values everyone knows: for a
laptop only). Tested by ``tests/integration/test_examples_web.py``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import os
import secrets
import uuid
import warnings
from typing import Any

import sqlalchemy as sa
from flask import Flask, jsonify, request
from sqlalchemy.orm import Session

from examples._stack import celery_from_env
from idemmail_celery import InvalidEmail
from idemmail_celery.email import format_address
from idemmail_celery.keys import normalize_address
from idemmail_celery.mail import register
from idemmail_celery.outbox import enqueue_email, outbox_table, register_relay
from idemmail_celery.webhooks import WebhookSignatureError, verify

DATABASE_URL = os.environ.get("SHOP_DATABASE_URL", "sqlite:///shop.sqlite3")
DEV_MODE = os.environ.get("SHOP_DEV", "").lower() in ("1", "true", "yes")
RESET_LINK_LIFETIME = dt.timedelta(hours=1)


def secret(name: str, dev_value: str) -> str:
    """A secret from the environment; without one, refuse to start, unless in explicit dev mode (``SHOP_DEV=1``)."""
    value = os.environ.get(name)
    if value:
        return value
    if not DEV_MODE:
        raise RuntimeError(f"set {name} (or SHOP_DEV=1 on a laptop, for a dev-only value everyone knows)")
    warnings.warn(f"SHOP_DEV: {name} is the dev-only value {dev_value!r}; never run this way where others can reach",
                  stacklevel=2)
    return dev_value


WEBHOOK_SECRET = secret("INBOUND_WEBHOOK_SECRET", "postmark:dev-only")
PAYMENT_SECRET = secret("PAYMENT_WEBHOOK_SECRET", "payments-dev-only")

# -- Celery: send_email, the outbox relay on beat --

celery = celery_from_env("shop", idemmail_default_from="Shop <shop@example.com>", idemmail_outbox_url=DATABASE_URL)
send_email = register(celery)
register_relay(celery)
celery.conf.beat_schedule = {
    "idemmail-outbox": {"task": "idemmail_celery.outbox_relay", "schedule": 2.0, "options": {"expires": 10}},
}

# -- the database: the shop's orders, and the outbox in the same metadata (your migrations) --

engine = sa.create_engine(DATABASE_URL)
metadata = sa.MetaData()
orders = sa.Table(
    "orders", metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("email", sa.String(255), nullable=False),
    sa.Column("total_cents", sa.Integer, nullable=False),
    sa.Column("paid", sa.Boolean, nullable=False, default=False),
)
accounts = sa.Table(
    "accounts", metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("email", sa.String(320), nullable=False),  # where the shop writes to: checked at sign-up
    sa.Column("email_key", sa.String(320), nullable=False, unique=True),  # normalize_address(email): one account
)
password_resets = sa.Table(  # the token itself is only in the email; a stolen table row cannot reset anything
    "password_resets", metadata,
    sa.Column("token_sha256", sa.String(64), primary_key=True),
    sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("used", sa.Boolean, nullable=False, default=False),
)
outbox = outbox_table(metadata, name=celery.conf.get("idemmail_outbox_table") or "idemmail_outbox")
for _attempt in range(3):  # the web and the worker may both create the tables at the same moment
    try:
        metadata.create_all(engine)
        break
    except sa.exc.DBAPIError:
        if _attempt == 2:
            raise

# -- the web app --

app = Flask(__name__)


class StockServiceDown(Exception):
    """The order failed after it was written (raised inside the transaction: order and email roll back)."""


@app.errorhandler(StockServiceDown)
def unavailable(exc: StockServiceDown) -> tuple[Any, int]:
    return jsonify(error=str(exc)), 503


@app.errorhandler(InvalidEmail)
def refused(exc: InvalidEmail) -> tuple[Any, int]:
    return jsonify(error=type(exc).__name__, field=exc.field, message=str(exc)), 400


def sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def typed_address(body: Any, name: str = "email") -> str:
    """The one address a request typed, checked (:class:`InvalidEmail`, a 400): never several, never a header trick."""
    value = body.get(name, "") if isinstance(body, dict) else ""
    return format_address(value, name)


@app.post("/accounts")
def create_account() -> tuple[Any, int]:
    email = typed_address(request.get_json(silent=True))
    with Session(engine) as session, session.begin():
        found = session.execute(sa.select(accounts.c.id).where(accounts.c.email_key == normalize_address(email)))
        account_id = found.scalar_one_or_none()
        if account_id is None:
            account_id = session.execute(sa.insert(accounts).values(email=email, email_key=normalize_address(email))
                                         .returning(accounts.c.id)).scalar_one()
    return jsonify(account_id=account_id), 201


@app.post("/password-reset")
def password_reset() -> tuple[Any, int]:
    typed = typed_address(request.get_json(silent=True))  # text that is not one address: 400, nothing else
    # The form's nonce: a double-click or a retry sends it again. Without one, every request is a new intent.
    # It de-duplicates the email (with the address: the intent is event_id, template and recipients) and
    # is never part of the link.
    nonce = (request.headers.get("Idempotency-Key") or uuid.uuid4().hex)[:128]
    with Session(engine) as session, session.begin():
        account = session.execute(sa.select(accounts).where(accounts.c.email_key == normalize_address(typed))).first()
        if account is not None:
            token = secrets.token_urlsafe(32)  # the server's random, stored for this account only
            session.execute(sa.insert(password_resets).values(
                token_sha256=sha256(token), account_id=account.id, used=False,
                expires_at=dt.datetime.now(dt.timezone.utc) + RESET_LINK_LIFETIME))
            # To the address on file, never the one typed. A double-click stores two tokens; only the first
            # request's email (and link) ships, the other never leaves the server and expires.
            send_email.delay(to=account.email, subject="Reset your password", event_id=f"password-reset:{nonce}",
                             template="password_reset", text=f"Reset it here: https://shop.example/reset/{token}")
    # The same answer either way: whether an account has this address is nobody's business here.
    return jsonify(status="if an account has this address, a reset link is on its way"), 202


@app.post("/password-reset/<token>")
def redeem_password_reset(token: str) -> tuple[Any, int]:
    """The link's target: valid once, before it expires, for the account it was made for."""
    now = dt.datetime.now(dt.timezone.utc)
    with Session(engine) as session, session.begin():
        account_id = session.execute(
            sa.update(password_resets)
            .where(password_resets.c.token_sha256 == sha256(token), password_resets.c.used.is_(False),
                   password_resets.c.expires_at > now)
            .values(used=True).returning(password_resets.c.account_id)).scalar_one_or_none()
        email = None if account_id is None else session.execute(
            sa.select(accounts.c.email).where(accounts.c.id == account_id)).scalar_one()
    if email is None:
        return jsonify(error="this link is unknown, used or expired"), 404
    return jsonify(email=email), 200  # a real shop now asks for the new password of this account


@app.post("/orders")
def create_order() -> tuple[Any, int]:
    body = request.get_json(force=True)
    email = typed_address(body)  # the customer's own address for their own order: still exactly one
    with Session(engine) as session, session.begin():  # the order and its email commit together, or neither
        order_id = session.execute(sa.insert(orders).values(email=email, total_cents=int(body["total_cents"]))
                                   .returning(orders.c.id)).scalar_one()
        enqueue_email(session, app=celery, table=outbox, to=email, subject=f"Order {order_id} confirmed",
                      html=f"<p>Thanks! Order {order_id}: {int(body['total_cents']) / 100:.2f} EUR.</p>",
                      event_id=f"order-{order_id}", template="order_confirmation")
        if body.get("simulate_failure"):
            raise StockServiceDown("the stock service timed out")
    return jsonify(order_id=order_id), 201


def signature(body: bytes) -> str:
    """The payment webhook's ``X-Shop-Signature`` for ``body`` (what the payment provider sends)."""
    return "sha256=" + hmac.new(PAYMENT_SECRET.encode(), body, hashlib.sha256).hexdigest()


@app.post("/orders/<int:order_id>/paid")
def order_paid(order_id: int) -> tuple[Any, int]:
    body = request.get_data()
    if not hmac.compare_digest(request.headers.get("X-Shop-Signature", "").encode(), signature(body).encode()):
        return jsonify(error="missing or wrong X-Shop-Signature"), 401
    try:
        signed_id = json.loads(body).get("order_id")
    except (ValueError, AttributeError):
        signed_id = None
    if signed_id != order_id:  # the signature covers the body, not the URL
        return jsonify(error="the signed body is not about this order"), 400
    with Session(engine) as session, session.begin():
        order = session.execute(sa.select(orders).where(orders.c.id == order_id)).one()
        session.execute(sa.update(orders).where(orders.c.id == order_id).values(paid=True))
        enqueue_email(session, app=celery, table=outbox, to=order.email, subject=f"Receipt for order {order_id}",
                      html=f"<p>We received {order.total_cents / 100:.2f} EUR.</p>",
                      event_id=f"payment-{order_id}", template="receipt")
    return jsonify(order_id=order_id, paid=True), 200


def automatic(event: dict[str, Any]) -> bool:
    """Is the inbound message itself automatic (an auto-reply, a bounce, a list)? RFC 3834 says: never answer it."""
    headers = {str(h.get("Name", "")).lower(): str(h.get("Value", "")).strip().lower()
               for h in event.get("Headers") or () if isinstance(h, dict)}
    return (headers.get("auto-submitted", "no") != "no" or headers.get("precedence") in ("bulk", "junk", "list")
            or "list-id" in headers)


@app.post("/webhooks/inbound")
def inbound_email() -> tuple[Any, int]:
    try:
        verify("postmark", dict(request.headers), request.get_data(), secret=WEBHOOK_SECRET)
    except WebhookSignatureError as exc:
        return jsonify(error=str(exc)), 401
    event = request.get_json(force=True)
    # Answer 200 whatever happens below: a 4xx would make Postmark redeliver the event forever.
    if automatic(event):
        return jsonify(replied=False, reason="automatic mail is never answered"), 200
    try:
        sender = typed_address(event, "From")  # exactly one address, or InvalidEmail
    except InvalidEmail as exc:
        return jsonify(replied=False, reason=str(exc)), 200
    with Session(engine) as session:
        on_file = session.execute(
            sa.select(accounts.c.email).where(accounts.c.email_key == normalize_address(sender))).scalar_one_or_none()
    if on_file is None:  # From is whatever the sender wrote: answering strangers mails anyone the shop's reply
        return jsonify(replied=False, reason="not a customer"), 200
    # Fixed words only: an echoed subject would carry the sender's text, in the shop's name, to a forged From.
    result = send_email.delay(to=on_file, subject="We received your message",
                              text="Thanks for writing. A person will answer within one working day.",
                              headers={"Auto-Submitted": "auto-replied"},
                              event_id=f"inbound:{event['MessageID']}", template="auto_reply")
    return jsonify(replied=True, task_id=result.id), 200
