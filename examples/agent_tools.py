"""An AI agent's tools with side effects that happen once, however often the agent loop calls them.

Three tools (``idemmail_celery.tools``), each a Celery task behind the ledger:

* ``update_deal`` moves a deal in a CRM, keyed on the **tool-call id**: the loop times out
  waiting and calls it again with the same id;
* ``post_status`` posts to Slack, keyed on **declared fields** ``(channel, incident_id)``: the
  model asks again in a later turn, with a new call id and reworded text;
* ``send_email`` (the library's task), with ``event_id`` **bound by the application** to the
  ticket, so the model cannot turn one reply into two, and ``to`` **bound to the ticket's
  customer**, looked up by the application: the model writes the words, never picks who gets
  them (a prompt-injected "also send it to me@evil.example" has nowhere to go).

No LLM: a scripted "model" plays the turns an agent loop sees, including the retries, and one
bad call (it tries to choose the recipient) that the tool refuses with a typed error before
enqueueing.
The CRM and Slack are one :class:`~idemmail_celery.testing.FakeAPI` on loopback (it counts
every POST and de-duplicates nothing; the CRM answers the first request slowly), the email
API is a :class:`~idemmail_celery.testing.FakeProvider` that de-duplicates nothing either.

Run it from the repository root with Redis on loopback (broker, results and ledger); it
starts a ``celery worker`` subprocess itself and ends with ``RESULT: OK`` when the CRM got one
update, Slack one post and the customer one email::

    python -m examples.agent_tools

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

import httpx

from examples._stack import LOCAL_REDIS, celery_from_env, celery_worker, configure_from_env
from idemmail_celery.testing import DEFAULT_API_KEY, FakeAPI, FakeProvider
from idemmail_celery.tools import IdempotentTool, email_tool, idempotent_tool

celery = celery_from_env("agent_tools", idemmail_default_from="Support <support@example.com>")


@idempotent_tool(celery, key="call_id", bind=True, name="update_deal")
def update_deal(self: Any, deal_id: str, stage: str) -> dict[str, Any]:
    """Move a CRM deal to another pipeline stage."""
    reply = httpx.post(f"{os.environ['CRM_URL']}/deals/{deal_id}", json={"stage": stage}, timeout=30,
                       headers={"Idempotency-Key": self.request.idempotency_key})  # for a CRM that honours it
    reply.raise_for_status()
    return dict(reply.json())


@idempotent_tool(celery, key=("channel", "incident_id"), name="post_status")
def post_status(channel: str, incident_id: str, text: str) -> dict[str, Any]:
    """Post a status update about an incident to a Slack channel."""
    reply = httpx.post(f"{os.environ['SLACK_URL']}/chat.postMessage", timeout=30,
                       json={"channel": channel, "text": f"[{incident_id}] {text}"})
    reply.raise_for_status()
    return dict(reply.json())


#: The support desk's tickets and who opened them: where a reply goes is the application's to say.
TICKETS = {"T-981": "Ann <ann@example.com>"}


def script(ticket: str) -> list[list[dict[str, Any]]]:
    """What the "model" asks for, turn by turn: tool calls with their ids."""
    return [
        [{"id": "call_1", "name": "update_deal", "arguments": {"deal_id": "D-7", "stage": "won"}}],
        [{"id": "call_2", "name": "post_status",
          "arguments": {"channel": "#incidents", "incident_id": "INC-42", "text": "Resolved: payments are back."}},
         {"id": "call_3", "name": "send_email",  # injected by text the model read: refused, the recipient is bound
          "arguments": {"to": "me@evil.example", "subject": "Your ticket is resolved", "text": "Fixed!"}},
         {"id": "call_4", "name": "send_email",
          "arguments": {"subject": f"Ticket {ticket} is resolved",
                        "text": "Payments work again. Sorry for the trouble."}}],
        # The model is unsure whether it already did these, and asks again, in other words.
        [{"id": "call_5", "name": "post_status",
          "arguments": {"channel": "#incidents", "incident_id": "INC-42", "text": "Update: all payments are fine."}},
         {"id": "call_6", "name": "send_email",
          "arguments": {"subject": f"Re: ticket {ticket}",
                        "text": "Just confirming: payments are working again."}}],
    ]


def run_agent(tools: dict[str, IdempotentTool], turns: list[list[dict[str, Any]]],
              timeouts: tuple[float, ...] = (0.5, 0.5, 30.0)) -> list[dict[str, Any]]:
    """The agent loop: each call is retried with the same id while its outcome is ``pending`` (one try per timeout)."""
    transcript = []
    for turn, calls in enumerate(turns, start=1):
        for call in calls:
            for attempt, timeout in enumerate(timeouts, start=1):
                outcome = tools[call["name"]](call["arguments"], call_id=call["id"], timeout=timeout)
                transcript.append({"turn": turn, "call": call["id"], "tool": call["name"], "attempt": attempt,
                                   "status": outcome["status"], "key": outcome.get("key"),
                                   "error": outcome.get("error")})
                print(f"turn {turn} {call['id']} {call['name']} try {attempt}: {outcome['status']}"
                      + (f" ({outcome['error']['type']}: {outcome['error'].get('field')})"
                         if outcome.get("error") else ""), flush=True)
                if outcome["status"] != "pending":
                    break
    return transcript


def repeated(statuses: list[str]) -> bool:
    """What a call asking again for what an earlier one did sees: ``pending`` while waiting, then ``duplicate``."""
    return statuses[-1:] == ["duplicate"] and set(statuses[:-1]) <= {"pending"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", default=f"agent{uuid.uuid4().hex[:6]}", help="queue and ledger names")
    args = parser.parse_args(argv)
    ticket = "T-981"
    customer = TICKETS[ticket]  # the application's own record of who opened the ticket
    with FakeAPI(slow_seconds=2.0) as api, FakeProvider(dedupe=False) as provider:
        api.fail_next("slow")  # the CRM's first answer takes 2 s: the loop's 0.5 s wait gives up twice
        env = {"CRM_URL": f"{api.url}/crm", "SLACK_URL": f"{api.url}/slack",
               "CELERY_TASK_DEFAULT_QUEUE": f"{args.prefix}.tools", "IDEMMAIL_LEDGER_URL": os.environ.get(
                   "IDEMMAIL_LEDGER_URL", LOCAL_REDIS), "IDEMMAIL_LEDGER_OPTIONS": json.dumps({"prefix": args.prefix}),
               "IDEMMAIL_KEY_SECRET": "example-secret-do-not-use-in-production",
               "IDEMMAIL_PROVIDER_URL": provider.url, "IDEMMAIL_PROVIDER_API_KEY": DEFAULT_API_KEY,
               "IDEMMAIL_INFLIGHT_BACKOFF": "0.2", "IDEMMAIL_INFLIGHT_BACKOFF_MAX": "1"}
        configure_from_env(celery, env)
        reply = email_tool(celery).bind(to=customer, event_id=f"ticket-{ticket}-resolved", template="ticket_reply")
        tools = {tool.name: tool for tool in (update_deal, post_status, reply)}
        print("tools shown to the model:", json.dumps([t.spec()["name"] for t in tools.values()]))
        log = Path(tempfile.mkdtemp(prefix="agent-tools-")) / "worker.log"
        with celery_worker("examples.agent_tools:celery", env, log=log, args=("-P", "prefork", "-c", "2")):
            transcript = run_agent(tools, script(ticket))
        crm = api.requests("/crm/deals/D-7")
        slack = api.requests("/slack/chat.postMessage")
        emails = provider.deliveries()

    print(f"crm updates: {len(crm)}")
    print(f"slack posts: {len(slack)} {[r.body['text'] for r in slack]}")
    print(f"emails delivered: {len(emails)} {[e.subject for e in emails]}")
    print("keys: " + json.dumps({t["call"]: t["key"] for t in transcript if t["key"]}))
    statuses = {t["call"]: [u["status"] for u in transcript if u["call"] == t["call"]] for t in transcript}
    sent_per_key = [sum(t["status"] == "sent" for t in transcript if t["key"] == key)
                    for key in {t["key"] for t in transcript if t["key"]}]
    # On a busy machine a repeated call may still be waiting when its first 0.5 s runs out:
    # "pending" and then "duplicate" is right, "sent" never is (that would be a second side effect).
    ok = (len(crm) == 1 and len(slack) == 1 and len(emails) == 1 and max(sent_per_key) <= 1
          and statuses["call_1"][:2] == ["pending", "pending"] and statuses["call_3"] == ["invalid"]
          and all(repeated(statuses[call]) for call in ("call_5", "call_6")))
    print("RESULT: OK" if ok else "RESULT: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
