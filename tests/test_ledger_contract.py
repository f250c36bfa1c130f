"""One contract, every backend: Redis, PostgreSQL, MariaDB and SQLite, all real."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from idemmail_celery.errors import IllegalTransitionError, RecordNotFoundError, StaleTokenError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, Ledger, State, from_url
from idemmail_celery.ledger.base import new_owner
from idemmail_celery.ledger.wrapper import LedgerWrapper

from .conftest import BACKENDS, REDIS_SERVERS, STORES, drop_ledger, make_ledger, unique


@pytest.fixture
def ledger(store_ledger: Ledger) -> Ledger:
    """The contract holds on every store, Valkey 9 included."""
    return store_ledger


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
    for backend in [s for s in STORES if s != "valkey"]:  # (make check, Python 3.10 too: no Valkey there)
        led = make_ledger(backend, tmp_path_factory, retention_seconds=0.3)
        try:
            c = led.claim(req("old"))
            led.complete("old", c.token, {"message_id": "m"})
            p = led.claim(req("parked"))
            led.park("parked", p.token, {"reason": "x"})
            time.sleep(0.5)
            assert led.get("old") is None, backend
            assert led.purge_expired() >= (0 if backend in REDIS_SERVERS else 1), backend
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
    assert record.resolution is not None and record.resolution["by"] == "ops"
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


def _claim_in_process(url: str, options: dict[str, Any], key: str, ready: Any, start: Any, out: Any) -> None:
    led = from_url(url, **options)
    led.ping()  # connected
    ready.put(None)
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
    # Fresh processes forked from a server that imported the ledger once (six spawned interpreters
    # would each import it again); each makes its own ledger and connections after the fork.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["idemmail_celery.ledger", __name__])
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_claim_in_process, args=(target, options, "prace", ready, start, out))
             for _ in range(6)]
    for p in procs:
        p.start()
    for _ in procs:  # every process has imported and connected
        ready.get(timeout=60)
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


def test_a_request_run_twice_finds_its_own_claim_and_a_move_run_twice_is_done(ledger: Ledger) -> None:
    """A client that runs a claim or a move again after its reply was lost (the store ran the first)
    finds its own work: the claim comes back held (a new token: the first is void), not busy with
    itself; the move comes back done, not stale. Nobody else has this request's owner (its nonce)."""
    same = req("reuse")
    first = ledger.claim(same)
    assert first.status is ClaimStatus.ACQUIRED
    again = ledger.claim(same)
    assert again.status is ClaimStatus.RESUMED and again.token > first.token
    with pytest.raises(StaleTokenError):
        ledger.release("reuse", first.token)
    assert ledger.claim(req("reuse")).status is ClaimStatus.BUSY  # another owner: busy, as ever
    ledger.complete("reuse", again.token, {"message_id": "m-1"})
    ledger.complete("reuse", again.token, {"message_id": "m-1"})  # run twice: done, not stale
    record = ledger.get("reuse")
    assert record is not None and record.state is State.SENT and record.result == {"message_id": "m-1"}
    batch = [req("reuse-b1"), req("reuse-b2")]
    assert [c.status for c in ledger.claim_many(batch)] == [ClaimStatus.ACQUIRED] * 2
    assert [c.status for c in ledger.claim_many(batch)] == [ClaimStatus.RESUMED] * 2


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


def test_a_confirmation_of_the_record_as_it_was_leaves_a_decision_made_since(ledger: Ledger) -> None:
    c = ledger.claim(req("p-decided"))
    ledger.park("p-decided", c.token, {"reason": "lease_expired"})
    parked = ledger.get("p-decided")
    assert parked is not None and parked.state is State.REVIEW
    ledger.resolve("p-decided", "failed", note="did not go out", actor="ops")  # an operator, in between
    with pytest.raises(IllegalTransitionError):
        ledger.confirm_sent("p-decided", {"message_id": "late"}, expect=parked)
    kept = ledger.get("p-decided")
    assert kept is not None and kept.state is State.FAILED
    c2 = ledger.claim(req("p-undecided"))
    ledger.park("p-undecided", c2.token, {"reason": "lease_expired"})
    untouched = ledger.get("p-undecided")
    assert untouched is not None
    assert ledger.confirm_sent("p-undecided", {"message_id": "m"}, expect=untouched).state is State.SENT


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


