"""Write the golden fixtures: messages and outbox rows exactly as this release makes them.

::

    python -m tests.golden.make            # rewrites tests/golden/v1/*.json

Run it once per format version, on purpose, never to make a failing test pass: ``tests/test_golden.py`` reads
what an earlier release wrote and holds the current code to it (the same intent key, a seal it trusts, a
header format it reads, one send). A change that breaks those tests breaks every message and outbox row
waiting in a broker or a table during a rolling upgrade; docs/upgrading.md says what such a change must do
instead (read the old format beside the new one for a release).

Everything is made under :data:`SECRET` (an intent key is an HMAC under the key secret) with the library's own
``send_email`` and one task of the user's kind (:data:`CHARGE`); the enqueue times are the moment of the run.
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


def main() -> None:
    sys.path.insert(0, str(HERE.parents[1]))
    made = app()
    where = HERE / VERSION
    where.mkdir(exist_ok=True)
    for name, value in (("messages", messages(made)), ("outbox_rows", outbox_rows(made))):
        path = where / f"{name}.json"
        path.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path.relative_to(HERE.parents[1])}")


if __name__ == "__main__":
    main()
