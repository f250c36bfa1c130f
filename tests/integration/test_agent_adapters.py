"""Agent tools through their adapters against one real worker (Redis broker, results and ledger) and a
FakeProvider that counts deliveries: the MCP server started from the CLI, driven by the SDK's own client
over stdio and over streamable HTTP, and the LangChain tools through LangGraph's ``ToolNode``.

The module shares one worker, one provider and one HTTP server; each test has calls of its own.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import current_app

from examples._stack import celery_worker
from idemmail_celery.testing import FakeProvider

from ..conftest import REDIS_URL, free_port, require_module, service_missing, unique, wait_for
from .conftest import ROOT, stop_group

anyio = require_module("anyio")
mcp = require_module("mcp")
contrib_mcp = require_module("idemmail_celery.contrib.mcp")


@dataclass
class Stack:
    ns: str
    env: dict[str, str]
    provider: FakeProvider
    r: redis.Redis
    log: Path
    app: Any  # tests.integration.agentapp, imported in this process with the same settings
    http_url: str

    def received(self) -> int:
        """Task messages the worker has received so far (its log says each)."""
        return self.log.read_bytes().count(b"] received")

    def notes(self) -> list[str]:
        return [n.decode() for n in self.r.lrange(f"sink.{self.ns}.notes", 0, -1)]


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "tests.integration.agentapp", "idemmail", "mcp", *args]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    r = redis.Redis.from_url(REDIS_URL)
    try:
        r.ping()
    except redis.ConnectionError as exc:
        service_missing("redis", exc)
    ns = unique("agent").replace("_", "")
    tmp = tmp_path_factory.mktemp("agents")
    previous = current_app._get_current_object()
    with FakeProvider(dedupe=False, slow_seconds=3.0) as provider, pytest.MonkeyPatch.context() as mp:
        env = {**os.environ, "IDEMMAIL_TEST_NS": ns, "IDEMMAIL_TEST_PROVIDER": provider.url,
               "PYTHONPATH": str(ROOT)}
        for name in ("IDEMMAIL_TEST_NS", "IDEMMAIL_TEST_PROVIDER"):
            mp.setenv(name, env[name])
        sys.modules.pop("tests.integration.agentapp", None)
        module = importlib.import_module("tests.integration.agentapp")
        port = free_port()
        with open(tmp / "mcp-http.log", "wb") as out:
            http = subprocess.Popen(serve_command("--http", "--port", str(port), "--tools",
                                                  "tests.integration.agentapp:quick"),
                                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with celery_worker("tests.integration.agentapp:app", env, log=tmp / "worker.log",
                               args=("-P", "threads", "-c", "4")):
                wait_for(lambda: http.poll() is not None or _accepts(port), timeout=60)
                assert http.poll() is None, (tmp / "mcp-http.log").read_text()
                yield Stack(ns, env, provider, r, tmp / "worker.log", module, f"http://127.0.0.1:{port}/mcp")
        finally:
            stop_group(http)
            sys.modules.pop("tests.integration.agentapp", None)
            previous.set_current()
            r.delete(f"q.{ns}", f"_kombu.binding.q.{ns}")


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def email(subject: str) -> dict[str, Any]:
    return {"to": "Ann <ann@example.com>", "subject": subject, "text": "Payments work again."}


def test_mcp_over_stdio_lists_each_spec_sends_a_repeated_call_once_and_refuses_an_unoffered_argument(
        stack: Stack) -> None:
    subject = f"Resolved {uuid.uuid4().hex[:8]}"
    params = mcp.StdioServerParameters(command=sys.executable, args=serve_command()[1:], env=stack.env, cwd=str(ROOT))

    async def main() -> tuple[Any, list[Any], int]:
        async with mcp.Client(params, read_timeout_seconds=60) as client:
            listed = (await client.list_tools()).tools
            calls = [await client.call_tool("send_email", email(subject)) for _ in range(2)]
            received = stack.received()
            calls.append(await client.call_tool("send_email", {**email(subject + " again"),
                                                               "bcc": "attacker@evil.example"}))
            calls.append(await client.call_tool("crm.add_note", {"deal_id": "D-7", "text": "won"},
                                                meta={contrib_mcp.CALL_ID_META: f"toolu_{stack.ns}"}))
            return listed, calls, received

    listed, calls, received_before = anyio.run(main)
    from idemmail_celery.tools import IntentStateTool, app_tools

    served = app_tools(stack.app.app)
    assert [(t.name, t.description, t.input_schema) for t in listed] == [
        (s["name"], s["description"], s["input_schema"]) for s in [
            *(t.spec() for t in served), IntentStateTool(served).spec()]]
    sent, again, refused, note = (c.structured_content for c in calls)
    assert (sent["status"], again["status"]) == ("sent", "duplicate") and sent["key"] == again["key"]
    assert again["message_id"] == sent["message_id"]
    assert refused["status"] == "invalid" and refused["error"]["field"] == "bcc" and calls[2].is_error
    assert note["status"] == "sent"
    # Nothing enqueued for the refused call: the worker received only the note after it, the provider saw one send.
    wait_for(lambda: stack.received() >= received_before + 1)
    assert stack.received() == received_before + 1
    assert [d.subject for d in stack.provider.deliveries()].count(subject) == 1
    assert not any(d.subject == subject + " again" for d in stack.provider.deliveries())


def quick_client(stack: Stack, transport: str) -> Any:
    """An MCP client of the tools that wait 1 s (``agentapp.quick``): the module's HTTP server, or a stdio
    server of its own started from the CLI."""
    if transport == "http":
        return mcp.Client(stack.http_url, read_timeout_seconds=60)
    params = mcp.StdioServerParameters(command=sys.executable, env=stack.env, cwd=str(ROOT),
                                       args=serve_command("--tools", "tests.integration.agentapp:quick")[1:])
    return mcp.Client(params, read_timeout_seconds=60)


@pytest.mark.parametrize("transport", ["http", "stdio"])
def test_mcp_a_call_outliving_its_wait_is_pending_and_asking_again_later_gives_the_result(
        stack: Stack, transport: str) -> None:
    subject = f"Slow {uuid.uuid4().hex[:8]}"
    call_id = f"toolu_{uuid.uuid4().hex[:8]}"
    stack.provider.fail_next("slow")  # held 3 s; the served tools wait 1 s

    async def main() -> list[dict[str, Any]]:
        outcomes = []
        async with quick_client(stack, transport) as client:
            meta = {contrib_mcp.CALL_ID_META: call_id}
            outcomes.append((await client.call_tool("send_email", email(subject), meta=meta)).structured_content)
            for _ in range(60):  # the agent asks again (a bounded loop; each try waits 1 s)
                outcome = (await client.call_tool("send_email", email(subject), meta=meta)).structured_content
                outcomes.append(outcome)
                if outcome["status"] != "pending":
                    break
            state = await client.call_tool("intent_state", {"key": outcomes[0]["key"]})
            outcomes.append(state.structured_content)
            note = {"deal_id": "D-8", "text": f"call me ({transport})"}
            outcomes += [(await client.call_tool("crm.add_note", note, meta=meta)).structured_content for _ in range(2)]
        return outcomes

    first, *again, state, note, note_again = anyio.run(main)
    assert first["status"] == "pending" and first["key"]
    assert again[-1]["status"] == "duplicate" and {o["status"] for o in again[:-1]} <= {"pending"}, again
    assert again[-1]["key"] == first["key"] and again[-1]["message_id"]
    assert state == {**state, "key": first["key"], "state": "sent", "message_id": again[-1]["message_id"]}
    assert [d.subject for d in stack.provider.deliveries()].count(subject) == 1
    assert (note["status"], note_again["status"]) == ("sent", "duplicate")
    assert stack.notes().count(f"D-8: call me ({transport})") == 1


def test_mcp_over_http_refuses_an_unoffered_argument_and_enqueues_nothing(stack: Stack) -> None:
    subject = f"Bcc {uuid.uuid4().hex[:8]}"
    received_before = stack.received()

    async def main() -> list[Any]:
        async with quick_client(stack, "http") as client:
            refused = await client.call_tool("send_email", {**email(subject), "bcc": "attacker@evil.example"})
            note = await client.call_tool("crm.add_note", {"deal_id": "D-9", "text": "after"},
                                          meta={contrib_mcp.CALL_ID_META: f"toolu_{uuid.uuid4().hex[:8]}"})
            return [refused, note]

    refused, note = anyio.run(main)
    assert refused.is_error and refused.structured_content["status"] == "invalid"
    assert refused.structured_content["error"]["field"] == "bcc" and note.structured_content["status"] == "sent"
    # The worker received the note only: the refused call was never enqueued, and the provider never saw it.
    wait_for(lambda: stack.received() >= received_before + 1)
    assert stack.received() == received_before + 1
    assert not any(d.subject == subject for d in stack.provider.deliveries())


def test_langgraph_toolnode_runs_a_repeated_tool_call_once_and_refuses_an_unoffered_argument(stack: Stack) -> None:
    from langchain_core.messages import AIMessage
    from langgraph.graph import END, START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode

    from idemmail_celery.contrib.langchain import as_langchain_tool

    tools = [as_langchain_tool(t) for t in stack.app.quick(stack.app.app)]
    graph = StateGraph(MessagesState)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    agent = graph.compile()
    subject = f"Graph {uuid.uuid4().hex[:8]}"

    def run(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
        ask = AIMessage("", tool_calls=[{"name": name, "args": args, "id": call_id}])
        answer = agent.invoke({"messages": [ask]})["messages"][-1]
        assert answer.tool_call_id == call_id
        outcome = dict(json.loads(answer.content))
        assert answer.status == ("error" if outcome["status"] in ("invalid", "failed", "error") else "success")
        return outcome

    before = stack.received()
    refused = run("crm.add_note", {"deal_id": "D-9", "text": "x", "owner": "bob"}, "call_0")
    assert refused["status"] == "invalid" and refused["error"]["field"] == "owner"
    notes = [run("crm.add_note", {"deal_id": "D-9", "text": "signed"}, "call_1") for _ in range(2)]
    assert [o["status"] for o in notes] == ["sent", "duplicate"] and stack.notes().count("D-9: signed") == 1
    wait_for(lambda: stack.received() >= before + 2)
    assert stack.received() == before + 2  # the two note calls; the refused one enqueued nothing
    outcome = tools[0].invoke(email(subject))  # a bare invoke: the outcome dict itself
    again = tools[0].invoke(email(subject))
    assert (outcome["status"], again["status"]) == ("sent", "duplicate") and outcome["key"] == again["key"]
    assert [d.subject for d in stack.provider.deliveries()].count(subject) == 1
