"""send_email with sealed payloads: a real worker, a real Redis broker and ledger, the fake provider."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from cryptography.fernet import Fernet

from idemmail_celery.cli import idemmail
from idemmail_celery.ledger import State
from idemmail_celery.ledger.metered import MeteredLedger
from idemmail_celery.ledger.sealed import SEALED_PREFIX, SealedLedger
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider

from ..conftest import wait_for
from .conftest import results

KEYS = f"{Fernet.generate_key().decode()},{Fernet.generate_key().decode()}"


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider(slow_seconds=1.5) as f:
        yield f


@pytest.fixture
def sealed_app(fake: FakeProvider, worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
               request: pytest.FixtureRequest) -> Any:
    """The worker app with encryption on, in the workers (env) and in this process (the caller)."""
    worker_env.update(IDEMMAIL_TEST_PROVIDER=fake.url, IDEMMAIL_TEST_PROVIDER_KEY=DEFAULT_API_KEY,
                      IDEMMAIL_TEST_PROVIDER_TIMEOUT="0.5", IDEMMAIL_PAYLOAD_KEYS=KEYS)
    monkeypatch.setenv("IDEMMAIL_PAYLOAD_KEYS", KEYS)
    return request.getfixturevalue("app_module")


def stored_hash(ledger: Any, key: str) -> dict[str, str]:
    """The Redis hash of the record, read directly (whatever the key layout)."""
    if isinstance(ledger, MeteredLedger):  # a task's ledger is timed for metrics: the sealed one is inside
        ledger = ledger.inner
    assert isinstance(ledger, SealedLedger)
    inner = ledger.inner
    client = inner.client  # type: ignore[attr-defined]
    record = dict(client.hgetall(inner.names.record(key)))  # type: ignore[attr-defined]
    if not record:  # sent: an entry of its shelf, field the packed key
        from idemmail_celery.ledger.redis import _field

        entry = client.hget(inner.names.shelf(key), _field(key))  # type: ignore[attr-defined]
        if entry is not None:
            record = {"shelved": entry}
    assert record, key
    payload = client.get(inner.names.payload(key))  # type: ignore[attr-defined]  # the first payload's own key
    return {**record, **({"payload": payload} if payload is not None else {})}


def test_sealed_send_delivers_once_and_duplicates_replay(
    sealed_app: Any, fake: FakeProvider, start_worker: Any
) -> None:
    start_worker("-P", "prefork", "-c", "2")
    task = sealed_app.app.tasks[TASK_NAME]
    kw = {"to": "ann.secret@example.com", "subject": "Receipt", "html": "<p>Thanks, Ann</p>", "event_id": "o-1"}
    out = results([task.delay(**kw), task.delay(**kw), task.delay(**kw)])
    assert fake.delivery_count() == 1
    assert sorted(o["status"] for o in out) == ["duplicate", "duplicate", "sent"]
    assert {o["message_id"] for o in out} == {fake.deliveries()[0].message_id}
    key = out[0]["key"]
    record = task.ledger.get(key)
    assert record.state is State.SENT and record.payload is None  # erased on sent
    assert record.result["message_id"] == out[0]["message_id"]
    raw = json.dumps(stored_hash(task.ledger, key))
    assert "$fernet" in raw and "ann.secret" not in raw and out[0]["message_id"] not in raw


def test_retried_send_ships_the_decrypted_first_payload(sealed_app: Any, fake: FakeProvider, start_worker: Any) -> None:
    start_worker("-P", "prefork", "-c", "1")
    fake.fail_next("503_before_accept")  # the first attempt is released and retried
    task = sealed_app.app.tasks[TASK_NAME]
    first = task.delay(to="cat.secret@example.com", subject="Summary", text="draft one", event_id="s-1")
    second = task.delay(to="cat.secret@example.com", subject="Summary", text="an agent's rewrite", event_id="s-1")
    out = results([first, second])
    assert sorted(o["status"] for o in out) == ["duplicate", "sent"]
    assert fake.delivery_count() == 1
    shipped = [json.loads(a.body) for a in fake.attempts() if a.status == 200]
    assert [b["text"] for b in shipped] == ["draft one"] and shipped[0]["to"] == ["cat.secret@example.com"]
    record = task.ledger.get(out[0]["key"])
    assert record.attempts >= 2 and record.error["reason"]  # the release note, opened


def test_failed_send_keeps_a_sealed_payload_that_an_operator_release_ships(
    sealed_app: Any, fake: FakeProvider, start_worker: Any
) -> None:
    start_worker("-P", "prefork", "-c", "1")
    fake.fail_next("422")  # a permanent rejection: failed, payload kept for the operator
    task = sealed_app.app.tasks[TASK_NAME]
    out = results([task.delay(to="dan.secret@example.com", subject="Hi", text="t", event_id="f-1")])[0]
    key = task.intent_key(to="dan.secret@example.com", subject="Hi", text="t", event_id="f-1")
    record = task.ledger.get(key)
    assert record.state is State.FAILED, out
    assert json.loads(record.payload)["kwargs"]["to"] == "dan.secret@example.com"
    raw = stored_hash(task.ledger, key)
    assert raw["payload"].startswith(SEALED_PREFIX) and "dan.secret" not in json.dumps(raw)
    # The operator releases it: the CLI opens the first payload and re-enqueues it under the same key.
    holder = type("Obj", (), {"app": sealed_app.app})()
    cli = CliRunner().invoke(idemmail, ["ledger", "resolve", key, "--release", "--note", "fixed"], obj=holder)
    assert cli.exit_code == 0, cli.output
    wait_for(lambda: fake.delivery_count() == 1)
    assert fake.deliveries()[0].recipients == ("dan.secret@example.com",)
    wait_for(lambda: task.ledger.get(key).state is State.SENT)