def test_resume_owner_takes_back_its_own_live_claim_once(ledger: Ledger) -> None:
    first = ledger.claim(req("rs1", owner="host:1:task-a:aaaa"))
    assert first.status is ClaimStatus.ACQUIRED
    # Another owner: busy. The chain's own next delivery (resume_owner) takes it back.
    assert ledger.claim(req("rs1", owner="host:2:x:bbbb")).status is ClaimStatus.BUSY
    back = ledger.claim(req("rs1", owner="host:1:task-a:cccc", resume_owner="host:1:task-a:aaaa"))
    assert back.status is ClaimStatus.RESUMED
    assert back.record.token > first.token and back.record.owner == "host:1:task-a:cccc"
    assert back.record.reclaims == 0 and back.record.payload == '{"args":[1],"kwargs":{}}'
    # A second copy of the same message (same resume_owner) finds the claim busy now.
    again = ledger.claim(req("rs1", owner="host:3:task-a:dddd", resume_owner="host:1:task-a:aaaa"))
    assert again.status is ClaimStatus.BUSY
    with pytest.raises(StaleTokenError):
        ledger.release("rs1", first.token)
    ledger.complete("rs1", back.token, {"message_id": "m-rs1"})
    done = ledger.claim(req("rs1", owner="host:1:task-a:eeee", resume_owner="host:1:task-a:cccc"))
    assert done.status is ClaimStatus.DONE and done.record.state is State.SENT


def test_resume_owner_takes_back_its_own_expired_claim_without_a_reclaim(ledger: Ledger) -> None:
    first = ledger.claim(req("rs2", owner="host:1:task-b:aaaa", lease_seconds=0.2))
    time.sleep(0.35)
    back = ledger.claim(req("rs2", owner="host:1:task-b:bbbb", resume_owner="host:1:task-b:aaaa"))
    assert back.status is ClaimStatus.RESUMED
    assert back.record.token > first.token and back.record.reclaims == 0
    # Someone else's expired claim is still a reclaim, whatever resume_owner says.
    other = ledger.claim(req("rs3", owner="host:9:task-z:zzzz", lease_seconds=0.2))
    time.sleep(0.35)
    taken = ledger.claim(req("rs3", owner="host:1:task-b:cccc", resume_owner="host:1:task-b:aaaa"))
    assert taken.status is ClaimStatus.RECLAIMED and taken.record.token > other.token


def test_resume_owner_on_a_new_or_released_key_claims_as_usual(ledger: Ledger) -> None:
    fresh = ledger.claim(req("rs4", owner="o:new", resume_owner="o:lost-reply-never-landed"))
    assert fresh.status is ClaimStatus.ACQUIRED
    ledger.release("rs4", fresh.token)
    again = ledger.claim(req("rs4", owner="o:next", resume_owner="o:new"))
    assert again.status is ClaimStatus.REOPENED


def test_claim_many_honours_resume_owner(ledger: Ledger) -> None:
    first = ledger.claim(req("rs5", owner="campaign:1:aaaa"))
    claims = ledger.claim_many([req("rs5", owner="campaign:1:bbbb", resume_owner="campaign:1:aaaa"),
                                req("rs6", owner="campaign:1:bbbb", resume_owner="campaign:1:aaaa")])
    assert [c.status for c in claims] == [ClaimStatus.RESUMED, ClaimStatus.ACQUIRED]
    assert claims[0].record.token > first.token


