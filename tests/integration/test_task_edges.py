"""IdempotentTask at its edges: bad input at delay(), payload reuse, ledger outages."""

from __future__ import annotations

import socket
import subprocess
import time
from typing import Any

import pytest

from idemmail_celery import (
    IdempotencyKeyError,
    IdempotencyKeyReuseError,
    IdempotentTask,
    SendNeedsReview,
)
from idemmail_celery.errors import UnknownLedgerSchemeError, UnserializableArgumentsError
from idemmail_celery.ledger import ClaimRequest, State

from ..conftest import wait_for
from .conftest import results


def queued(app_module: Any) -> int:
    with app_module.app.connection_for_write() as conn:
        return int(conn.default_channel.client.llen(app_module.app.conf.task_default_queue))


def test_bad_input_fails_at_delay_and_enqueues_nothing(app_module: Any, sink: Any) -> None:
    send = app_module.send
    with pytest.raises(UnserializableArgumentsError):
        send.delay("a@example.com", 1, body=object())
    with pytest.raises(IdempotencyKeyError, match="signature"):
        send.delay("a@example.com")  # order_id missing
    assert queued(app_module) == 0


def test_unknown_ledger_scheme_fails_at_delay(app_module: Any, sink: Any) -> None:
    app = app_module.app

    @app.task(base=IdempotentTask, idempotency_ledger_url="mongodb://127.0.0.1/x", name=f"bad.{sink.ns}")
    def bad(to: str) -> None: ...

    with pytest.raises(UnknownLedgerSchemeError, match="mongodb"):
        bad.delay("a@example.com")
    assert queued(app_module) == 0


def test_misdeclared_key_field_fails_at_delay(app_module: Any, sink: Any) -> None:
    app = app_module.app

    @app.task(base=IdempotentTask, idempotency_key=("to", "order"), name=f"typo.{sink.ns}")
    def typo(to: str, order_id: int) -> None: ...

    with pytest.raises(IdempotencyKeyError, match="'order'"):
        typo.delay("a@example.com", 1)
    assert queued(app_module) == 0


def test_explicit_key_overrides_derivation(app_module: Any, sink: Any, start_worker: Any) -> None:
    start_worker("-P", "prefork", "-c", "1")
    send = app_module.send
    out = results([send.apply_async(("a@example.com", 1), idempotency_key="order-1:confirm"),
                   send.apply_async(("a@example.com", 2), idempotency_key="order-1:confirm")])
    assert [o["status"] for o in out] == ["sent", "duplicate"]
    assert len(sink.deliveries()) == 1
    assert out[0]["key"] != send.intent_key("a@example.com", 1)


