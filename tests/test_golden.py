"""The upgrade promise, held by a test: what release 0.1.0 wrote (format ``v1``) is read by this code as it was meant.

``tests/golden/v1/`` keeps messages and outbox rows exactly as 0.1.0 makes them (``python -m tests.golden.make``,
run once, on purpose). During a rolling upgrade such messages wait in the broker and such rows in outbox tables
while new workers take them: each must keep its intent key (a new key is a second send), keep a seal the new
code trusts (an untrusted key is hashed into a new one: the duplicate the upgrade drill found), and be sent once.
docs/upgrading.md states the rule these tests keep.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from idemmail_celery.chain import KEY_HEADER, READ_FORMATS, ChainState
from idemmail_celery.keys import Seal
from idemmail_celery.outbox import create_outbox_table, relay

from .golden import make

V1 = Path(__file__).resolve().parent / "golden" / "v1"
MESSAGES: list[dict[str, Any]] = json.loads((V1 / "messages.json").read_text())
ROWS: list[dict[str, Any]] = json.loads((V1 / "outbox_rows.json").read_text())
#: Long enough that a fixture made years ago is still within it (a message older than the retention is parked).
FOREVER = 100 * 365 * 86400.0


def golden_app(tmp_path: Path, broker: str = "memory://") -> Celery:
    app = make.app()
    # A queue of its own: kombu's memory transport is one per process, shared with every other test in it.
    app.conf.update(broker_url=broker, idemmail_ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
                    idemmail_retention_seconds=FOREVER, task_default_queue=f"golden.{uuid.uuid4().hex}")
    return app


def test_the_fixtures_are_of_every_kind_of_message_and_row() -> None:
    """A fixture that loses a case tests nothing about it: the set is fixed here."""
    assert [m["name"] for m in MESSAGES] == [c[0] for c in make.CALLS] + ["released copy"]
    assert len(ROWS) == sum(1 for c in make.CALLS if c[1].endswith("send_email"))
    assert {m["headers"]["idemmail_format"] for m in MESSAGES} == {"1"}


@pytest.mark.parametrize("message", MESSAGES, ids=[m["name"] for m in MESSAGES])
def test_a_v1_message_keeps_its_key_and_its_seal(message: dict[str, Any], tmp_path: Path) -> None:
    task = golden_app(tmp_path).tasks[message["task"]]
    headers = message["headers"]
    payload = task.key_builder.payload(message["args"], message["kwargs"])
    assert task.key_builder.check_seal(headers, payload) is Seal.VALID
    chain = ChainState.from_headers(headers)
    assert chain.readable and chain.format in READ_FORMATS and chain.key == message["key"]
    # The same call made now derives the same key: a copy enqueued after the upgrade is the same intent.
    options = message["options"]
    again = task.key_builder.derive(payload, explicit=options.get("idempotency_key"),
                                    tenant=options.get("idempotency_tenant"))
    assert again == message["key"]
    # apply_async passes the sealed key on unchanged (a released copy, a retry): no second key.
    assert task.key_builder.call_headers(message["args"], message["kwargs"], headers,
                                         validate=task.validate_call)[KEY_HEADER] == message["key"]


@pytest.mark.parametrize("message", MESSAGES, ids=[m["name"] for m in MESSAGES])
def test_a_v1_message_is_claimed_under_its_key_and_run_once(message: dict[str, Any], tmp_path: Path) -> None:
    app = golden_app(tmp_path)
    task = app.tasks[message["task"]]
    first = task.apply(message["args"], message["kwargs"], headers=message["headers"]).get()
    second = task.apply(message["args"], message["kwargs"], headers=message["headers"]).get()
    assert (first["status"], second["status"]) == ("sent", "duplicate"), (first, second)
    record = task.ledger.get(message["key"])
    assert record is not None and record.state.value == "sent"
    assert [r.key for r in task.ledger.iter_records()] == [message["key"]]


def test_v1_outbox_rows_are_relayed_with_their_keys_and_sent_once(tmp_path: Path) -> None:
    app = golden_app(tmp_path)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'outbox.sqlite3'}")
    table = create_outbox_table(engine)
    with engine.begin() as conn:
        for row in ROWS:
            conn.execute(sa.insert(table).values(**{
                k: sa.func.datetime(v) if k.endswith("_at") and v else v for k, v in row.items()}))
    assert relay(engine, app) == len(ROWS)
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        published = [queue.get(timeout=5) for _ in ROWS]
        queue.close()
    keys = {row["intent_key"] for row in ROWS}
    assert {m.headers[KEY_HEADER] for m in published} == keys
    for message in published:
        headers = {k: v for k, v in message.headers.items() if k.startswith(("idemmail", "idempotency"))}
        args, kwargs, _ = message.decode()
        task = app.tasks[message.headers["task"]]
        assert task.key_builder.check_seal(headers, task.key_builder.payload(args, kwargs)) is Seal.VALID
        results = [task.apply(args, kwargs, headers=headers).get()["status"] for _ in range(2)]
        assert results == ["sent", "duplicate"]
    assert {r.key for r in app.tasks["idemmail_celery.send_email"].ledger.iter_records()} == keys
    engine.dispose()
