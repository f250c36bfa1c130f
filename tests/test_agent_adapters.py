"""The MCP server and the LangChain tools without a worker: what they list, what they refuse, where call ids go.

Driven through the MCP SDK's own client (in process) and LangGraph's ``ToolNode``. Sends through a real
worker, over stdio and HTTP: tests/integration/test_agent_adapters.py.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from celery import Celery, current_app
from click.testing import CliRunner

from idemmail_celery import ConfigurationError
from idemmail_celery._version import __version__
from idemmail_celery.cli import standalone
from idemmail_celery.tools import IdempotentTool, IntentStateTool, app_tools, email_tool, idempotent_tool

from . import test_tools
from .conftest import require_module, unique

anyio = require_module("anyio")
mcp = require_module("mcp")
contrib_mcp = require_module("idemmail_celery.contrib.mcp")
contrib_langchain = require_module("idemmail_celery.contrib.langchain")

T = TypeVar("T")

app, published = test_tools.app, test_tools.published  # the fixtures: an app on an in-memory broker, publishes seen


def run(main: Callable[[], Awaitable[T]]) -> T:
    return anyio.run(main)  # type: ignore[no-any-return]


def deal_tools(app: Celery) -> tuple[IdempotentTool, IdempotentTool]:
    @idempotent_tool(app, key="call_id")
    def update_deal(deal_id: str, stage: str) -> None: ...

    @idempotent_tool(app, key=("channel", "incident_id"), name="ops.post_status")
    def post_status(channel: str, incident_id: str, text: str) -> dict[str, Any]: ...

    return update_deal, post_status


#: The protocol's two eras: "auto" settles on the newest (per-request, 2026-07-28), "legacy" is the
#: initialize handshake older clients use (2025-11-25).
ERAS = pytest.mark.parametrize("mode", ["auto", "legacy"])


@ERAS
def test_mcp_lists_every_tool_of_the_app_with_its_spec_schema_and_a_read_only_state_tool(
        app: Celery, mode: str) -> None:
    deal_tools(app)
    served = app_tools(app)
    assert [t.name for t in served] == ["send_email", "update_deal", "ops.post_status"]

    async def main() -> Any:
        async with mcp.Client(contrib_mcp.server(app), mode=mode) as client:
            return (await client.list_tools()).tools, client.server_info

    listed, info = run(main)
    assert (info.name, info.version) == ("idemmail", __version__)
    specs = [t.spec() for t in served] + [IntentStateTool(served).spec()]
    assert [{"name": t.name, "description": t.description, "input_schema": t.input_schema} for t in listed] == specs
    result = {t.name: t.output_schema["properties"]["result"] for t in listed[:3]}
    assert result == {"send_email": {"type": ["object", "null"]}, "update_deal": {"type": "null"},
                      "ops.post_status": {"type": ["object", "null"]}}
    assert listed[3].output_schema == IntentStateTool(served).output_schema()
    assert "bcc" not in listed[0].input_schema["properties"] and listed[0].input_schema["additionalProperties"] is False
    assert [(t.annotations.read_only_hint, t.annotations.idempotent_hint) for t in listed] == [
        (False, True), (False, True), (False, True), (True, None)]


def test_mcp_refuses_an_argument_the_schema_does_not_offer_and_enqueues_nothing(
        app: Celery, published: list[str]) -> None:
    update_deal, _ = deal_tools(app)
    reply = email_tool(app).bind(event_id="ticket-9-resolved")

    async def main() -> list[Any]:
        async with mcp.Client(contrib_mcp.server(app, [update_deal, reply])) as client:
            return [await client.call_tool("update_deal", {"deal_id": "D-7", "stage": "won", "owner": "bob"},
                                           meta={contrib_mcp.CALL_ID_META: "call_1"}),
                    await client.call_tool("send_email", {"to": "ann@example.com", "subject": "Hi",
                                                          "event_id": "ticket-9-again"}),  # bound: not the model's
                    await client.call_tool("intent_state", {"key": "k", "owner": "bob"})]

    results = run(main)
    assert [(r.is_error, r.structured_content["status"], r.structured_content["error"]["field"]) for r in results] == [
        (True, "invalid", "owner"), (True, "invalid", "event_id"), (True, "invalid", "owner")]
    assert published == []


@ERAS
def test_the_clients_tool_call_id_is_the_intent_of_a_call_id_tool_only(app: Celery, mode: str) -> None:
    update_deal, post_status = (dataclasses.replace(t, timeout=0.05) for t in deal_tools(app))  # no worker: pending
    deal = {"deal_id": "D-7", "stage": "won"}
    post = {"channel": "#ops", "incident_id": "INC-1", "text": "Resolved."}

    async def main() -> list[dict[str, Any]]:
        async with mcp.Client(contrib_mcp.server(app, [update_deal, post_status]), mode=mode) as client:
            meta = {contrib_mcp.CALL_ID_META: "toolu_01"}
            return [(await client.call_tool(name, args, meta=meta)).structured_content
                    for name, args in (("update_deal", deal), ("ops.post_status", post))] + [
                (await client.call_tool("update_deal", deal)).structured_content]

    by_call_id, by_fields, by_arguments = run(main)
    assert {by_call_id["status"], by_fields["status"], by_arguments["status"]} == {"pending"}
    assert by_call_id["key"] == update_deal.key_for(deal, call_id="toolu_01") != update_deal.key_for(deal)
    assert by_fields["key"] == post_status.key_for(post)  # key=("channel", "incident_id"): the id does not count
    assert by_arguments["key"] == update_deal.key_for(deal)  # no id sent: the arguments are the intent


def test_a_tool_is_listed_and_called_under_the_name_it_was_declared_with(app: Celery) -> None:
    @idempotent_tool(app, key="call_id", name="crm.add_note", timeout=0.05)  # no worker: pending, with its key
    def add_note(deal_id: str, text: str) -> dict[str, Any]: ...

    note = {"deal_id": "D-7", "text": "Customer told: fixed."}

    async def main() -> tuple[list[str], Any]:
        async with mcp.Client(contrib_mcp.server(app, [add_note])) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            return names, await client.call_tool("crm.add_note", note, meta={contrib_mcp.CALL_ID_META: "toolu_01"})

    names, called = run(main)
    assert names == ["crm.add_note", "intent_state"] and add_note.task.name == "crm.add_note"
    assert not called.is_error and called.structured_content["status"] == "pending"
    assert called.structured_content["key"] == add_note.key_for(note, call_id="toolu_01")
    langchain_tool = contrib_langchain.as_langchain_tool(add_note)
    assert langchain_tool.name == "crm.add_note"


def test_the_state_tool_says_unknown_for_a_key_no_ledger_holds_and_error_when_it_cannot_tell(
        app: Celery, tmp_path: Any) -> None:
    app.conf.idemmail_ledger_url = f"sqlite:///{tmp_path}/ledger.db"
    state = IntentStateTool(app_tools(app))
    assert state({"key": "idem:v1:nothing"}) == {"key": "idem:v1:nothing", "state": "unknown"}
    assert state({"key": 7})["status"] == "invalid"
    elsewhere = Celery(unique("down"), broker="memory://", backend="cache+memory://")
    elsewhere.conf.update(idemmail_key_secret="test-secret", idemmail_ledger_url="redis://127.0.0.1:1/0")
    down = IntentStateTool(app_tools(elsewhere))({"key": "idem:v1:nothing"})  # nothing listens: not "unknown"
    assert down["status"] == "error" and down["error"]["type"] == "LedgerUnavailableError" and "state" not in down


def test_an_mcp_server_without_a_result_backend_or_with_two_tools_of_one_name_is_refused(app: Celery) -> None:
    update_deal, _ = deal_tools(app)
    with pytest.raises(ConfigurationError, match="unique"):
        contrib_mcp.server(app, [update_deal, update_deal])
    with pytest.raises(ConfigurationError, match="unique"):
        contrib_mcp.server(app, [dataclasses.replace(update_deal, name="intent_state")])
    bare = Celery(unique("nobackend"), broker="memory://")
    bare.conf.idemmail_key_secret = "test-secret"
    with pytest.raises(ConfigurationError, match="result backend"):
        contrib_mcp.server(bare)


#: The app ``-A`` loads in the CLI test (no broker is reached: the command refuses before it serves).
cli_app = Celery("idemmail_cli_agent_tests", broker="memory://", backend="cache+memory://", set_as_current=False)
cli_app.conf.idemmail_key_secret = "test-secret"


def test_the_cli_serves_http_on_loopback_only_and_loads_only_lists_of_tools() -> None:
    previous = current_app._get_current_object()
    try:
        done = CliRunner().invoke(standalone(), ["-A", f"{__name__}:cli_app", "mcp", "--http", "--host", "0.0.0.0"])
        assert done.exit_code == 2 and "loopback only" in done.output, done.output
        done = CliRunner().invoke(standalone(), ["-A", f"{__name__}:cli_app", "mcp", "--tools", f"{__name__}:ERAS"])
        assert done.exit_code == 2 and "not a list of tools" in done.output, done.output
    finally:
        previous.set_current()


def test_langchain_tool_shows_the_spec_schema_and_refuses_what_it_does_not_offer(
        app: Celery, published: list[str]) -> None:
    convert = require_module("langchain_core.utils.function_calling").convert_to_openai_tool
    update_deal, _ = deal_tools(app)
    tool = contrib_langchain.as_langchain_tool(update_deal)
    assert convert(tool) == {"type": "function", "function": {
        "name": "update_deal", "description": update_deal.spec()["description"],
        "parameters": update_deal.spec()["input_schema"]}}
    outcome = tool.invoke({"deal_id": "D-7", "stage": "won", "owner": "bob"})
    assert outcome["status"] == "invalid" and outcome["error"]["field"] == "owner"
    assert published == []


def test_langgraph_toolnode_passes_the_tool_call_id_as_the_intent(app: Celery) -> None:
    messages = require_module("langchain_core.messages")
    graph_mod = require_module("langgraph.graph")
    prebuilt = require_module("langgraph.prebuilt")
    update_deal = dataclasses.replace(deal_tools(app)[0], timeout=0.05)  # no worker: pending, with its key
    graph = graph_mod.StateGraph(graph_mod.MessagesState)
    graph.add_node("tools", prebuilt.ToolNode([contrib_langchain.as_langchain_tool(update_deal)]))
    graph.add_edge(graph_mod.START, "tools")
    graph.add_edge("tools", graph_mod.END)
    deal = {"deal_id": "D-7", "stage": "won"}
    call = messages.AIMessage("", tool_calls=[{"name": "update_deal", "args": deal, "id": "call_7"}])
    answer = graph.compile().invoke({"messages": [call]})["messages"][-1]
    assert (answer.tool_call_id, answer.status) == ("call_7", "success")
    outcome = json.loads(answer.content)
    assert outcome["status"] == "pending" and outcome["key"] == update_deal.key_for(deal, call_id="call_7")
    call = messages.AIMessage("", tool_calls=[{"name": "update_deal", "args": {**deal, "owner": "bob"}, "id": "c9"}])
    refused = graph.compile().invoke({"messages": [call]})["messages"][-1]
    assert refused.status == "error" and json.loads(refused.content)["status"] == "invalid"  # as MCP's isError

    async def main() -> Any:  # the async path (ToolNode awaits the tool; it waits in an executor thread)
        call = messages.AIMessage("", tool_calls=[{"name": "update_deal", "args": deal, "id": "call_8"}])
        return (await graph.compile().ainvoke({"messages": [call]}))["messages"][-1]

    outcome = json.loads(run(main).content)
    assert outcome["status"] == "pending" and outcome["key"] == update_deal.key_for(deal, call_id="call_8")
