"""Sending inside a web request's transaction: the outbox with plain SQLAlchemy, served over HTTP.

Flask is not a dependency of this project, so the views below are plain functions of
a SQLAlchemy ``Session`` and the request body, served by the standard library's WSGI
server. In a Flask app the same code is the body of a route::

    @flask_app.post("/orders")
    def create_order_route():
        with Session(engine) as session, session.begin():     # one transaction per request
            return create_order(session, request.get_json()), 201

(FastAPI: the same inside a path operation, with the session from a dependency.)

What the script does, all of it real: a database (SQLite file by default, or
``--db postgresql+psycopg://...`` / ``mysql+pymysql://...``), a broker (``--broker
redis://...``, default kombu's in-process ``memory://``), an embedded Celery worker
thread running ``send_email``, a fake Resend-compatible provider on loopback that does
*not* de-duplicate, and HTTP requests to the WSGI server:

1. ``POST /orders`` for ann: the order and its confirmation intent commit together;
2. ``POST /orders`` for bob that fails after writing (a 500): both roll back, no email;
3. ``POST /orders/<id>/paid`` three times (the payment provider retries its webhook):
   the receipt intent is one row, one email;
4. the relay (what beat runs every few seconds) publishes the committed rows.

It ends with ``RESULT: OK`` when ann got one confirmation and one receipt and bob nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import sqlalchemy as sa
from celery import Celery
from celery.contrib.testing.worker import start_worker
from sqlalchemy.orm import Session

import idemmail_celery  # noqa: F401  # registers send_email on the app
from idemmail_celery.outbox import drain, enqueue_email, outbox_table
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider


@dataclass
class Shop:
    """What the views need: the app's tables and its Celery app."""

    orders: sa.Table
    outbox: sa.Table
    celery: Celery


def define_tables(prefix: str = "") -> tuple[sa.MetaData, sa.Table, sa.Table]:
    """The app's schema: its own orders table, and the outbox added to the same metadata (and migrations)."""
    metadata = sa.MetaData()
    orders = sa.Table(
        f"{prefix}orders", metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("email", sa.String(255), nullable=False),
        sa.Column("total_cents", sa.Integer, nullable=False),
        sa.Column("paid", sa.Boolean, nullable=False, default=False),
    )
    outbox = outbox_table(metadata, name=f"{prefix}idemmail_outbox")
    return metadata, orders, outbox


# -- the views: what a Flask or FastAPI route runs inside its request's transaction --


def create_order(session: Session, body: dict[str, Any], shop: Shop) -> dict[str, Any]:
    """Save the order and, in the same transaction, the intent to confirm it by email."""
    order_id = session.execute(
        sa.insert(shop.orders).values(email=body["email"], total_cents=int(body["total_cents"]), paid=False)
        .returning(shop.orders.c.id)
    ).scalar_one()
    enqueue_email(session, app=shop.celery, table=shop.outbox, to=body["email"], subject=f"Order {order_id} confirmed",
                  html=f"<p>Thanks! Order {order_id}: {int(body['total_cents']) / 100:.2f} EUR.</p>",
                  event_id=f"order-{order_id}", template="order_confirmation")
    if body.get("fail_after_write"):
        raise RuntimeError("the stock service timed out")  # the request fails: order and email roll back
    return {"order_id": order_id}


def mark_paid(session: Session, order_id: int, shop: Shop) -> dict[str, Any]:
    """The payment webhook. Providers deliver webhooks at least once: it runs again for the same payment."""
    order = session.execute(sa.select(shop.orders).where(shop.orders.c.id == order_id)).one_or_none()
    if order is None:
        raise LookupError(f"no order {order_id}")
    session.execute(sa.update(shop.orders).where(shop.orders.c.id == order_id).values(paid=True))
    enqueue_email(session, app=shop.celery, table=shop.outbox, to=order.email,
                  subject=f"Receipt for order {order_id}",
                  html=f"<p>We received {order.total_cents / 100:.2f} EUR.</p>",
                  event_id=f"payment-{order_id}", template="receipt")
    return {"order_id": order_id, "paid": True}


