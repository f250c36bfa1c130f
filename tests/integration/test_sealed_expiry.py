"""A sealed message expires with the ledger's retention (issue 35, item 5), with a real worker.

A message captured from the broker and published again once its intent's record expired used to be
sent again: its seal is good for ever. Now a new claim for a message enqueued longer ago than the
retention is parked for review; a countdown counts from when the message was due.
"""

from __future__ import annotations

from typing import Any

import pytest

from idemmail_celery import SendNeedsReview
from idemmail_celery.handler import OLDER_THAN_RETENTION
from idemmail_celery.ledger import State

from ..conftest import wait_for
from .conftest import results

RETENTION = 8.0


def test_a_sealed_message_published_again_after_its_record_expired_is_parked_not_sent(
    sink: Any, worker_env: dict[str, str], request: pytest.FixtureRequest, start_worker: Any
) -> None:
    worker_env["IDEMMAIL_TEST_RETENTION"] = str(RETENTION)
    app_module = request.getfixturevalue("app_module")
    start_worker("-P", "prefork", "-c", "2")
    send = app_module.send
    call = ("kim@example.com", 35)
    captured = send.intent_headers(call)  # the sealed headers apply_async puts on the message
    key = captured["idempotency_key"]
    first = results([app_module.app.send_task(send.name, call, headers=dict(captured))])[0]
    assert first["status"] == "sent" and first["key"] == key
    # Due after the retention: counted from when it may run, not from when it was enqueued.
    later = send.apply_async(("lee@example.com", 36), countdown=RETENTION + 2)

    wait_for(lambda: send.ledger.get(key) is None, timeout=RETENTION * 4)  # the record expired
    replay = results([app_module.app.send_task(send.name, call, headers=dict(captured))])[0]
    assert isinstance(replay, SendNeedsReview) and replay.reason == OLDER_THAN_RETENTION, replay
    assert [d.split("|")[0] for d in sink.deliveries()].count(key) == 1  # not sent again
    record = send.ledger.get(key)
    assert record is not None and record.state is State.REVIEW and record.payload  # a person may release it

    out = results([later], timeout=60)[0]
    assert out["status"] == "sent", out
    assert len(sink.deliveries()) == 2