def test_mark_hop_is_true_once_per_key_and_hop(ledger: Ledger) -> None:
    assert ledger.mark_hop("hp1", "task-1:3", 60) is True
    assert ledger.mark_hop("hp1", "task-1:3", 60) is False
    assert ledger.mark_hop("hp1", "task-1:4", 60) is True
    assert ledger.mark_hop("hp2", "task-1:3", 60) is True


def test_mark_hop_is_atomic_across_threads(ledger: Ledger) -> None:
    wins: list[bool | None] = []
    lock = threading.Lock()

    def mark() -> None:
        got = ledger.mark_hop("hp3", "task-9:1", 60)
        with lock:
            wins.append(got)

    threads = [threading.Thread(target=mark) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins, key=str) == [False] * 7 + [True]


def test_mark_hop_expires(ledger: Ledger) -> None:
    assert ledger.mark_hop("hp4", "task-2:1", 0.3) is True
    time.sleep(0.5)
    assert ledger.mark_hop("hp4", "task-2:1", 0.3) is True


def test_hop_marked_reads_a_live_mark_and_marks_nothing(ledger: Ledger) -> None:
    assert ledger.hop_marked("hp5", "task-3:1") is False
    assert ledger.hop_marked("hp5", "task-3:1") is False  # reading twice set nothing
    assert ledger.mark_hop("hp5", "task-3:1", 0.3) is True
    assert ledger.hop_marked("hp5", "task-3:1") is True
    assert ledger.hop_marked("hp5", "task-3:2") is False and ledger.hop_marked("hp6", "task-3:1") is False
    time.sleep(0.5)
    assert ledger.hop_marked("hp5", "task-3:1") is False  # expired


def test_forget_erases_payload_and_free_text_but_keeps_the_guarantee(ledger: Ledger) -> None:
    c = ledger.claim(req("fg1"))
    ledger.park("fg1", c.token, {"type": "SendNeedsReview", "reason": "timeout", "at": 1.0,
                                 "message": "550 <ann@example.com> mailbox full: Your invoice 4821"})
    ledger.resolve("fg1", State.FAILED, note="Ann asked us by phone", actor="ops@example.com")
    s = ledger.claim(req("fg2"))
    ledger.complete("fg2", s.token, {"message_id": "m-fg2", "value": {"to": "ann@example.com"}})
    assert ledger.forget("fg1") is True and ledger.forget("fg2") is True
    assert ledger.forget("fg1") is True  # idempotent
    failed, sent = ledger.get("fg1"), ledger.get("fg2")
    assert failed is not None and sent is not None
    assert failed.payload is None and failed.state is State.FAILED
    assert failed.error is not None and "message" not in failed.error and failed.error["reason"] == "timeout"
    assert failed.resolution is not None
    assert failed.resolution == {"from": "review", "to": "failed", "at": failed.resolution["at"],
                                 "by": "ops@example.com", "forgotten": True}  # the note is free text: gone
    assert sent.result == {"message_id": "m-fg2", "forgotten": True}
    assert "ann@example.com" not in repr(failed) + repr(sent)
    # The key still protects: a duplicate replays, it does not send again.
    assert ledger.claim(req("fg2")).status is ClaimStatus.DONE
    assert ledger.forget("never-was") is False


def test_forget_on_a_live_claim_keeps_the_claim_working(ledger: Ledger) -> None:
    c = ledger.claim(req("fg3"))
    assert ledger.forget("fg3") is True
    assert ledger.claim(req("fg3")).status is ClaimStatus.BUSY
    assert ledger.renew("fg3", c.token, 30) is True
    ledger.complete("fg3", c.token, {"message_id": "m-fg3"})
    record = ledger.get("fg3")
    assert record is not None and record.state is State.SENT and record.result == {"message_id": "m-fg3"}


