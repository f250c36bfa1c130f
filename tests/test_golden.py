"""The upgrade promise, held by a test: what release 0.1.0 wrote (format ``v1``) is read by this code as it was meant.

``tests/golden/v1/`` keeps messages, outbox rows and ledger records exactly as 0.1.0 makes them
(``python -m tests.golden.make``, run once, on purpose). During a rolling upgrade such messages wait in the broker
and such rows in outbox tables while new workers take them: each must keep its intent key (a new key is a second
send), keep a seal the new code trusts (an untrusted key is hashed into a new one: the duplicate the upgrade drill
found), and be sent once; and the records in the ledger must be read as they were meant (a live claim stays busy,
a write-ahead mark stays a mark, a final record replays). docs/upgrading.md states the rule these tests keep.
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


# -- ledger records: what 0.1.0 left in a Redis or SQL ledger, read by this code as it was meant --

REDIS_RECORDS: dict[str, Any] = json.loads((V1 / "redis_records.json").read_text())
SQL_RECORDS: dict[str, Any] = json.loads((V1 / "sql_records.json").read_text())
KINDS = ["claimed, promised and marked", "released after a maybe-send", "sent", "failed", "review",
         "resolved to released", "resolved, then sent", "claimed, no promise"]


def test_the_ledger_fixtures_hold_a_record_of_every_kind() -> None:
    for fixture in (REDIS_RECORDS, SQL_RECORDS):
        assert sorted(r["kind"] for r in fixture["records"].values()) == sorted(KINDS)
    assert len(SQL_RECORDS["rows"]) == len(KINDS)


def _key_of(fixture: dict[str, Any], kind: str) -> str:
    return next(k for k, r in fixture["records"].items() if r["kind"] == kind)


def _read_as_written(ledger: Any, fixture: dict[str, Any]) -> None:
    """Every record reads back field for field as the release read it; then the claims a new worker makes of them
    are answered as that release would: a live claim is busy, a released one reopens with its maybe-send mark (its
    send goes out again under its key, which the provider de-duplicates), final ones replay, none runs twice."""
    from idemmail_celery.ledger import ClaimRequest, ClaimStatus

    for key, expected in fixture["records"].items():
        record = ledger.get(key)
        assert record is not None, expected["kind"]
        assert (record.to_dict(), record.payload) == (expected["record"], expected["payload"]), expected["kind"]

    def claim(kind: str) -> Any:
        return ledger.claim(ClaimRequest(key=_key_of(fixture, kind), task_name=make.TASK, payload=make.PAYLOAD,
                                         fingerprint="ab" * 32, writes_ahead=True))

    marked = claim("claimed, promised and marked")
    assert marked.status is ClaimStatus.BUSY and marked.record.mark is not None and marked.record.writes_ahead
    reopened = claim("released after a maybe-send")
    assert reopened.status is ClaimStatus.REOPENED and reopened.record.mark is not None
    assert reopened.record.mark.stage == "maybe_sent" and reopened.record.error is not None
    sent = claim("sent")
    assert sent.status is ClaimStatus.DONE and sent.record.result is not None
    assert sent.record.result["message_id"] == "0b9cf3a2-6a8e-4b53-9b1c-3f1e2d4c5b6a"
    assert [claim(k).record.state.value for k in ("failed", "review", "resolved, then sent")] == [
        "failed", "review", "sent"]
    resolved = claim("resolved to released")
    assert resolved.status is ClaimStatus.REOPENED and resolved.record.resolution is not None
    assert resolved.record.resolution["by"] == "ops@golden"
    assert claim("claimed, no promise").status is ClaimStatus.BUSY


def test_v1_redis_records_are_read_as_written(tmp_path: Path) -> None:
    import redis as redis_lib

    from idemmail_celery.ledger import from_url

    from .conftest import REDIS_URL, service_missing, unique

    client = redis_lib.Redis.from_url(REDIS_URL)
    prefix = unique("golden")
    try:
        client.ping()
    except redis_lib.ConnectionError as exc:
        service_missing("redis", exc)
    old = REDIS_RECORDS["prefix"]
    try:
        for name, entry in REDIS_RECORDS["keys"].items():
            assert name.startswith(old)
            where, value = (prefix + name[len(old):]).encode("latin-1"), entry["value"]
            if entry["type"] == "hash":
                client.hset(where, mapping={f.encode("latin-1"): v.encode("latin-1") for f, v in value.items()})
            elif entry["type"] == "string":
                client.set(where, value.encode("latin-1"))
            else:
                client.zadd(where, {m.encode("latin-1"): score for m, score in value})
            if entry["pexpireat"]:
                client.pexpireat(where, entry["pexpireat"])
        ledger = from_url(REDIS_URL, prefix=prefix, retention_seconds=REDIS_RECORDS["retention_seconds"])
        _read_as_written(ledger, REDIS_RECORDS)
        ledger.close()
    finally:
        for name in client.scan_iter(match=f"{prefix}*"):
            client.delete(name)
        client.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql", "mariadb"])
def test_v1_sql_rows_are_read_as_written(backend: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    from .conftest import drop_ledger, make_ledger

    ledger: Any = make_ledger(backend, tmp_path_factory, retention_seconds=SQL_RECORDS["retention_seconds"])
    try:
        ledger.ping()
        with ledger.engine.begin() as conn:
            for row in SQL_RECORDS["rows"]:
                conn.execute(sa.insert(ledger.table).values(**row))
        _read_as_written(ledger, SQL_RECORDS)
    finally:
        drop_ledger(ledger)
