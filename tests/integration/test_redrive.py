"""Issue 23, case 5: the ledger re-drives what the broker forgets, and green pools get the broker's copies back."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from idemmail_celery.keys import Payload
from idemmail_celery.ledger import ClaimRequest, State
from idemmail_celery.redrive import LOCK_KEY, SWEEP_TASK, sweep_stranded
from idemmail_celery.testing.redis_server import RedisServer

from ..conftest import RABBITMQ_URL, wait_for
from .conftest import Sink, results


def test_a_claim_no_message_will_come_back_for_is_republished_and_settled_once(
    app_module: Any, sink: Sink, start_worker: Any
) -> None:
    # The broker lost the chain's only message (a restart without persistence, a purge): the ledger has
    # the claim and its first payload, and nothing else would ever come back for it.
    task = app_module.send_keyed
    stranded, live = task.intent_key("ann@example.com", 81), task.intent_key("bob@example.com", 82)
    for key, to, order, lease in ((stranded, "ann@example.com", 81, 0.2), (live, "bob@example.com", 82, 600.0)):
        first = Payload([to, order], {})
        task.ledger.claim(ClaimRequest(key=key, task_name=task.name, payload=first.to_json(),
                                       fingerprint=task.key_builder.fingerprint(first), owner="gone:1:dead",
                                       lease_seconds=lease))
    time.sleep(0.3)  # the stranded claim's lease runs out (the sweep is told a later "now" below)
    swept = sweep_stranded(app_module.app, after_seconds=60, now=time.time() + 120)
    assert swept == [stranded]  # the live one is its holder's
    assert sweep_stranded(app_module.app, after_seconds=60, now=time.time() + 120) == []  # once per period
    start_worker("-P", "prefork", "-c", "1")
    record = wait_for(lambda: (r := task.ledger.get(stranded)) is not None and r.state is State.SENT and r,
                      timeout=90)
    assert record.reclaims == 1  # taken over from the dead holder, sent with its key
    assert len(sink.deliveries()) == 1
    held = task.ledger.get(live)
    assert held is not None and held.state is State.CLAIMED


@pytest.fixture
def own_broker_app(ledger_redis: RedisServer, worker_env: dict[str, str], request: pytest.FixtureRequest) -> Any:
    """``app_module`` and its workers on a Redis broker of this test's own: kombu restores every queue's
    unacked messages of a Redis database, so on the shared one other tests' workers would hand this
    test's messages back (or hold the restore's lock) whatever these workers do."""
    worker_env.update(IDEMMAIL_TEST_BROKER=f"redis://127.0.0.1:{ledger_redis.port}/0")
    return request.getfixturevalue("app_module")


def _claimed(task: Any) -> list[str]:
    """The keys of ``task``'s ledger still ``claimed`` (a sweep's own lease aside)."""
    return [r.key for r in task.ledger.iter_records(State.CLAIMED) if r.key != LOCK_KEY]


def _kill_holding(app_module: Any, sink: Sink, worker: Any, n: int) -> list[Any]:
    """Enqueue ``n`` keyed sends, wait until ``worker`` runs them all (received, claimed, unacked), SIGKILL it."""
    sink.control("hold", "60")
    ars = [app_module.send_keyed.delay(f"p{i}@example.com", 90 + i) for i in range(n)]
    wait_for(lambda: len(sink.pids()) >= n, timeout=60)
    worker.kill()
    sink.r.delete(sink.k("ctl.hold"))
    return ars


@pytest.mark.parametrize("pool", ["gevent", "threads"])
def test_a_fresh_worker_of_the_defaults_drains_what_a_killed_worker_held(
    own_broker_app: Any, sink: Sink, start_worker: Any, worker_env: dict[str, str], pool: str
) -> None:
    # The library's defaults: no module to include, no beat entry. Before: a gevent worker never ran the
    # transport's restore (celery/celery#4968), and the killed worker's messages stayed unacked for good.
    worker_env.update(IDEMMAIL_TEST_VT="3", IDEMMAIL_TEST_LEASE="3")
    ars = _kill_holding(own_broker_app, sink, start_worker("-P", pool, "-c", "5"), 5)
    second = start_worker("-P", pool, "-c", "5")
    assert [r["status"] for r in results(ars, timeout=90)] == ["sent"] * 5
    keys = [own_broker_app.send_keyed.intent_key(f"p{i}@example.com", 90 + i) for i in range(5)]
    assert sorted(sink.attempts()) == sorted(keys)  # each intent sent once
    assert len(sink.deliveries()) == 5
    assert _claimed(own_broker_app.send_keyed) == []
    if pool == "gevent":  # threads run kombu's event loop, which restores by itself
        assert b"restores the Redis broker's unacked messages" in second.log()


def test_with_both_settings_off_nothing_is_re_driven_and_a_beat_entry_still_sweeps(
    own_broker_app: Any, sink: Sink, start_worker: Any, worker_env: dict[str, str]
) -> None:
    worker_env.update(IDEMMAIL_TEST_VT="2", IDEMMAIL_TEST_LEASE="2", IDEMMAIL_TEST_SWEEP_AFTER="1",
                      IDEMMAIL_TEST_RESTORE_UNACKED="false", IDEMMAIL_TEST_SWEEP_IN_WORKERS="false")
    task = own_broker_app.send_keyed
    held = task.intent_key("p0@example.com", 90)
    ars = _kill_holding(own_broker_app, sink, start_worker("-P", "gevent", "-c", "5"), 1)
    second = start_worker("-P", "gevent", "-c", "5")
    time.sleep(8)  # four visibility timeouts; a restore every second would have come several times
    assert sink.deliveries() == [] and _claimed(task) == [held]
    assert b"restores the Redis broker's unacked messages" not in second.log()
    assert b"sweeping" not in second.log()
    # What a beat entry sends: the sweep runs on a worker with nothing included, and re-drives the claim
    # (a message of its own: the killed worker's copy, and its result, stay in the broker's unacked set).
    own_broker_app.app.send_task(SWEEP_TASK)
    wait_for(lambda: (r := task.ledger.get(held)) is not None and r.state is State.SENT, timeout=60)
    assert len(sink.deliveries()) == 1 and _claimed(task) == [] and ars[0].state == "PENDING"


def test_one_worker_at_a_time_sweeps_and_each_stranded_claim_is_republished_once(
    app_module: Any, sink: Sink, start_worker: Any, worker_env: dict[str, str]
) -> None:
    # Claims whose messages the broker lost: only the ledger knows of them.
    worker_env.update(IDEMMAIL_TEST_SWEEP_AFTER="2")  # a sweep about every second
    task = app_module.send_keyed
    keys = []
    for i in range(5):
        first = Payload([f"s{i}@example.com", 70 + i], {})
        keys.append(task.intent_key(*first.args))
        task.ledger.claim(ClaimRequest(key=keys[-1], task_name=task.name, payload=first.to_json(),
                                       fingerprint=task.key_builder.fingerprint(first), owner="gone:1:dead",
                                       lease_seconds=0.1))
    began = time.monotonic()
    # One of each pool: the sweep runs in the worker's main process (a greenlet under gevent).
    workers = [start_worker("-P", pool, "-c", "2") for pool in ("prefork", "threads", "gevent")]
    wait_for(lambda: len(sink.deliveries()) >= 5, timeout=60)
    time.sleep(4)  # more rounds, with every worker ticking
    elapsed = time.monotonic() - began
    assert sorted(sink.attempts()) == sorted(keys)  # each sent once
    assert _claimed(task) == []
    wait_for(lambda: task.ledger.get(LOCK_KEY) is None, timeout=10)  # between sweeps, their lease leaves nothing
    sweeps = sum(w.log().count(b"swept a ledger for stranded claims") for w in workers)
    # One round a second for the three of them; each worker alone ticks every 0.5 to 1 s.
    assert 1 <= sweeps <= elapsed + 1, (sweeps, elapsed)


# Alone, after the rest: kombu's restore takes one mutex per Redis database, and other tests kill workers
# there (one killed mid-restore holds it for up to unacked_mutex_expire); and it keeps pace with seconds.
@pytest.mark.serial
def test_the_restore_timer_hands_a_dead_workers_unacked_message_back_with_no_worker_running(
    app_module: Any, ns: str, sink: Sink, start_worker: Any, worker_env: dict[str, str]
) -> None:
    # What a green-pool worker runs on a timer, run here with no worker at all: nothing else would ever
    # hand the killed worker's message back to the queue.
    from idemmail_celery.redrive import restore_unacked_on_a_timer

    worker_env.update(IDEMMAIL_TEST_VT="2")
    victim = start_worker("-P", "gevent", "-c", "5")
    sink.control("hold_until_released", "1")
    app_module.send_keyed.delay("di@example.com", 84)
    wait_for(lambda: sink.r.llen(sink.k("holding")) >= 1, timeout=60)  # received, running, unacked
    victim.kill()
    queue = f"q.{ns}"
    assert sink.r.llen(queue) == 0
    app = app_module.app
    app.conf.broker_transport_options = {**app.conf.broker_transport_options, "visibility_timeout": 2}
    stop = restore_unacked_on_a_timer(app, 0.5)
    try:
        wait_for(lambda: sink.r.llen(queue) == 1, timeout=60)  # back in the queue, for any worker
    finally:
        stop.set()


@pytest.fixture
def rabbit_app_module(worker_env: dict[str, str], request: pytest.FixtureRequest) -> Any:
    """``app_module`` and its workers on RabbitMQ, with a 1 s lease and no sweep of the workers' own."""
    worker_env.update(IDEMMAIL_TEST_BROKER=RABBITMQ_URL, IDEMMAIL_TEST_LEASE="1",
                      IDEMMAIL_TEST_SWEEP_IN_WORKERS="false")
    return request.getfixturevalue("app_module")


