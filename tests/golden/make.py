"""Write the golden fixtures: messages, outbox rows and ledger records exactly as this release makes them.

::

    python -m tests.golden.make            # rewrites tests/golden/v1/*.json

Run it once per format version, on purpose, never to make a failing test pass: ``tests/test_golden.py`` reads
what an earlier release wrote and holds the current code to it (the same intent key, a seal it trusts, a
header format it reads, one send). A change that breaks those tests breaks every message and outbox row
waiting in a broker or a table during a rolling upgrade; docs/upgrading.md says what such a change must do
instead (read the old format beside the new one for a release).

Everything is made under :data:`SECRET` (an intent key is an HMAC under the key secret) with the library's own
``send_email`` and one task of the user's kind (:data:`CHARGE`); the enqueue times are the moment of the run. The
ledger records (:func:`drive`: one of every kind, on Redis and on SQL) need the Redis server of the tests.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from celery import Celery

HERE = Path(__file__).resolve().parent
#: The format the fixtures are of (the header format, ``chain.HEADER_FORMAT``, at the time they were made).
VERSION = "v1"
#: The key secret every fixture is made under (and the tests read them with).
SECRET = "golden-fixtures-secret"
#: The user's task of the fixtures: positional arguments, a key from two of them.
CHARGE = "golden.charge"
#: An address as ``send_email`` gets it from settings, so that its calls need no ``from_``.
DEFAULT_FROM = "Shop <shop@example.com>"


def app() -> Celery:
    """The app the fixtures are made (and read) with: ``send_email`` and :data:`CHARGE` registered, no broker used."""
    from idemmail_celery import IdempotentTask
    from idemmail_celery.mail import register

    made = Celery("golden", broker="memory://", set_as_current=False)
    made.conf.update(idemmail_key_secret=SECRET, idemmail_default_from=DEFAULT_FROM,
                     idemmail_ledger_url="sqlite:///:memory:", idemmail_provider_url="console://")
    register(made)

    @made.task(base=IdempotentTask, name=CHARGE, shared=False, idempotency_key=("customer_id", "invoice_id"))
    def charge(customer_id: int, invoice_id: str, amount: int) -> dict[str, Any]:
        return {"charged": amount}

    return made


#: The calls the messages are made of: (name, task, args, kwargs, apply_async options).
CALLS: list[tuple[str, str, list[Any], dict[str, Any], dict[str, Any]]] = [
    ("receipt", "idemmail_celery.send_email", [],
     {"to": "ann@example.com", "subject": "Your receipt", "text": "Thanks for your order!",
      "event_id": "order-4821", "template": "receipt", "tags": {"campaign": "winter"}}, {}),
    ("explicit key", "idemmail_celery.send_email", [],
     {"to": ["bob@example.org", "Cy <cy@example.net>"], "subject": "Your invoice", "html": "<p>Attached.</p>"},
     {"idempotency_key": "invoice-2026-0042"}),
    ("tenant", "idemmail_celery.send_email", [],
     {"to": "dee@example.com", "subject": "Welcome", "text": "Hello", "event_id": "signup-7"},
     {"idempotency_tenant": "shop-eu"}),
    ("countdown", "idemmail_celery.send_email", [],
     {"to": "eve@example.com", "subject": "Reminder", "text": "Your cart", "event_id": "cart-9"},
     {"countdown": 3600}),
    ("charge", CHARGE, [42, "inv-7", 1999], {}, {}),
]


def messages(made: Celery) -> list[dict[str, Any]]:
    """Each call's message as ``apply_async`` publishes it: the headers the library adds (sealed), and the key a
    worker claims."""
    out = []
    for name, task_name, args, kwargs, options in CALLS:
        task = made.tasks[task_name]
        headers = task.key_builder.call_headers(
            args, kwargs, {}, validate=task.validate_call, explicit=options.get("idempotency_key"),
            tenant=options.get("idempotency_tenant"),
            due=None if "countdown" not in options else time.time() + options["countdown"])
        out.append({"name": name, "task": task_name, "args": args, "kwargs": kwargs, "options": options,
                    "headers": headers, "key": headers["idempotency_key"]})
    released = made.tasks[CHARGE]
    payload = released.key_builder.payload([42, "inv-7", 1999], {})
    key = released.intent_key(42, "inv-7", 1999)
    out.append({"name": "released copy", "task": CHARGE, "args": [42, "inv-7", 1999], "kwargs": {}, "options": {},
                "headers": released.key_headers(key, payload), "key": key})
    return out


def outbox_rows(made: Celery) -> list[dict[str, Any]]:
    """Each ``send_email`` call of :data:`CALLS` written to an outbox table as ``enqueue_email`` writes it."""
    from idemmail_celery.outbox import create_outbox_table, enqueue

    with tempfile.TemporaryDirectory() as tmp:
        engine = sa.create_engine(f"sqlite:///{tmp}/outbox.sqlite3")
        table = create_outbox_table(engine)
        with engine.begin() as conn:
            for _, task_name, args, kwargs, options in CALLS:
                if task_name.endswith("send_email"):
                    enqueue(conn, made.tasks[task_name], args, kwargs, **options)
        with engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(sa.select(table).order_by(table.c.id))]
        engine.dispose()
    for row in rows:
        for name, value in row.items():
            if isinstance(value, dt.datetime):
                row[name] = value.isoformat()
    return rows


#: The retention the ledger fixtures are written (and read) with: long enough that a fixture made years ago still
#: holds its sent and failed records.
RETENTION = 100 * 365 * 86400.0
#: A lease that outlives the fixtures: the claimed record is a live claim whenever it is read.
LEASE = 50 * 365 * 86400.0
#: The prefix the Redis fixture was written under (a test writes it under one of its own).
REDIS_PREFIX = "idemmail-golden-v1"
TASK = "idemmail_celery.send_email"
PAYLOAD = '{"args":[],"kwargs":{"subject":"Hi","text":"Hello","to":"ann@example.com"}}'


def drive(ledger: Any) -> dict[str, str]:
    """Put one record of every kind in ``ledger`` (the same calls on every store); returns what each key is."""
    from idemmail_celery.ledger import ClaimRequest, State
    from idemmail_celery.ledger.base import Mark

    def claim(key: str, *, owner: str, promised: bool = False, lease: float = LEASE) -> Any:
        return ledger.claim(ClaimRequest(key=key, task_name=TASK, payload=PAYLOAD, fingerprint="ab" * 32,
                                         owner=owner, lease_seconds=lease, writes_ahead=promised))

    kinds = {"claimed, promised and marked": "1" * 64, "released after a maybe-send": "2" * 64,
             "sent": "3" * 64, "failed": "4" * 64, "review": "5" * 64, "resolved to released": "6" * 64,
             "resolved, then sent": "7" * 64, "claimed, no promise": "8" * 64}
    k = kinds
    c = claim(k["claimed, promised and marked"], owner="golden-host:101:task-1:aaaa", promised=True)
    assert ledger.write_ahead(c.record.key, c.token, LEASE, "message", owner=c.record.owner)
    c = claim(k["released after a maybe-send"], owner="golden-host:102:task-2:bbbb")
    ledger.release(c.record.key, c.token, {"type": "AmbiguousSendError", "reason": "timeout", "maybe_sent": True,
                                           "message": "the reply never came", "at": 1795000000.0},
                   mark=Mark("maybe_sent", 1795000000.0, c.token))
    c = claim(k["sent"], owner="golden-host:103:task-3:cccc")
    ledger.complete(c.record.key, c.token, {"message_id": "0b9cf3a2-6a8e-4b53-9b1c-3f1e2d4c5b6a",
                                            "value": "0b9cf3a2-6a8e-4b53-9b1c-3f1e2d4c5b6a"})
    c = claim(k["failed"], owner="golden-host:104:task-4:dddd")
    ledger.fail(c.record.key, c.token, {"type": "PermanentSendError", "reason": "rejected",
                                        "message": "550 no such user", "at": 1795000001.0})
    c = claim(k["review"], owner="golden-host:105:task-5:eeee")
    ledger.park(c.record.key, c.token, {"type": "SendNeedsReview", "reason": "lease_expired", "stage": "message",
                                        "at": 1795000002.0})
    c = claim(k["resolved to released"], owner="golden-host:106:task-6:ffff")
    ledger.park(c.record.key, c.token, {"type": "SendNeedsReview", "reason": "after_data", "at": 1795000003.0})
    ledger.resolve(c.record.key, State.RELEASED, note="not in the server's log", actor="ops@golden")
    c = claim(k["resolved, then sent"], owner="golden-host:107:task-7:abab")
    ledger.park(c.record.key, c.token, {"type": "SendNeedsReview", "reason": "lease_expired", "at": 1795000004.0})
    ledger.resolve(c.record.key, State.RELEASED, note="resend", actor="ops@golden")
    again = claim(c.record.key, owner="golden-host:108:task-7:cdcd")
    ledger.complete(c.record.key, again.token, {"message_id": "m-7"})
    claim(k["claimed, no promise"], owner="golden-host:109:task-8:efef")
    return {key: kind for kind, key in kinds.items()}


def _records(ledger: Any, kinds: dict[str, str]) -> dict[str, Any]:
    out = {}
    for key, kind in kinds.items():
        record = ledger.get(key)
        out[key] = {"kind": kind, "record": record.to_dict(), "payload": record.payload}
    return out


def redis_records(url: str) -> dict[str, Any]:
    """Every Redis key a ledger under :data:`REDIS_PREFIX` holds after :func:`drive`, raw (bytes as latin-1 text),
    with the records as the ledger read them back."""
    import redis

    from idemmail_celery.ledger import from_url

    client = redis.Redis.from_url(url)
    for name in client.scan_iter(match=f"{REDIS_PREFIX}*"):
        client.delete(name)
    ledger = from_url(url, prefix=REDIS_PREFIX, retention_seconds=RETENTION)
    kinds = drive(ledger)
    keys: dict[str, Any] = {}
    for name in sorted(client.scan_iter(match=f"{REDIS_PREFIX}*")):
        kind = client.type(name).decode()
        if kind == "hash":
            value: Any = {f.decode("latin-1"): v.decode("latin-1") for f, v in client.hgetall(name).items()}
        elif kind == "string":
            value = client.get(name).decode("latin-1")
        elif kind == "zset":
            value = [[m.decode("latin-1"), s] for m, s in client.zrange(name, 0, -1, withscores=True)]
        else:
            raise AssertionError(f"unexpected Redis type {kind} at {name!r}")
        at = client.pexpiretime(name)
        keys[name.decode("latin-1")] = {"type": kind, "value": value, "pexpireat": at if at > 0 else None}
    out = {"prefix": REDIS_PREFIX, "retention_seconds": RETENTION, "keys": keys, "records": _records(ledger, kinds)}
    for name in client.scan_iter(match=f"{REDIS_PREFIX}*"):
        client.delete(name)
    ledger.close()
    return out


def sql_records() -> dict[str, Any]:
    """The SQL ledger's rows after :func:`drive` (SQLite), column by column, with the records as read back."""
    from idemmail_celery.ledger.sql import SQLLedger

    with tempfile.TemporaryDirectory() as tmp:
        ledger = SQLLedger(f"sqlite:///{tmp}/ledger.sqlite3", retention_seconds=RETENTION)
        kinds = drive(ledger)
        with ledger.engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(sa.select(ledger.table).order_by(ledger.table.c.intent_key))]
        out = {"retention_seconds": RETENTION, "rows": rows, "records": _records(ledger, kinds)}
        ledger.close()
    return out


def main() -> None:
    sys.path.insert(0, str(HERE.parents[1]))
    made = app()
    where = HERE / VERSION
    where.mkdir(exist_ok=True)
    import os

    redis_url = os.environ.get("IDEMMAIL_TEST_REDIS", "redis://127.0.0.1:6379/0")
    for name, value in (("messages", messages(made)), ("outbox_rows", outbox_rows(made)),
                        ("redis_records", redis_records(redis_url)), ("sql_records", sql_records())):
        path = where / f"{name}.json"
        path.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path.relative_to(HERE.parents[1])}")


if __name__ == "__main__":
    main()
