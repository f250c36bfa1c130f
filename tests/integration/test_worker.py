"""A real Celery worker on a real broker: duplicates, redelivery and crashes."""

from __future__ import annotations

import time
from typing import Any

import pytest

from idemmail_celery import SendNeedsReview
from idemmail_celery.ledger import State

from ..conftest import RABBITMQ_URL, REDIS_URL, service_missing, valkey_url, wait_for
from .conftest import results


def test_same_send_enqueued_three_times_runs_once(app_module: Any, sink: Any, start_worker: Any) -> None:
    start_worker("-P", "prefork", "-c", "2")
    send = app_module.send
    ars = [send.delay("Ann <ann@Example.com>", 4821), send.delay(to="ann@example.com", order_id=4821),
           send.apply_async(("ann@EXAMPLE.com", 4821))]
    out = results(ars)
    assert len(sink.deliveries()) == 1
    assert {o["message_id"] for o in out} == {"msg-1"}
    assert sorted(o["status"] for o in out) == ["duplicate", "duplicate", "sent"]
    assert len({o["key"] for o in out}) == 1


@pytest.mark.parametrize(("broker", "store"), [
    ("redis", "redis"), ("rabbitmq", "redis"), pytest.param("redis", "valkey", marks=pytest.mark.valkey)])
def test_sigkill_after_recording_before_ack_does_not_resend(
    broker: str, store: str, ns: str, worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
    sink: Any, start_worker: Any, request: pytest.FixtureRequest,
) -> None:
    env = {"IDEMMAIL_TEST_BROKER": RABBITMQ_URL if broker == "rabbitmq" else REDIS_URL, "IDEMMAIL_TEST_VT": "3"}
    if store == "valkey":  # the ledger on Valkey 9, the broker on the machine's Redis
        env["IDEMMAIL_TEST_LEDGER"] = valkey_url()
    worker_env.update(env)
    app_module = request.getfixturevalue("app_module")
    assert app_module.app.conf.idemmail_ledger_url == env.get("IDEMMAIL_TEST_LEDGER", REDIS_URL)
    if broker == "rabbitmq":
        try:
            app_module.app.connection_for_write().ensure_connection(max_retries=1)
        except Exception as exc:
            service_missing("rabbitmq", exc)
    worker = start_worker("-P", "prefork", "-c", "1")
    sink.control("die_after_record", "1")
    ar = app_module.send.delay("bob@example.com", 1)
    first = results([ar])[0]
    assert first["status"] == "sent" and first["message_id"] == "msg-1"
    wait_for(lambda: worker.proc.poll() is not None)  # SIGKILLed before it could ack
    worker.start()
    # The broker redelivers to the new worker and the copy replays the stored outcome.
    # (Celery keeps the first SUCCESS in the result backend, so read the worker's log.)
    replay = f"{ar.id}] succeeded".encode()
    line = wait_for(lambda: next((ln for ln in worker.log().splitlines() if replay in ln), None), timeout=60)
    assert b"'status': 'duplicate'" in line and b"'message_id': 'msg-1'" in line
    assert len(sink.deliveries()) == 1
    assert len(sink.pids()) == 1  # the body ran once


def test_duplicate_while_first_is_running_is_rescheduled(app_module: Any, sink: Any, start_worker: Any) -> None:
    start_worker("-P", "prefork", "-c", "2")
    sink.control("hold", "2.0")
    first = app_module.send.delay("cat@example.com", 7)
    wait_for(lambda: sink.pids())
    second = app_module.send.delay("cat@example.com", 7)
    out = results([first, second])
    assert [o["status"] for o in out] == ["sent", "duplicate"]
    assert out[0]["message_id"] == out[1]["message_id"]
    assert len(sink.deliveries()) == 1


