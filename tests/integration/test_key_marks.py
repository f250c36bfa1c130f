"""Keys on messages, with a real worker on the Redis broker: a caller's header is hashed, and what the
library republishes (a retry) keeps the key its first delivery claimed under."""

from __future__ import annotations

import time
from typing import Any

import pytest

from idemmail_celery._common import ENQUEUED_HEADER, KEY_HEADER
from idemmail_celery.ledger import State

from .conftest import results


@pytest.mark.parametrize("dated", [True, False], ids=["dated", "sent-by-name-undated"])
def test_a_retry_of_a_message_from_before_marks_keeps_its_key(
    app_module: Any, sink: Any, start_worker: Any, dated: bool
) -> None:
    """A message a release before marks enqueued carries its derived key unmarked (with idemmail_enqueued,
    or without it when sent by name). This release publishes its retry: the retry carries the same key,
    marked, where apply_async would otherwise take it for a caller's key and hash it (a second key for
    one intent: sent twice beside another copy)."""
    start_worker("-P", "prefork", "-c", "1")
    send = app_module.send
    key = send.intent_key("kim@example.com", 21)
    sink.push_failure("transient")  # the first attempt fails before sending: released, retried
    headers = {KEY_HEADER: key, **({ENQUEUED_HEADER: f"{time.time():.3f}"} if dated else {})}
    old = app_module.app.send_task(send.name, ("kim@example.com", 21), headers=headers)
    out = results([old])[0]
    assert out["status"] == "sent" and out["key"] == key
    assert [d.split("|")[0] for d in sink.deliveries()] == [key]
    record = send.ledger.get(key)  # both attempts counted on the one record
    assert record is not None and record.state is State.SENT and record.attempts == 2


def test_a_callers_header_shaped_like_a_derived_key_reaches_the_worker_hashed(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    start_worker("-P", "prefork", "-c", "1")
    send = app_module.send
    raw = "ab" * 32
    out = results([send.apply_async(("lee@example.com", 22), headers={KEY_HEADER: raw}),
                   send.apply_async(("lee@example.com", 23), idempotency_key=raw)])
    assert [o["status"] for o in out] == ["sent", "duplicate"]  # one intent: the caller's key, hashed alike
    assert out[0]["key"] == send.key_builder.explicit_key(raw) != raw
    assert send.ledger.get(raw) is None and len(sink.deliveries()) == 1
