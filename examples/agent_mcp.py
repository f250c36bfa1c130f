"""An agent loop calling the email tool over MCP: its call times out, it calls again, the customer gets one email.

The app's tools are served by ``celery -A examples.agent_mcp idemmail mcp`` (stdio; the
``[mcp]`` extra): ``send_email`` (``email_tool``), ``crm.add_note`` (an ``idempotent_tool`` keyed
on the tool-call id) and the read-only ``intent_state``. The "agent" is a scripted loop with
no model, on the official SDK's client: it lists the tools, then asks for one email. The
email API (a :class:`~idemmail_celery.testing.FakeProvider` that de-duplicates nothing) holds
that first send for 3 s, so the loop's 1 s wait runs out, twice; the third try, with a longer
wait, reads ``duplicate``: the first try's send went out, once. Then it asks the
``intent_state`` tool where that intent stands, and adds a note twice under one tool-call id.

Run it from the repository root with Redis on loopback (broker, results and ledger); it
starts a ``celery worker`` itself and ends with ``RESULT: OK`` when the provider received one
email and the CRM one note::

    python -m examples.agent_mcp

Options: ``--prefix`` for the queue and ledger names. Tested by
``tests/integration/test_examples_agent.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import anyio
from mcp import Client, MCPError, StdioServerParameters

from examples._stack import ROOT, agent_env, celery_from_env, celery_worker, crm_note, crm_notes
from idemmail_celery.contrib.mcp import CALL_ID_META
from idemmail_celery.testing import DEFAULT_API_KEY, FakeProvider
from idemmail_celery.tools import idempotent_tool

celery = celery_from_env("agent_mcp", idemmail_default_from="Support <support@example.com>")


@idempotent_tool(celery, key="call_id", name="crm.add_note")
def add_note(deal_id: str, text: str) -> dict[str, Any]:
    """Add a note to a CRM deal."""
    return crm_note(deal_id, text)


async def agent(server: StdioServerParameters) -> list[dict[str, Any]]:
    """The scripted agent: what a model would ask for, with the retries a loop makes. Returns what it saw."""
    seen: list[dict[str, Any]] = []
    async with Client(server, read_timeout_seconds=60) as client:
        print("tools:", json.dumps([tool.name for tool in (await client.list_tools()).tools]))
        email = {"to": "Ann <ann@example.com>", "subject": "Your ticket T-981 is resolved",
                 "text": "Payments work again. Sorry for the trouble."}
        for attempt, wait in enumerate((1.0, 1.0, 30.0), start=1):
            try:
                result = await client.call_tool("send_email", email, read_timeout_seconds=wait)
            except MCPError as exc:  # the client stopped waiting; the server and the worker did not
                print(f"send_email try {attempt}: timed out after {wait:g} s ({exc.message})")
                seen.append({"tool": "send_email", "status": "timed out"})
                continue
            outcome = result.structured_content
            print(f"send_email try {attempt}: {outcome['status']}")
            seen.append({"tool": "send_email", **outcome})
            if outcome["status"] != "pending":
                break
        state = (await client.call_tool("intent_state", {"key": seen[-1]["key"]})).structured_content
        print(f"intent_state: {state['state']}")
        seen.append({"tool": "intent_state", **state})
        for attempt in (1, 2):  # the same tool call (one id) sent twice: the loop lost the first answer
            note = await client.call_tool("crm.add_note", {"deal_id": "D-7", "text": "Customer told: fixed."},
                                              meta={CALL_ID_META: "toolu_01"})
            print(f"add_note try {attempt}: {note.structured_content['status']}")
            seen.append({"tool": "add_note", **note.structured_content})
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", default=f"mcp{uuid.uuid4().hex[:6]}", help="queue and ledger names")
    args = parser.parse_args(argv)
    with FakeProvider(dedupe=False, slow_seconds=3.0) as provider:
        provider.fail_next("slow")  # the first send takes 3 s: longer than the agent waits
        env = agent_env(args.prefix, provider.url, DEFAULT_API_KEY)
        server = StdioServerParameters(
            command=sys.executable, args=["-m", "celery", "-A", "examples.agent_mcp", "idemmail", "mcp"],
            env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=str(ROOT))
        log = Path(tempfile.mkdtemp(prefix="agent-mcp-")) / "worker.log"
        with celery_worker("examples.agent_mcp:celery", env, log=log, args=("-P", "threads", "-c", "4")):
            seen = anyio.run(agent, server)
        emails = provider.deliveries()
    notes = crm_notes(args.prefix, "D-7")
    print(f"emails delivered: {len(emails)} {[e.subject for e in emails]}")
    print(f"crm notes: {len(notes)}")
    sends = [s["status"] for s in seen if s["tool"] == "send_email"]
    state = next(s for s in seen if s["tool"] == "intent_state")
    ok = (len(emails) == 1 and len(notes) == 1 and sends[0] == "timed out" and sends[-1] in ("sent", "duplicate")
          and sends.count("sent") <= 1 and state["state"] == "sent"
          and [s["status"] for s in seen if s["tool"] == "add_note"] == ["sent", "duplicate"])
    print("RESULT: OK" if ok else "RESULT: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