@pytest.mark.parametrize("store", ["redis", pytest.param("valkey", marks=pytest.mark.valkey)])
def test_worker_killed_holding_claim_without_key_downstream_parks_review(
    store: str, worker_env: dict[str, str], sink: Any, start_worker: Any, request: pytest.FixtureRequest,
) -> None:
    if store == "valkey":  # the takeover of a dead holder's claim, by the scripts, on Valkey 9
        worker_env["IDEMMAIL_TEST_LEDGER"] = valkey_url()
    app_module = request.getfixturevalue("app_module")
    assert app_module.app.conf.idemmail_ledger_url == worker_env.get("IDEMMAIL_TEST_LEDGER", REDIS_URL)
    start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_LEASE": "2"})
    sink.control("die_after_send", "1")
    ar = app_module.send.delay("dan@example.com", 9)
    out = results([ar])[0]
    assert isinstance(out, SendNeedsReview)
    assert len(sink.deliveries()) == 1
    key = app_module.send.intent_key("dan@example.com", 9)
    record = app_module.send.ledger.get(key)
    assert record is not None and record.state is State.REVIEW
    assert record.error["reason"] == "lease_expired"


def test_worker_killed_holding_claim_with_key_downstream_resends_with_same_key(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_LEASE": "2"})
    sink.control("die_after_send", "1")
    ar = app_module.send_keyed.delay("eve@example.com", 10)
    out = results([ar])[0]
    assert out["status"] == "sent"
    key = app_module.send_keyed.intent_key("eve@example.com", 10)
    assert sink.attempts() == [key, key]  # sent twice to the provider, with one key
    assert len(sink.deliveries()) == 1  # which delivered once
    record = app_module.send_keyed.ledger.get(key)
    assert record is not None and record.state is State.SENT and record.reclaims == 1


def test_transient_failure_releases_and_retries_then_sends_once(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    start_worker("-P", "prefork", "-c", "1")
    sink.push_failure("transient")
    sink.push_failure("transient")
    out = results([app_module.send.delay("fay@example.com", 11)])[0]
    assert out["status"] == "sent"
    assert len(sink.deliveries()) == 1
    record = app_module.send.ledger.get(out["key"])
    assert record is not None and record.attempts == 3


@pytest.mark.parametrize("task_name", ["send", "send_keyed"])
def test_ambiguous_failure(app_module: Any, sink: Any, start_worker: Any, task_name: str) -> None:
    start_worker("-P", "prefork", "-c", "1")
    sink.push_failure("ambiguous")
    task = getattr(app_module, task_name)
    out = results([task.delay("gus@example.com", 12)])[0]
    record = task.ledger.get(task.intent_key("gus@example.com", 12))
    assert record is not None
    if task_name == "send":  # no key downstream: never guessed, parked
        assert isinstance(out, SendNeedsReview)
        assert record.state is State.REVIEW
    else:  # retried with the same key; the provider deduped
        assert out["status"] == "sent"
        assert record.state is State.SENT
    assert len(sink.deliveries()) == 1


def test_task_outliving_visibility_timeout_is_redelivered_but_sends_once(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    # The Redis transport hands a task still running after visibility_timeout to another
    # consumer (same task id, redelivered=False). Only the ledger's live lease tells them apart.
    env = {"IDEMMAIL_TEST_VT": "1"}
    workers = [start_worker("-P", "prefork", "-c", "1", env=env) for _ in range(2)]
    sink.control("hold", "4")
    ar = app_module.send.delay("hal@example.com", 14)
    assert ar.get(timeout=60)["status"] == "sent"
    marker = b"retry: in_flight"
    wait_for(lambda: any(marker in w.log() for w in workers), timeout=30)  # a copy did arrive, and waited
    assert len(sink.deliveries()) == 1
    assert len(sink.pids()) == 1  # the body ran once


def test_lease_is_renewed_while_a_long_body_runs(app_module: Any, sink: Any, start_worker: Any) -> None:
    # Lease 1 s, body 3 s: without renewal the second copy would reclaim and park it.
    start_worker("-P", "prefork", "-c", "2", env={"IDEMMAIL_TEST_LEASE": "1"})
    sink.control("hold", "3")
    first = app_module.send.delay("ivy@example.com", 15)
    wait_for(lambda: sink.pids())
    time.sleep(1.6)  # past the first lease
    second = app_module.send.delay("ivy@example.com", 15)
    out = results([first, second])
    assert [o["status"] for o in out] == ["sent", "duplicate"]
    record = app_module.send.ledger.get(out[0]["key"])
    assert record.reclaims == 0 and record.state is State.SENT
    assert len(sink.deliveries()) == 1
