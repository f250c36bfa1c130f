"""Tools whose bodies fail, for test_tools_worker.py; queue and ledger prefix from IDEMMAIL_TEST_NS."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from idemmail_celery import AmbiguousSendError, PermanentSendError
from idemmail_celery.tools import idempotent_tool

NS = os.environ.get("IDEMMAIL_TEST_NS", "default")
REDIS_URL = os.environ.get("IDEMMAIL_TEST_REDIS", "redis://127.0.0.1:6379/0")

app = Celery("idemmail_tools_tests", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(task_default_queue=f"q.{NS}", idemmail_ledger_url=REDIS_URL,
                idemmail_ledger_options={"prefix": f"led.{NS}"}, idemmail_key_secret="test-secret")


@idempotent_tool(app, name="toolsapp.bounce")
def bounce(to: str) -> dict[str, Any]:
    """A send the provider refuses for good."""
    raise PermanentSendError("mailbox does not exist", reason="bounced")


@idempotent_tool(app, name="toolsapp.unsure")
def unsure(to: str) -> dict[str, Any]:
    """A send that may have gone out (no key downstream): parked for review."""
    raise AmbiguousSendError("connection dropped after the request was written")


@idempotent_tool(app, name="toolsapp.note")
def note(ticket: str, text: str) -> dict[str, Any]:
    """A side effect the test counts: one list entry per run."""
    import redis

    redis.Redis.from_url(REDIS_URL).rpush(f"notes.{NS}", f"{ticket}:{text}")
    return {"ticket": ticket}
