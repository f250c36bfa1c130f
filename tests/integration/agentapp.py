"""An app with agent tools, for test_agent_adapters.py: the worker runs it, the MCP server (``celery -A ...
idemmail mcp``) and the LangChain tools call it. Queue, ledger prefix and sink from IDEMMAIL_TEST_NS; the
email API from IDEMMAIL_TEST_PROVIDER (a FakeProvider on loopback)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import redis
from celery import Celery

from idemmail_celery.testing import DEFAULT_API_KEY
from idemmail_celery.tools import IdempotentTool, email_tool, idempotent_tool

NS = os.environ.get("IDEMMAIL_TEST_NS", "default")
REDIS_URL = os.environ.get("IDEMMAIL_TEST_REDIS", "redis://127.0.0.1:6379/0")

app = Celery("idemmail_agent_tests", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(task_default_queue=f"q.{NS}", idemmail_ledger_url=REDIS_URL,
                idemmail_ledger_options={"prefix": f"led.{NS}"}, idemmail_key_secret="test-secret",
                idemmail_provider_url=os.environ.get("IDEMMAIL_TEST_PROVIDER", "console://"),
                idemmail_provider_api_key=DEFAULT_API_KEY, idemmail_default_from="Support <support@example.com>",
                idemmail_inflight_backoff=0.2, idemmail_inflight_backoff_max=1.0)


@idempotent_tool(app, key="call_id", name="crm.add_note")
def add_note(deal_id: str, text: str) -> dict[str, Any]:
    """Add a note to a CRM deal."""
    notes = redis.Redis.from_url(REDIS_URL).rpush(f"sink.{NS}.notes", f"{deal_id}: {text}")
    return {"note": int(notes)}


def quick(app: Celery) -> list[IdempotentTool]:
    """The same tools with a 1 s wait, for ``--tools``: a slow send answers ``pending`` first."""
    return [dataclasses.replace(tool, timeout=1.0) for tool in (email_tool(app), add_note)]