def test_forget_keeps_a_dead_holders_write_ahead_mark(ledger: Ledger) -> None:
    """Found by the simulator (sim/traces/forget_erases_write_ahead_mark.json): a data-subject request
    for a claim whose holder marked, sent and died erased the mark with the free text, so the next
    claimer took it for a claim that never ran and sent the intent again."""
    c = ledger.claim(req("fg4", lease_seconds=0.2, owner=new_owner("t"), writes_ahead=True))
    assert ledger.write_ahead("fg4", c.token, 0.2, "message") is True
    assert ledger.forget("fg4") is True
    forgot = ledger.get("fg4")
    assert forgot is not None and forgot.payload is None
    time.sleep(0.35)
    taken = ledger.claim(req("fg4", owner=new_owner("u"), writes_ahead=True))
    assert taken.status is ClaimStatus.RECLAIMED
    mark = taken.record.mark
    assert mark is not None and mark.stage == "message" and mark.token == c.token


class MovesWhileForgetting(LedgerWrapper):
    """A store on which ``move`` lands between ``forget``'s read of a record and its erase: the race of a
    data-subject request with the record's holder."""

    def __init__(self, inner: Ledger, move: Any) -> None:
        super().__init__(inner)
        self.move = move

    def _readable(self, key: str) -> Any:
        seen = self.inner._readable(key)
        if self.move is not None:
            self.move, move = None, self.move
            move()
        return seen


def test_forget_racing_a_write_ahead_mark_keeps_the_mark(ledger: Ledger) -> None:
    """Found by the simulator (sim/traces/forget_races_a_write_ahead_mark.json): forget read a claim without a
    mark, its holder marked and sent, forget erased under the same token and wiped the mark with the free
    text; the holder died, and the next claimer, finding no mark, sent the intent again."""
    c = ledger.claim(req("fg5", lease_seconds=0.2, owner=new_owner("t"), writes_ahead=True))
    store = MovesWhileForgetting(ledger, lambda: ledger.write_ahead("fg5", c.token, 0.2, "message"))
    assert store.forget("fg5") is True
    time.sleep(0.35)
    taken = ledger.claim(req("fg5", owner=new_owner("u"), writes_ahead=True))
    assert taken.status is ClaimStatus.RECLAIMED and taken.record.payload is None
    mark = taken.record.mark
    assert mark is not None and mark.stage == "message" and mark.token == c.token


def test_forget_racing_a_completion_keeps_what_it_recorded(ledger: Ledger) -> None:
    """A completion between forget's read and its erase keeps the same token; the erase, made of what was
    read before it, must not write over the result (the message id a duplicate is told)."""
    c = ledger.claim(req("fg6"))
    store = MovesWhileForgetting(ledger, lambda: ledger.complete("fg6", c.token, {"message_id": "m-fg6",
                                                                                  "value": "Ann"}))
    assert store.forget("fg6") is True
    sent = ledger.get("fg6")
    assert sent is not None and sent.state is State.SENT
    assert sent.result == {"message_id": "m-fg6", "forgotten": True}  # read again and forgotten, not lost


class DefaultWriteAhead(LedgerWrapper):
    """A backend that leaves ``write_ahead`` to the base class (read, then replace under the token)."""

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        return Ledger.write_ahead(self, key, token, lease_seconds, stage, owner=owner)


