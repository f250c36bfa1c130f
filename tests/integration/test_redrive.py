"""Issue 23, case 5: the ledger re-drives what the broker forgets, and green pools get the broker's copies back."""

from __future__ import annotations

import time
from typing import Any

import pytest

from idemmail_celery.keys import Payload
from idemmail_celery.ledger import ClaimRequest, State
from idemmail_celery.redrive import sweep_stranded

from ..conftest import wait_for
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


# Alone, after the rest: kombu's restore takes one mutex per Redis database, and other tests kill workers
# there (one killed mid-restore holds it for up to unacked_mutex_expire); and it keeps pace with seconds.
@pytest.mark.serial
def test_a_gevent_worker_gets_back_a_killed_workers_unacked_message_on_a_redis_broker(
    app_module: Any, sink: Sink, start_worker: Any, worker_env: dict[str, str]
) -> None:
    # celery/celery#4968, #4976: kombu's restore of unacked messages runs from the event loop, which green
    # pools do not use. Before: the message stayed in the broker's unacked set while gevent workers ran.
    worker_env.update(IDEMMAIL_TEST_VT="3", IDEMMAIL_TEST_LEASE="3")
    first = start_worker("-P", "gevent", "-c", "5")
    sink.control("hold_until_released", "1")
    ar = app_module.send_keyed.delay("cy@example.com", 83)
    wait_for(lambda: sink.r.llen(sink.k("holding")) >= 1, timeout=60)  # received, running, unacked
    first.kill()
    second = start_worker("-P", "gevent", "-c", "5")
    assert results([ar], timeout=120)[0]["status"] == "sent"
    assert len(sink.deliveries()) == 1
    assert b"restores the Redis broker's unacked messages" in second.log()


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