def wsgi_app(engine: sa.Engine, shop: Shop) -> Callable[..., Iterable[bytes]]:
    """A tiny router standing in for Flask: one transaction per request, rolled back on any error."""

    def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path, method = environ["PATH_INFO"], environ["REQUEST_METHOD"]
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = json.loads(environ["wsgi.input"].read(length) or b"{}")
        try:
            with Session(engine) as session, session.begin():
                if method == "POST" and path == "/orders":
                    status, out = "201 Created", create_order(session, body, shop)
                elif method == "POST" and path.startswith("/orders/") and path.endswith("/paid"):
                    status, out = "200 OK", mark_paid(session, int(path.split("/")[2]), shop)
                else:
                    status, out = "404 Not Found", {"error": "no such route"}
        except Exception as exc:
            status, out = "500 Internal Server Error", {"error": str(exc)}
        start_response(status, [("Content-Type", "application/json")])
        return [json.dumps(out).encode()]

    return application


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def post(base: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(base + path, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def make_celery(broker: str, ledger_url: str, prefix: str, provider_url: str) -> Celery:
    app = Celery("outbox_example", broker=broker)
    app.conf.update(
        task_default_queue=f"{prefix}mail",
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_transport_options={"polling_interval": 0.1},  # memory:// polls; a demo should not wait 1 s
        idemmail_ledger_url=ledger_url,
        idemmail_ledger_options={"table": f"{prefix}idemmail_ledger"},
        idemmail_key_secret="example-secret-do-not-use-in-production",
        idemmail_provider_url=provider_url,
        idemmail_provider_api_key=DEFAULT_API_KEY,
        idemmail_default_from="Shop <shop@example.com>",
    )
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", help="SQLAlchemy URL of the app's database (default: a temporary SQLite file)")
    parser.add_argument("--broker", default="memory://", help="Celery broker URL (default: memory://)")
    parser.add_argument("--prefix", default="", help="prefix for table and queue names (tests isolate runs)")
    parser.add_argument("--drop", action="store_true", help="drop the example's tables at the end")
    args = parser.parse_args(argv)
    db_url = args.db or f"sqlite:///{Path(tempfile.mkdtemp()) / 'shop.sqlite3'}"
    prefix = args.prefix or f"ex{uuid.uuid4().hex[:6]}_"

    engine = sa.create_engine(db_url)
    metadata, orders, outbox = define_tables(prefix)
    metadata.create_all(engine)  # in an app: your migrations (Alembic sees the outbox in the metadata)

    with FakeProvider(dedupe=False) as fake:
        shop = Shop(orders, outbox, make_celery(args.broker, db_url, prefix, fake.url))
        server = make_server("127.0.0.1", 0, wsgi_app(engine, shop), handler_class=_Quiet)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_port}"
        try:
            with start_worker(shop.celery, pool="solo", perform_ping_check=False, loglevel="WARNING"):
                status, ann = post(base, "/orders", {"email": "ann@example.com", "total_cents": 4200})
                print(f"POST /orders (ann)          -> {status} {ann}")
                status, bob = post(base, "/orders", {"email": "bob@example.com", "total_cents": 900,
                                                     "fail_after_write": True})
                print(f"POST /orders (bob, fails)   -> {status} {bob}")
                for attempt in range(3):
                    status, paid = post(base, f"/orders/{ann['order_id']}/paid")
                    print(f"POST /orders/{ann['order_id']}/paid (webhook #{attempt + 1}) -> {status} {paid}")

                # What the relay task, run by beat every few seconds, does.
                print(f"relay: published {drain(engine, shop.celery, table=outbox)} outbox rows")
                deadline = time.monotonic() + 30
                while fake.delivery_count() < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.5)  # room for a (wrong) extra delivery to show up
        finally:
            server.shutdown()

        with engine.connect() as conn:
            saved = [tuple(row) for row in conn.execute(sa.select(orders.c.email, orders.c.paid))]
            states = [row.state for row in conn.execute(sa.select(outbox.c.state))]
        deliveries = sorted((d.recipients[0], d.subject) for d in fake.deliveries())

    print(f"orders: {saved}")
    print(f"outbox rows: {len(states)} ({', '.join(sorted(set(states)))})")
    for to, subject in deliveries:
        print(f"delivered: {to}: {subject}")
    expected = [("ann@example.com", f"Order {ann['order_id']} confirmed"),
                ("ann@example.com", f"Receipt for order {ann['order_id']}")]
    ok = deliveries == expected and saved == [("ann@example.com", True)] and states == ["dispatched"] * 2
    if args.drop:
        metadata.drop_all(engine)
        sa.Table(f"{prefix}idemmail_ledger", sa.MetaData()).drop(engine, checkfirst=True)
    engine.dispose()
    print("RESULT: OK" if ok else "RESULT: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