@pytest.mark.parametrize("task_name", ["send", "send_keyed"])
def test_a_claim_re_driven_while_its_holder_is_alive_but_paused_is_still_sent_once(
    rabbit_app_module: Any, sink: Sink, start_worker: Any, task_name: str
) -> None:
    """RabbitMQ keeps a live worker's message unacked for as long as it runs: a holder that stops renewing (here
    SIGSTOPped, as a long pause or a partition from the ledger would leave it) loses its lease, and a sweep
    re-drives its claim. The fencing token only refuses the late holder's record; what keeps the intent from a
    second send is the reclaim rules: a claim taken over from a holder that may have run is parked for review
    (no key downstream) or sent again under its key (the provider de-duplicates), and a holder that writes
    ahead loses its fenced mark first. The paused holder, resumed, sends; nothing is sent twice."""
    app_module = rabbit_app_module
    task = getattr(app_module, task_name)
    start_worker("-P", "prefork", "-c", "2")
    sink.control("hold", "3")
    ar = task.delay("cy@example.com", 95)
    [holder] = wait_for(lambda: sink.pids(), timeout=30)
    os.kill(holder, signal.SIGSTOP)  # alive, holding its claim, renewing nothing
    sink.r.delete(sink.k("ctl.hold"))
    key = task.intent_key("cy@example.com", 95)
    try:
        wait_for(lambda: (r := task.ledger.get(key)) is not None and (r.lease_expires_at or 0) < time.time(),
                 timeout=30)
        assert sweep_stranded(app_module.app, after_seconds=0.5, now=time.time() + 1) == [key]
        # The republished copy takes the claim over on the worker's other child.
        wait_for(lambda: (r := task.ledger.get(key)) is not None and r.reclaims == 1 and r.state is not State.CLAIMED,
                 timeout=30)
    finally:
        os.kill(holder, signal.SIGCONT)
    assert results([ar], timeout=60)[0]["status"] == "sent"  # the holder's own run, resumed, went on
    record = task.ledger.get(key)
    assert record is not None and record.state is State.SENT and record.reclaims == 1
    if task_name == "send":  # no key downstream: the copy parked it, the holder's late send was recorded over that
        assert (record.error or {}).get("reason") == "lease_expired" and len(sink.attempts()) == 1
    else:  # the copy sent under the key, the holder's attempt met the provider's de-duplication
        assert len(sink.attempts()) == 2
    assert len(sink.deliveries()) == 1, sink.deliveries()
