"""One contract, every backend: Redis, PostgreSQL, MariaDB and SQLite, all real."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest

from idemmail_celery.errors import IllegalTransitionError, RecordNotFoundError, StaleTokenError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, Ledger, State, from_url

from .conftest import BACKENDS, drop_ledger, make_ledger, unique


def req(key: str, **kw: Any) -> ClaimRequest:
    kw.setdefault("lease_seconds", 30.0)
    return ClaimRequest(key=key, task_name="tests.send", payload='{"args":[1],"kwargs":{}}',
                        fingerprint="f" * 64, **kw)


def test_first_claim_acquires_and_duplicate_sees_live_lease(ledger: Ledger) -> None:
    first = ledger.claim(req("k1"))
    assert first.status is ClaimStatus.ACQUIRED
    assert first.record.token == 1 and first.record.state is State.CLAIMED
    again = ledger.claim(req("k1"))
    assert again.status is ClaimStatus.BUSY
    assert again.record.token == 1
    assert again.record.payload == '{"args":[1],"kwargs":{}}'


def test_complete_then_duplicates_replay_result(ledger: Ledger) -> None:
    c = ledger.claim(req("k2"))
    ledger.complete("k2", c.token, {"message_id": "m-1"})
    dup = ledger.claim(req("k2"))
    assert dup.status is ClaimStatus.DONE
    assert dup.record.state is State.SENT
    assert dup.record.result == {"message_id": "m-1"}
    assert dup.record.expires_at is not None and dup.record.expires_at > time.time()
    got = ledger.get("k2")
    assert got is not None and got.state is State.SENT and got.lease_expires_at is None


@pytest.mark.parametrize("final", [State.FAILED, State.REVIEW])
def test_failed_and_review_replay_their_error(ledger: Ledger, final: State) -> None:
    c = ledger.claim(req("k3"))
    move = ledger.fail if final is State.FAILED else ledger.park
    move("k3", c.token, {"type": "PermanentSendError", "reason": "rejected"})
    dup = ledger.claim(req("k3"))
    assert dup.status is ClaimStatus.DONE and dup.record.state is final
    assert dup.record.error == {"type": "PermanentSendError", "reason": "rejected"}
    record = ledger.get("k3")
    assert record is not None
    assert (record.expires_at is None) is (final is State.REVIEW)  # review never expires


def test_expired_lease_is_reclaimed_with_higher_token(ledger: Ledger) -> None:
    c = ledger.claim(req("k4", lease_seconds=0.2))
    time.sleep(0.35)
    r = ledger.claim(req("k4"))
    assert r.status is ClaimStatus.RECLAIMED
    assert r.record.token > c.token
    assert r.record.reclaims == 1 and r.record.attempts == 2
    # The stale holder can no longer fail/park/release.
    with pytest.raises(StaleTokenError):
        ledger.fail("k4", c.token, {"reason": "x"})
    with pytest.raises(StaleTokenError):
        ledger.release("k4", c.token)
    assert ledger.renew("k4", c.token, 30) is False
    assert ledger.renew("k4", r.token, 30) is True


def test_stale_token_cannot_confirm_over_a_newer_sent(ledger: Ledger) -> None:
    c = ledger.claim(req("k5", lease_seconds=0.2))
    time.sleep(0.35)
    r = ledger.claim(req("k5"))
    ledger.complete("k5", r.token, {"message_id": "new"})
    with pytest.raises(StaleTokenError):
        ledger.complete("k5", c.token, {"message_id": "old"})
    record = ledger.get("k5")
    assert record is not None and record.result == {"message_id": "new"}


def test_late_holder_that_sent_may_confirm_over_review(ledger: Ledger) -> None:
    c = ledger.claim(req("k6", lease_seconds=0.2))
    time.sleep(0.35)
    r = ledger.claim(req("k6"))
    ledger.park("k6", r.token, {"reason": "lease_expired"})
    ledger.complete("k6", c.token, {"message_id": "truth"})
    record = ledger.get("k6")
    assert record is not None and record.state is State.SENT
    assert record.result == {"message_id": "truth"}
    assert record.payload is None  # the late holder's sent erases it too


def test_release_keeps_first_payload_and_reopens(ledger: Ledger) -> None:
    c = ledger.claim(req("k7"))
    ledger.release("k7", c.token, {"reason": "connect_error"})
    other = ClaimRequest(key="k7", task_name="tests.send", payload='{"args":[2],"kwargs":{}}',
                         fingerprint="e" * 64, lease_seconds=30)
    r = ledger.claim(other)
    assert r.status is ClaimStatus.REOPENED
    assert r.record.token == c.token + 1
    assert r.record.payload == '{"args":[1],"kwargs":{}}'  # the first payload ships
    assert r.record.fingerprint == "f" * 64
    assert r.record.reclaims == 0 and r.record.attempts == 2


def test_unknown_key_and_missing_record(ledger: Ledger) -> None:
    assert ledger.get("nope") is None
    with pytest.raises(RecordNotFoundError):
        ledger.complete("nope", 1, {})


def test_retention_expiry_and_purge(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> None:
    for backend in BACKENDS:
        led = make_ledger(backend, tmp_path_factory, retention_seconds=0.3)
        try:
            c = led.claim(req("old"))
            led.complete("old", c.token, {"message_id": "m"})
            p = led.claim(req("parked"))
            led.park("parked", p.token, {"reason": "x"})
            time.sleep(0.5)
            assert led.get("old") is None, backend
            assert led.purge_expired() >= (0 if backend == "redis" else 1), backend
            # A review record never expires: it is still there.
            parked = led.get("parked")
            assert parked is not None and parked.state is State.REVIEW, backend
            # After retention the key is a new intent again.
            again = led.claim(req("old"))
            assert again.status is ClaimStatus.ACQUIRED, backend
            assert [r.key for r in led.iter_records(State.REVIEW)] == ["parked"], backend
        finally:
            drop_ledger(led)


def test_resolve_review_to_sent_and_refuse_illegal(ledger: Ledger) -> None:
    c = ledger.claim(req("k8"))
    with pytest.raises(IllegalTransitionError):
        ledger.resolve("k8", "sent")  # live lease
    ledger.park("k8", c.token, {"reason": "lease_expired"})
    done = ledger.resolve("k8", "sent", result={"message_id": "found"}, note="seen in provider log", actor="ops")
    assert done.state is State.SENT
    record = ledger.get("k8")
    assert record is not None and record.state is State.SENT
    assert record.result == {"message_id": "found"}
    assert record.error is not None and record.error["resolution"]["by"] == "ops"
    with pytest.raises(IllegalTransitionError):
        ledger.resolve("k8", "released")  # sent is final
    with pytest.raises(RecordNotFoundError):
        ledger.resolve("missing", "sent")
    assert [r.key for r in ledger.iter_records(State.SENT)] == ["k8"]
    assert list(ledger.iter_records(State.REVIEW)) == []


def test_resolve_release_lets_next_claim_run_stored_payload(ledger: Ledger) -> None:
    c = ledger.claim(req("k9"))
    ledger.park("k9", c.token, {"reason": "ambiguous"})
    ledger.resolve("k9", "released", note="provider says not delivered")
    r = ledger.claim(req("k9"))
    assert r.status is ClaimStatus.REOPENED and r.record.payload == '{"args":[1],"kwargs":{}}'


def race(ledger: Ledger, key: str, n: int) -> list[ClaimStatus]:
    """``n`` threads claim ``key`` at the same instant; their answers."""
    barrier = threading.Barrier(n)
    statuses: list[ClaimStatus] = []
    lock = threading.Lock()

    def claimer() -> None:
        barrier.wait()
        status = ledger.claim(req(key)).status
        with lock:
            statuses.append(status)

    threads = [threading.Thread(target=claimer) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def test_concurrent_threads_exactly_one_wins(ledger: Ledger) -> None:
    statuses = race(ledger, "race", 16)
    assert statuses.count(ClaimStatus.ACQUIRED) == 1
    assert statuses.count(ClaimStatus.BUSY) == 15


def test_concurrent_reclaim_exactly_one_wins(ledger: Ledger) -> None:
    ledger.claim(req("race2", lease_seconds=0.2))
    time.sleep(0.35)
    statuses = race(ledger, "race2", 12)
    assert statuses.count(ClaimStatus.RECLAIMED) == 1
    assert statuses.count(ClaimStatus.BUSY) == 11


def _claim_in_process(url: str, options: dict[str, Any], key: str, start: Any, out: Any) -> None:
    led = from_url(url, **options)
    start.wait()
    out.put(led.claim(req(key)).status.value)


def test_concurrent_processes_exactly_one_wins(ledger: Ledger) -> None:
    from idemmail_celery.ledger.redis import RedisLedger
    from idemmail_celery.ledger.sql import SQLLedger

    if isinstance(ledger, RedisLedger):
        url = ledger.client.connection_pool.connection_kwargs
        target = f"redis://{url.get('host')}:{url.get('port')}/{url.get('db', 0)}"
        options: dict[str, Any] = {"prefix": ledger.prefix}
    else:
        assert isinstance(ledger, SQLLedger)
        target = ledger.url.render_as_string(hide_password=False)
        options = {"table": ledger.table.name}
    ledger.ping()  # the table exists before the race
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_claim_in_process, args=(target, options, "prace", start, out)) for _ in range(6)]
    for p in procs:
        p.start()
    time.sleep(1.5)  # let every process import and connect
    start.set()
    statuses = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert statuses.count("acquired") == 1, statuses
    assert statuses.count("busy") == 5, statuses


def test_namespaces_do_not_collide(tmp_path_factory: pytest.TempPathFactory) -> None:
    a = make_ledger("redis", tmp_path_factory)
    b = make_ledger("redis", tmp_path_factory)
    try:
        assert a.claim(req(unique("k"))).status is ClaimStatus.ACQUIRED
        key = unique("same")
        assert a.claim(req(key)).status is ClaimStatus.ACQUIRED
        assert b.claim(req(key)).status is ClaimStatus.ACQUIRED
    finally:
        drop_ledger(a)
        drop_ledger(b)


def test_claim_many_mixed_batch(ledger: Ledger) -> None:
    done = ledger.claim(req("b-sent"))
    ledger.complete("b-sent", done.token, {"message_id": "m"})
    ledger.claim(req("b-busy"))
    rel = ledger.claim(req("b-released"))
    ledger.release("b-released", rel.token)
    ledger.claim(req("b-expired", lease_seconds=0.2))
    time.sleep(0.35)
    keys = ["b-new1", "b-sent", "b-busy", "b-released", "b-expired", "b-new2"]
    claims = ledger.claim_many([req(k) for k in keys])
    assert [c.record.key for c in claims] == keys
    assert [c.status for c in claims] == [
        ClaimStatus.ACQUIRED, ClaimStatus.DONE, ClaimStatus.BUSY, ClaimStatus.REOPENED,
        ClaimStatus.RECLAIMED, ClaimStatus.ACQUIRED,
    ]
    assert claims[1].record.result == {"message_id": "m"}
    for c in claims:
        if c.status.holds:  # every held claim can be completed with the token it got
            ledger.complete(c.record.key, c.token, {"message_id": c.record.key})
    assert all(ledger.get(k).state is State.SENT for k in keys if k != "b-busy")  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="distinct"):
        ledger.claim_many([req("x"), req("x")])
    assert ledger.claim_many([]) == []


def test_claim_many_races_single_claims(ledger: Ledger) -> None:
    keys = [f"r{i}" for i in range(40)]
    statuses: list[ClaimStatus] = []
    lock = threading.Lock()
    barrier = threading.Barrier(3)

    def batch() -> None:
        barrier.wait()
        got = ledger.claim_many([req(k) for k in keys])
        with lock:
            statuses.extend(c.status for c in got)

    def singles() -> None:
        barrier.wait()
        for k in keys:
            s = ledger.claim(req(k)).status
            with lock:
                statuses.append(s)

    threads = [threading.Thread(target=batch), threading.Thread(target=batch), threading.Thread(target=singles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses.count(ClaimStatus.ACQUIRED) == len(keys)  # each key won exactly once
    assert statuses.count(ClaimStatus.BUSY) == 2 * len(keys)


def test_reusing_a_request_object_never_claims_twice(ledger: Ledger) -> None:
    same = req("reuse")
    assert ledger.claim(same).status is ClaimStatus.ACQUIRED
    assert ledger.claim(same).status is ClaimStatus.BUSY
    batch = [req("reuse-b1"), req("reuse-b2")]
    assert [c.status for c in ledger.claim_many(batch)] == [ClaimStatus.ACQUIRED] * 2
    assert [c.status for c in ledger.claim_many(batch)] == [ClaimStatus.BUSY] * 2


def test_results_with_typed_values_are_stored_and_unstorable_ones_refused(ledger: Ledger) -> None:
    import datetime as dt

    from idemmail_celery.errors import UnserializableArgumentsError

    c = ledger.claim(req("typed"))
    with pytest.raises(UnserializableArgumentsError):
        ledger.complete("typed", c.token, {"value": object()})
    at = dt.datetime(2026, 11, 22, 3, 0, tzinfo=dt.timezone.utc)
    ledger.complete("typed", c.token, {"value": {"accepted_at": at}, "message_id": "m"})
    record = ledger.get("typed")
    assert record is not None and record.state is State.SENT
    assert record.result == {"value": {"accepted_at": "2026-11-22T03:00:00+00:00"}, "message_id": "m"}


FIRST = '{"args":[1],"kwargs":{}}'


def test_sent_erases_the_first_payload_and_other_finals_keep_it(ledger: Ledger) -> None:
    done = ledger.claim(req("p-sent"))
    ledger.complete("p-sent", done.token, {"message_id": "m"})
    sent = ledger.get("p-sent")
    assert sent is not None and sent.state is State.SENT and sent.payload is None
    assert sent.fingerprint == "f" * 64  # the fingerprint stays: duplicates are still checked
    dup = ledger.claim(req("p-sent"))
    assert dup.status is ClaimStatus.DONE and dup.record.payload is None
    assert dup.record.result == {"message_id": "m"}
    for key, move in (("p-review", ledger.park), ("p-failed", ledger.fail), ("p-released", ledger.release)):
        c = ledger.claim(req(key))
        move(key, c.token, {"reason": "x"})
        kept = ledger.get(key)
        assert kept is not None and kept.payload == FIRST, key  # needed to resend or to resolve


def test_operator_or_webhook_sent_erases_the_payload(ledger: Ledger) -> None:
    p = ledger.claim(req("p-resolved"))
    ledger.park("p-resolved", p.token, {"reason": "ambiguous"})
    returned = ledger.resolve("p-resolved", "sent", result={"message_id": "found"}, note="seen", actor="ops")
    resolved = ledger.get("p-resolved")
    assert resolved is not None and resolved.state is State.SENT and resolved.payload is None
    assert returned == resolved  # what the caller gets back is what the store holds
    q = ledger.claim(req("p-confirmed"))
    ledger.release("p-confirmed", q.token)
    returned = ledger.confirm_sent("p-confirmed", {"message_id": "hook"})
    confirmed = ledger.get("p-confirmed")
    assert confirmed is not None and confirmed.state is State.SENT and confirmed.payload is None
    assert returned == confirmed


@pytest.mark.parametrize("backend", BACKENDS)
def test_keep_payload_keeps_it_after_sent_for_audit(backend: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    led = make_ledger(backend, tmp_path_factory, keep_payload=True)
    try:
        assert led.keep_payload is True
        c = led.claim(req("audit"))
        led.complete("audit", c.token, {"message_id": "m"})
        record = led.get("audit")
        assert record is not None and record.state is State.SENT and record.payload == FIRST
        p = led.claim(req("audit-resolved"))
        led.park("audit-resolved", p.token, {"reason": "x"})
        led.resolve("audit-resolved", "sent", note="seen")
        resolved = led.get("audit-resolved")
        assert resolved is not None and resolved.payload == FIRST
    finally:
        drop_ledger(led)


def test_stats_count_each_state_and_leave_expired_records_out(ledger: Ledger) -> None:
    ledger.retention_seconds = 0.3
    for key in ("s-sent", "s-review", "s-claimed", "s-released", "s-failed"):
        ledger.claim(req(key))
    ledger.complete("s-sent", 1, {"message_id": "m"})
    ledger.park("s-review", 1, {"reason": "ambiguous"})
    ledger.release("s-released", 1)
    ledger.fail("s-failed", 1, {"reason": "bounced"})
    counts = ledger.stats()
    assert {k: v for k, v in counts.items() if v} == {
        "sent": 1, "review": 1, "claimed": 1, "released": 1, "failed": 1,
    }
    time.sleep(0.5)  # past retention: sent and failed no longer count (their keys are free again)
    assert {k: v for k, v in ledger.stats().items() if v} == {"review": 1, "claimed": 1, "released": 1}