@pytest.mark.parametrize("own", [False, True], ids=["backend", "base-default"])
def test_a_write_ahead_mark_is_fenced_kept_by_a_reclaim_and_replaced_by_a_release(ledger: Ledger, own: bool) -> None:
    store: Ledger = DefaultWriteAhead(ledger) if own else ledger
    c = store.claim(req("wa1", lease_seconds=0.2, owner=new_owner("t"), writes_ahead=True))
    assert c.status is ClaimStatus.ACQUIRED and c.previous_owner is None
    assert store.write_ahead("wa1", c.token + 1, 30, "message") is False  # not the holder's token
    assert store.get("wa1").mark is None  # type: ignore[arg-type]
    before = time.time()
    assert store.write_ahead("wa1", c.token, 0.2, "message") is True
    marked = store.get("wa1")
    assert marked is not None and marked.state is State.CLAIMED and marked.lease_expires_at is not None
    assert marked.lease_expires_at >= before + 0.15  # the mark renews the lease too
    mark = marked.mark
    assert mark is not None and mark.stage == "message" and mark.at >= before - 1
    time.sleep(0.35)
    r = store.claim(req("wa1", lease_seconds=30))
    assert r.status is ClaimStatus.RECLAIMED
    assert r.previous_owner is not None and r.previous_writes_ahead
    assert r.record.owner != r.previous_owner
    assert r.record.mark == mark  # the next claimer sees what the dead holder had begun
    assert store.write_ahead("wa1", c.token, 30, "message") is False  # the dead holder's token is stale
    store.release("wa1", r.token, {"reason": "tempfail"})
    assert store.write_ahead("wa1", r.token, 30, "message") is False  # released: not held
    again = store.claim(req("wa1"))
    assert again.status is ClaimStatus.REOPENED and again.previous_owner is None
    assert again.record.mark is None and again.record.error == {"reason": "tempfail"}


@pytest.mark.parametrize("own", [False, True], ids=["backend", "base-default"])
def test_a_write_ahead_mark_names_the_owner_that_wrote_it(ledger: Ledger, own: bool) -> None:
    store: Ledger = DefaultWriteAhead(ledger) if own else ledger
    c = store.claim(req("wa4", lease_seconds=0.2, owner=new_owner("t"), writes_ahead=True))
    assert store.write_ahead("wa4", c.token, 0.2, "message", owner=c.record.owner) is True
    time.sleep(0.35)
    r = store.claim(req("wa4"))
    mark = r.record.mark  # kept by the reclaim, with the owner as the claim returned it
    assert mark is not None and mark.owner == c.record.owner and mark.token == c.token


def test_a_reclaim_names_the_holder_it_took_over_from(ledger: Ledger) -> None:
    c = ledger.claim(req("wa2", lease_seconds=0.2, owner="old-worker:1:abcd"))
    time.sleep(0.35)
    r = ledger.claim(req("wa2"))
    assert r.status is ClaimStatus.RECLAIMED and r.previous_owner is not None
    assert r.previous_owner.startswith("old-worker:1:abcd") and not r.previous_writes_ahead
    assert c.token < r.token
    # That holder made no write-ahead promise and left no mark: the takeover says it may have run.
    assert ledger.marks_takeovers is True
    mark = r.record.mark
    assert mark is not None and mark.stage == "unknown" and mark.token == c.token
    resumed = ledger.claim(req("wa2", owner="next:1:ef01", resume_owner=r.record.owner))
    assert resumed.status is ClaimStatus.RESUMED and resumed.record.mark == mark  # kept for the chain


def test_a_move_out_of_claimed_drops_the_write_ahead_mark_it_does_not_replace(ledger: Ledger) -> None:
    c = ledger.claim(req("wa3"))
    assert ledger.write_ahead("wa3", c.token, 30, "message") is True
    ledger.release("wa3", c.token)  # no note: nothing was sent, and the mark no longer says otherwise
    released = ledger.get("wa3")
    assert released is not None and released.state is State.RELEASED and released.error is None
    c2 = ledger.claim(req("wa3"))
    assert ledger.write_ahead("wa3", c2.token, 30, "message") is True
    ledger.complete("wa3", c2.token, {"message_id": "m-wa3"})
    sent = ledger.get("wa3")
    assert sent is not None and sent.state is State.SENT and sent.error is None
    assert sent.result == {"message_id": "m-wa3"}


