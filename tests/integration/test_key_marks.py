"""Keys on messages, with a real worker on the Redis broker: a caller's header is hashed, and what the
library republishes (a retry) keeps the key its first delivery claimed under."""

from __future__ import annotations

import time
from typing import Any

import pytest

from idemmail_celery.chain import ENQUEUED_HEADER, KEY_HEADER
from idemmail_celery.ledger import State

from .conftest import results


@pytest.mark.parametrize("dated", [True, False], ids=["with-idemmail_enqueued", "bare"])
def test_another_intents_key_published_by_name_is_hashed_and_the_victims_own_send_is_delivered(
    app_module: Any, sink: Any, start_worker: Any, dated: bool
) -> None:
    """Issue 24: a 64-hex key (every Message-ID shows one) sent by name with other content was the ledger key
    as given: the attacker's content went out under the victim's key, and the victim's own send answered
    duplicate. Now it is the publisher's own key, hashed: both are delivered, each under its own key."""
    start_worker("-P", "prefork", "-c", "1")
    send = app_module.send
    victims = send.intent_key("kim@example.com", 21)
    headers = {KEY_HEADER: victims, **({ENQUEUED_HEADER: f"{time.time():.3f}"} if dated else {})}
    forged = results([app_module.app.send_task(send.name, ("eve@example.com", 66), headers=headers)])[0]
    assert forged["status"] == "sent" and forged["key"] == send.key_builder.explicit_key(victims) != victims
    own = results([send.delay("kim@example.com", 21)])[0]
    assert own["status"] == "sent" and own["key"] == victims
    assert sorted(d.split("|")[0] for d in sink.deliveries()) == sorted([victims, forged["key"]])
    record = send.ledger.get(victims)
    assert record is not None and record.state is State.SENT and record.attempts == 1


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
