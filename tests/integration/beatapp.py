"""The Celery app real beat processes and their worker run in tests/integration/test_beat.py.

Configured by environment variables, like ``workerapp.py``:

``IDEMMAIL_TEST_NS``           this test's namespace: queue, sink keys, ledger prefix
``IDEMMAIL_TEST_PROVIDER``     the fake provider's URL (``send_email`` sends there)
``IDEMMAIL_TEST_BEAT_ID``      which beat process this is ("A", "B"): sent along as an argument
``IDEMMAIL_TEST_BEAT_PERIOD``  the digest entry's ``aligned`` period in seconds (3)
``IDEMMAIL_TEST_BEAT_ENTRIES`` ``digest`` (default) or ``relay``: which beat entry this run schedules
``IDEMMAIL_TEST_OUTBOX_URL``   the outbox database, for the relay task (and ``..._TABLE``, its table)

Every run of the fan-out task is recorded in the Redis list ``sink.<ns>.runs``
(which beat sent it, the slot header, the slot, when it ran), so the test can
tell a late tick from a punctual one. Deliveries are counted at the fake provider.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from idemmail_celery import send_campaign, send_email  # noqa: F401  # registers both on this app
from idemmail_celery.beat import SLOT_HEADER, aligned, send_digest, slot_of
from idemmail_celery.outbox import RELAY_TASK, register_relay
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY

NS = os.environ.get("IDEMMAIL_TEST_NS", "default")
BROKER = os.environ.get("IDEMMAIL_TEST_BROKER", "redis://127.0.0.1:6379/0")
REDIS_URL = os.environ.get("IDEMMAIL_TEST_REDIS", "redis://127.0.0.1:6379/0")
BEAT_ID = os.environ.get("IDEMMAIL_TEST_BEAT_ID", "")
PERIOD = float(os.environ.get("IDEMMAIL_TEST_BEAT_PERIOD", "3"))
TIMEZONE = "Europe/Paris"  # not UTC, so the test sees the slot written in the app's timezone
RECIPIENTS = [f"{name}.{NS}@example.com" for name in ("ann", "bob", "cat")]
FANOUT = "beatapp.digest_fanout"
ENTRIES = {
    "digest": {
        "task": FANOUT,
        "schedule": aligned(seconds=PERIOD),
        "kwargs": {"beat": BEAT_ID},
        "options": {"expires": 60},
    },
    # The outbox relay every half second: runs overlap on the worker's four processes.
    "relay": {"task": RELAY_TASK, "schedule": 0.5, "options": {"expires": 5}},
}

app = Celery("idemmail_beat_tests", broker=BROKER, backend=REDIS_URL)
app.conf.update(
    task_default_queue=f"q.{NS}",
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    timezone=TIMEZONE,
    enable_utc=True,
    beat_max_loop_interval=1,  # a resumed (SIGCONT) beat looks at its schedule within a second
    beat_schedule={name: ENTRIES[name] for name in os.environ.get("IDEMMAIL_TEST_BEAT_ENTRIES", "digest").split(",")},
    idemmail_outbox_url=os.environ.get("IDEMMAIL_TEST_OUTBOX_URL") or None,
    idemmail_outbox_table=os.environ.get("IDEMMAIL_TEST_OUTBOX_TABLE") or None,
    idemmail_outbox_batch_size=10,
    idemmail_ledger_url=REDIS_URL,
    idemmail_ledger_options={"prefix": f"led.{NS}"},
    idemmail_key_secret="test-secret",
    idemmail_lease_seconds=30,
    idemmail_inflight_backoff=0.2,
    idemmail_inflight_backoff_max=1.0,
    idemmail_retry_backoff=0.1,
    idemmail_retry_backoff_max=0.5,
    idemmail_provider_url=os.environ.get("IDEMMAIL_TEST_PROVIDER") or None,
    idemmail_provider_api_key=DEFAULT_API_KEY,
    idemmail_provider_timeout=5.0,
    idemmail_default_from="Digests <digest@example.com>",
)

r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
register_relay(app)


def _body(recipient: str, slot: str) -> dict[str, Any]:
    return {"text": f"Hello {recipient}, here is what happened up to {slot}."}


@app.task(shared=False, bind=True, name=FANOUT)
def digest_fanout(self: Any, beat: str = "", slot: str | None = None) -> dict[str, Any]:
    """The digest fan-out: one email per recipient for the slot beat says this run is for."""
    the_slot = slot_of(self.request, "second", slot=slot)
    header = getattr(self.request, SLOT_HEADER, None)
    r.rpush(f"sink.{NS}.runs", json.dumps({"beat": beat, "header": header, "slot": the_slot, "at": time.time()}))
    return send_digest(app, slot=the_slot, recipients=RECIPIENTS, subject=lambda to, s: f"Digest {s}",
                       build_body=_body, template="digest")