def test_a_withdrawn_claim_leaves_no_trace_and_the_next_claim_is_new(ledger: Ledger) -> None:
    c = ledger.claim(req("wd1", owner="host:1:rotating:aaaa"))
    assert c.status is ClaimStatus.ACQUIRED
    assert ledger.withdraw("wd1", c.token + 1) is False  # not the holder's token: nothing changes
    held = ledger.get("wd1")
    assert held is not None and held.state is State.CLAIMED and held.token == c.token
    assert ledger.withdraw("wd1", c.token) is True
    assert ledger.get("wd1") is None
    assert ledger.stats()["claimed"] == 0 and list(ledger.iter_records(State.CLAIMED)) == []  # the index too
    assert ledger.withdraw("wd1", c.token) is False  # gone: a second withdrawal finds nothing
    again = ledger.claim(ClaimRequest(key="wd1", task_name="tests.send", payload='{"args":[2],"kwargs":{}}',
                                      fingerprint="e" * 64, owner="host:2:other:bbbb"))
    assert again.status is ClaimStatus.ACQUIRED and again.record.token == 1
    record = ledger.get("wd1")
    assert record is not None and record.payload == '{"args":[2],"kwargs":{}}' and record.attempts == 1
    assert record.owner.startswith("host:2:other:bbbb")


@pytest.mark.parametrize("state", [State.RELEASED, State.SENT, State.REVIEW])
def test_only_a_held_claim_can_be_withdrawn(ledger: Ledger, state: State) -> None:
    c = ledger.claim(req("wd2"))
    if state is State.SENT:
        ledger.complete("wd2", c.token, {"message_id": "m-wd2"})
    elif state is State.REVIEW:
        ledger.park("wd2", c.token, {"reason": "lease_expired"})
    else:
        ledger.release("wd2", c.token)
    before = ledger.get("wd2")
    assert before is not None and before.state is state
    assert ledger.withdraw("wd2", before.token) is False and ledger.withdraw("wd2", c.token) is False
    assert ledger.get("wd2") == before
    assert ledger.claim(req("wd2")).status is (ClaimStatus.REOPENED if state is State.RELEASED else ClaimStatus.DONE)


def test_the_write_ahead_promise_is_the_claims_field_not_a_word_in_its_owner(ledger: Ledger) -> None:
    """The promise is ``ClaimRequest.writes_ahead``, kept as the record's field: an owner that spells ':ahead:'
    (a caller's task id) promises nothing, and a takeover judges the holder by the field alone."""
    spelled = ledger.claim(req("pr1", lease_seconds=0.2, owner=new_owner("x:ahead:y")))
    promised = ledger.claim(req("pr2", lease_seconds=0.2, owner=new_owner("plain"), writes_ahead=True))
    assert not spelled.record.writes_ahead and promised.record.writes_ahead
    stored = ledger.get("pr2")
    assert stored is not None and stored.writes_ahead
    time.sleep(0.35)
    after_spelled, after_promised = ledger.claim(req("pr1")), ledger.claim(req("pr2"))
    assert (after_spelled.status, after_promised.status) == (ClaimStatus.RECLAIMED, ClaimStatus.RECLAIMED)
    assert not after_spelled.previous_writes_ahead and after_promised.previous_writes_ahead
    # No promise, no mark: it may have run (unknown). A promise kept and no mark: it never began.
    assert after_spelled.record.mark is not None and after_spelled.record.mark.stage == "unknown"
    assert after_promised.record.mark is None
    assert not after_promised.record.writes_ahead  # the new holder made no promise: the record says so
    again = ledger.get("pr2")
    assert again is not None and not again.writes_ahead


def test_the_key_secret_roster_lists_live_workers_until_they_lapse_or_leave(ledger: Ledger) -> None:
    """The roster a one-step key-secret rotation decides by (issue 35, item 4)."""
    assert ledger.roster() == []
    ledger.announce("web-1:10", ["aaaaaaaaaaaa"], 30.0)
    ledger.announce("web-2:20", ["bbbbbbbbbbbb", "aaaaaaaaaaaa"], 0.4)
    ledger.announce("web-1:10", ["bbbbbbbbbbbb", "aaaaaaaaaaaa"], 30.0)  # announced again: replaced
    now = time.time()
    entries = {e.member: e for e in ledger.roster()}
    assert {m: e.secret_ids for m, e in entries.items()} == {
        "web-1:10": ("bbbbbbbbbbbb", "aaaaaaaaaaaa"), "web-2:20": ("bbbbbbbbbbbb", "aaaaaaaaaaaa")}
    assert now + 25 < entries["web-1:10"].expires_at < now + 35
    time.sleep(0.6)  # web-2 stopped announcing: it lapses
    assert [e.member for e in ledger.roster()] == ["web-1:10"]
    ledger.announce("web-1:10", ["bbbbbbbbbbbb"], 0)  # a warm shutdown leaves
    assert ledger.roster() == []
    with pytest.raises(ValueError):
        ledger.announce("web-3:30", [], 30.0)
    with pytest.raises(ValueError):
        ledger.announce("", ["aaaaaaaaaaaa"], 30.0)


