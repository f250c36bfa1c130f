"""No message storm from the library's own countdowns, on a real Redis broker with a short visibility timeout.

The Redis transport hands a message out again once a worker has held it, unacknowledged, for
``visibility_timeout`` seconds: a message waiting in a worker for a countdown longer than that
is redelivered while still held, and both copies then run. A copy that reschedules itself
with such a countdown (waiting for another holder's claim) would double every round. Every
countdown the library sets stays below the visibility timeout, so each waiting copy stays one
chain: it runs, and succeeds, once.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from typing import Any

import pytest

from ..conftest import wait_for
from .conftest import results


@pytest.fixture
def short_vt_app(worker_env: dict[str, str], request: pytest.FixtureRequest) -> Any:
    # The library's own in-flight backoff (1 s doubling to 60 s), a 2 s visibility timeout.
    worker_env.update(IDEMMAIL_TEST_VT="2", IDEMMAIL_TEST_DEFAULT_BACKOFF="1")
    return request.getfixturevalue("app_module")


def test_copies_waiting_on_a_live_claim_never_multiply(short_vt_app: Any, sink: Any, start_worker: Any) -> None:
    worker = start_worker("-P", "prefork", "-c", "3")
    app = short_vt_app
    sink.r.set(sink.k("ctl.hold_until_released"), "1")
    holder = app.send_keyed.delay("ann@example.com", 77)
    wait_for(lambda: sink.r.llen(sink.k("holding")) == 1, timeout=30)
    copies = [app.send_keyed.delay("ann@example.com", 77) for _ in range(2)]
    # Long enough for the old backoff (1, 2, 4 s) to pass the 2 s visibility timeout, and its copies to run.
    time.sleep(10)
    sink.r.set(sink.k("ctl.release"), "1")
    outcomes = results([holder, *copies], timeout=60)
    assert [o["status"] for o in outcomes] == ["sent", "duplicate", "duplicate"]
    time.sleep(4)  # any stray copy would run by now
    log = worker.log().decode()
    succeeded = Counter(re.findall(r"Task \S+\[([0-9a-f-]+)\] succeeded", log))
    received = Counter(re.findall(r"Task \S+\[([0-9a-f-]+)\] received", log))
    for c in copies:
        assert succeeded[c.id] == 1, (c.id, succeeded[c.id], received[c.id])
        # A hop every 0.5-1 s (half the visibility timeout, jittered) for ~18 s: one chain, not a doubling one.
        assert received[c.id] <= 40, received[c.id]
    assert len(sink.deliveries()) == 1