def test_released_claim_ships_the_first_payload_not_a_rewritten_one(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    start_worker("-P", "prefork", "-c", "1")
    sink.push_failure("transient")  # the first attempt fails before sending: claim released
    first = app_module.send.delay("ann@example.com", 5, body="original text")
    rewritten = app_module.send.delay("ann@example.com", 5, body="text an agent rewrote")
    out = results([first, rewritten])
    assert sorted(o["status"] for o in out) == ["duplicate", "sent"]
    assert [d.split("|")[2] for d in sink.deliveries()] == ["original text"]


def test_must_match_field_differs_raises_reuse_error(app_module: Any, sink: Any, start_worker: Any) -> None:
    start_worker("-P", "prefork", "-c", "1")
    strict = app_module.send_strict
    first = results([strict.delay("ann@example.com", 77)])[0]
    assert first["status"] == "sent"
    other, same = results([strict.delay("bob@example.com", 77), strict.delay("Ann <ann@example.com>", 77)])
    assert isinstance(other, IdempotencyKeyReuseError) and other.fields == ("to",)
    assert same["status"] == "duplicate"
    assert len(sink.deliveries()) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ledger_outage_fails_closed_then_sends_once_when_back(
    app_module: Any, sink: Any, start_worker: Any, tmp_path: Any
) -> None:
    port = _free_port()
    worker = start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_LEDGER": f"redis://127.0.0.1:{port}/0"})
    ar = app_module.send.delay("ann@example.com", 6)
    wait_for(lambda: worker.log().count(b"ledger_unavailable") >= 2, timeout=30)
    assert sink.deliveries() == []  # nothing sent without a claim
    assert worker.log().count(b"idemmail: ledger unreachable") == 1  # reported once per process
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        out = ar.get(timeout=60)
        assert out["status"] == "sent"
        assert len(sink.deliveries()) == 1
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_verdict_the_ledger_cannot_take_brings_the_message_back_until_it_is_settled(
    app_module: Any, ns: str, sink: Any, start_worker: Any, tmp_path: Any
) -> None:
    """The send happened (maybe), then the ledger stopped answering before ``review`` was written.

    The message is not acknowledged as if settled: it comes back carrying the verdict, and once
    the ledger answers, that delivery takes its own claim back and records the verdict (review,
    reason ``timeout``). It never stays ``claimed`` with nobody left to finish it, and it is not
    sent twice.
    """
    import os
    import signal

    import redis

    from idemmail_celery.ledger import from_url

    port = _free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    # A stopped server is noticed after the client's socket timeout (the ledger's default is 5 s; a
    # URL's own socket_timeout wins in redis-py): 2 s keeps the wait short, the path the same.
    url = f"redis://127.0.0.1:{port}/0?socket_timeout=2"
    try:
        wait_for(lambda: _pings(redis.Redis.from_url(url)), timeout=10)
        worker = start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_LEDGER": url, "IDEMMAIL_TEST_LEASE": "3"})
        sink.r.set(sink.k("ctl.hold"), "1.5")
        sink.push_failure("ambiguous")  # after the delivery: the outcome is unknown, the key does not travel
        app_module.send.delay("vera@example.com", 61)
        wait_for(lambda: sink.r.llen(sink.k("pids")) >= 1, timeout=30)  # the body runs, holding the claim
        os.kill(server.pid, signal.SIGSTOP)  # the ledger stops answering before the verdict
        try:
            wait_for(lambda: b"ledger_unavailable" in worker.log(), timeout=40)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        sink.r.delete(sink.k("ctl.hold"))
        ledger = from_url(url, prefix=f"led.{ns}")  # the worker's ledger (see workerapp)
        key = app_module.send.intent_key("vera@example.com", 61)
        record = wait_for(lambda: (r := ledger.get(key)) is not None and r.state is State.REVIEW and r, timeout=60)
        assert record.error["reason"] == "timeout"  # the verdict reached before the outage, not a guess
        assert len(sink.deliveries()) == 1
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.terminate()
        server.wait(timeout=10)


def _pings(client: Any) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


def test_reclaim_limit_parks_a_poison_message(app_module: Any, sink: Any, start_worker: Any) -> None:
    """A message that kills its worker every time ends in review after max_reclaims, not in a loop."""
    ledger = app_module.send.ledger
    key = app_module.send.intent_key("poison@example.com", 13)
    payload = app_module.send.key_builder.payload(("poison@example.com", 13), {})
    for _ in range(4):  # four holders that died holding the claim (each its own owner)
        ledger.claim(ClaimRequest(key=key, task_name=app_module.send.name, payload=payload.to_json(),
                                  fingerprint="f" * 64, lease_seconds=0.05))
        time.sleep(0.1)
    assert ledger.get(key).reclaims == 3
    # The next delivery reclaims a fourth time, beyond the limit of 3: parked.
    start_worker("-P", "prefork", "-c", "1")
    out = results([app_module.send.delay("poison@example.com", 13)])[0]
    assert isinstance(out, SendNeedsReview) and out.reason == "reclaim_limit"
    record = ledger.get(key)
    assert record.state is State.REVIEW and record.error["reason"] == "reclaim_limit"
    assert sink.deliveries() == []


def test_transient_failures_past_max_retries_are_retried_until_the_deadline(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    # Six failures that sent nothing, past the task's max_retries (Celery's default, 3): a time budget, not a
    # count, decides (tests/integration/test_retry_deadline.py shows the deadline passing).
    start_worker("-P", "prefork", "-c", "1")
    for _ in range(6):
        sink.push_failure("transient")
    out = results([app_module.send.delay("joe@example.com", 16, body="keep me")])[0]
    assert isinstance(out, dict) and out["status"] == "sent", out
    record = app_module.send.ledger.get(app_module.send.intent_key("joe@example.com", 16))
    assert record.state is State.SENT and record.attempts == 7
    assert sink.deliveries() == [f"{record.key}|joe@example.com|keep me"]
