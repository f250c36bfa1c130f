"""A LangGraph agent whose tools are idempotent: a pending email is asked for again, and goes out once.

A graph of two nodes, as LangGraph's own agents are built: a "model" that asks for tool calls,
and LangGraph's ``ToolNode`` that runs them. The model is scripted (no LLM): it asks for an
email to the customer, and whenever a tool answers ``pending`` it asks for the same call again,
with the same id, as a model shown "calling again is safe" would. The tools are
``email_tool`` and an ``idempotent_tool`` keyed on the tool-call id, turned into LangChain tools
by ``idemmail_celery.contrib.langchain`` (the ``[langchain]`` extra; ``langgraph`` itself is the
application's). The email API (a :class:`~idemmail_celery.testing.FakeProvider` that
de-duplicates nothing) holds the first send for 3 s, so the tool's 1 s wait answers ``pending``
until the worker is done.

Run it from the repository root with Redis on loopback (broker, results and ledger); it
starts a ``celery worker`` itself and ends with ``RESULT: OK`` when the provider received one
email and the CRM one note::

    python -m examples.agent_langgraph

Options: ``--prefix`` for the queue and ledger names. Tested by
``tests/integration/test_examples_agent.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from examples._stack import agent_env, celery_from_env, celery_worker, configure_from_env, crm_note, crm_notes
from idemmail_celery.contrib.langchain import as_langchain_tool
from idemmail_celery.testing import DEFAULT_API_KEY, FakeProvider
from idemmail_celery.tools import email_tool, idempotent_tool

celery = celery_from_env("agent_langgraph", idemmail_default_from="Support <support@example.com>")


@idempotent_tool(celery, key="call_id", timeout=1.0, name="add_note")
def add_note(deal_id: str, text: str) -> dict[str, Any]:
    """Add a note to a CRM deal."""
    return crm_note(deal_id, text)


#: What the scripted model asks for, in order; the same call again while it is pending.
SCRIPT = [
    {"name": "send_email", "id": "call_1", "args": {"to": "Ann <ann@example.com>", "subject": "Ticket T-981 resolved",
                                                     "text": "Payments work again. Sorry for the trouble."}},
    {"name": "add_note", "id": "call_2", "args": {"deal_id": "D-7", "text": "Customer told: fixed."}},
    {"name": "add_note", "id": "call_2", "args": {"deal_id": "D-7", "text": "Customer told: fixed."}},  # a replay
]


def model(state: MessagesState) -> dict[str, list[AIMessage]]:
    """The scripted "model": the next call of SCRIPT, or the last one again if it answered ``pending``."""
    answers = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    if answers and json.loads(str(answers[-1].content))["status"] == "pending":
        last = next(m for m in reversed(state["messages"]) if isinstance(m, AIMessage) and m.tool_calls)
        return {"messages": [AIMessage("", tool_calls=last.tool_calls)]}
    step = len([m for m in answers if json.loads(str(m.content))["status"] != "pending"])  # calls answered
    if step >= len(SCRIPT):
        return {"messages": [AIMessage("All done: the customer is told and the deal has its note.")]}
    return {"messages": [AIMessage("", tool_calls=[SCRIPT[step]])]}


def build_graph() -> Any:
    """The agent: the model node, LangGraph's ToolNode over the idempotent tools, and back."""
    tools = [as_langchain_tool(email_tool(celery, timeout=1.0)), as_langchain_tool(add_note)]
    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", lambda state: "tools" if state["messages"][-1].tool_calls else END)
    graph.add_edge("tools", "model")
    return graph.compile()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix", default=f"lg{uuid.uuid4().hex[:6]}", help="queue and ledger names")
    args = parser.parse_args(argv)
    with FakeProvider(dedupe=False, slow_seconds=3.0) as provider:
        provider.fail_next("slow")  # the first send takes 3 s: longer than the tool waits
        env = agent_env(args.prefix, provider.url, DEFAULT_API_KEY)
        configure_from_env(celery, env)
        log = Path(tempfile.mkdtemp(prefix="agent-langgraph-")) / "worker.log"
        with celery_worker("examples.agent_langgraph:celery", env, log=log, args=("-P", "threads", "-c", "4")):
            messages = build_graph().invoke({"messages": []}, {"recursion_limit": 100})["messages"]
        emails = provider.deliveries()
    notes = crm_notes(args.prefix, "D-7")
    answers = [(m.name, m.tool_call_id, json.loads(str(m.content))["status"]) for m in messages
               if isinstance(m, ToolMessage)]
    for name, call_id, status in answers:
        print(f"{name} {call_id}: {status}")
    print(f"model: {messages[-1].content}")
    print(f"emails delivered: {len(emails)} {[e.subject for e in emails]}")
    print(f"crm notes: {len(notes)}")
    email_statuses = [status for name, _, status in answers if name == "send_email"]
    # On a busy machine the call asked again may claim before the first: then it reports "sent", once.
    ok = (len(emails) == 1 and len(notes) == 1 and email_statuses[0] == "pending"
          and email_statuses[-1] in ("sent", "duplicate") and email_statuses.count("sent") <= 1
          and [status for name, _, status in answers if name == "add_note"] == ["sent", "duplicate"])
    print("RESULT: OK" if ok else "RESULT: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