def stored_roster_members(ledger: Ledger) -> set[str]:
    """The members the store holds, lapsed or not (what ``roster()`` leaves out, read past it)."""
    from idemmail_celery.ledger.redis import RedisLedger
    from idemmail_celery.ledger.sql import SQLLedger
    from sim.ledger import MemLedger

    if isinstance(ledger, RedisLedger):
        return set(ledger.client.hkeys(ledger.names.roster()))
    if isinstance(ledger, MemLedger):  # the simulator's (tests/test_sim.py runs this contract on it)
        return set(ledger.members)
    assert isinstance(ledger, SQLLedger)
    r = ledger.roster_table
    return {m for (m,) in ledger._run(lambda conn: conn.execute(sa.select(r.c.member)).all())}


def test_reading_the_roster_writes_nothing_and_an_announcement_prunes_lapsed_entries(ledger: Ledger) -> None:
    """Every process with several key secrets reads the roster (web processes too, on a read-only database
    user or replica, say): a read leaves lapsed entries out without deleting them; the workers' announcements
    (a write anyway) prune them."""
    ledger.announce("gone-1:10", ["aaaaaaaaaaaa"], 0.3)
    ledger.announce("live-2:20", ["aaaaaaaaaaaa"], 30.0)
    time.sleep(0.5)  # gone-1 lapsed
    for _ in range(3):
        assert [e.member for e in ledger.roster()] == ["live-2:20"]
    assert stored_roster_members(ledger) == {"gone-1:10", "live-2:20"}  # read, not written
    ledger.announce("live-2:20", ["aaaaaaaaaaaa"], 30.0)  # the next heartbeat prunes
    assert stored_roster_members(ledger) == {"live-2:20"}
    assert [e.member for e in ledger.roster()] == ["live-2:20"]


def test_a_released_resolution_stays_with_the_record_once_the_next_claim_sends_it(ledger: Ledger) -> None:
    """An operator releases a parked intent (the resolution says who and why); the next claim reopens it and
    sends. The record keeps the decision beside the result (the Redis ledger keeps such a sent record as a hash
    of its own, not on a shelf, whose entries have no room for it), and forget still erases its note."""
    c = ledger.claim(req("rs1"))
    ledger.park("rs1", c.token, {"reason": "lease_expired"})
    released = ledger.resolve("rs1", State.RELEASED, note="provider says not delivered", actor="ops")
    assert released.resolution is not None and released.error == {"reason": "lease_expired"}
    again = ledger.claim(req("rs1"))
    assert again.status is ClaimStatus.REOPENED and again.record.resolution == released.resolution
    ledger.complete("rs1", again.token, {"message_id": "m-rs1"})
    sent = ledger.get("rs1")
    assert sent is not None and sent.state is State.SENT and sent.result == {"message_id": "m-rs1"}
    assert sent.resolution == released.resolution and sent.error == {"reason": "lease_expired"}
    assert ledger.stats()["sent"] == 1
    assert ledger.forget("rs1") is True
    forgot = ledger.get("rs1")
    assert forgot is not None and forgot.resolution is not None and "note" not in forgot.resolution
    assert forgot.resolution["by"] == "ops" and forgot.result == {"message_id": "m-rs1", "forgotten": True}
