"""The app's agent tools over the Model Context Protocol (the official ``mcp`` SDK; extra ``[mcp]``).

``celery -A proj idemmail mcp [--http --port 8000] [--tools proj.agent:TOOLS]``, or from Python
``run_stdio(server(app))``, ``run_http(server(app), port=8000)``. What it lists, what a call returns
and which id is the intent: docs/agent-tools.md. The JSON-RPC request id is never the intent: clients
renumber on each connection and give a retry a new one.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread
import mcp_types as types
from celery import Celery
from celery.backends.base import DisabledBackend
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import INVALID_PARAMS

from .._version import __version__
from ..errors import ConfigurationError
from ..tools import ERROR_STATUSES, IdempotentTool, IntentStateTool, app_tools

__all__ = ["CALL_ID_META", "run_http", "run_stdio", "server"]

#: The ``_meta`` key of a ``tools/call`` request carrying the model's tool-call id: a ``key="call_id"`` tool's intent.
CALL_ID_META = "idemmail/call_id"

#: The hosts ``run_http`` listens on.
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def server(app: Celery, tools: Sequence[IdempotentTool] | None = None, *, name: str = "idemmail") -> Server[Any]:
    """An MCP server (the SDK's low-level ``Server``) for ``tools`` (default: ``app_tools(app)``).

    Raises :class:`~idemmail_celery.errors.ConfigurationError` when the app has no result
    backend (a call could never see its outcome) or two tools share a name.
    """
    served = list(app_tools(app) if tools is None else tools)
    if isinstance(app.backend, DisabledBackend):
        raise ConfigurationError("the MCP server waits for outcomes: the Celery app needs a result backend")
    callables: list[IdempotentTool | IntentStateTool] = [*served, IntentStateTool(served)]
    by_name = {tool.name: tool for tool in callables}
    if len(by_name) != len(callables):
        names = [tool.name for tool in callables]
        raise ConfigurationError(f"tool names must be unique: {sorted({n for n in names if names.count(n) > 1})}")
    listed = [_listed(tool) for tool in callables]

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        tool = by_name.get(params.name)
        if tool is None:
            raise MCPError(INVALID_PARAMS, f"unknown tool {params.name[:64]!r}")
        meta = ctx.meta or {}
        call_id = meta.get(CALL_ID_META) if isinstance(tool, IdempotentTool) and tool.key == "call_id" else None
        if call_id is not None and not isinstance(call_id, str):
            raise MCPError(INVALID_PARAMS, f"_meta[{CALL_ID_META!r}] must be a string")
        # The tool waits on Celery's result backend (blocking): in a thread, so other calls go on meanwhile.
        outcome = await anyio.to_thread.run_sync(functools.partial(tool, params.arguments or {}, call_id=call_id))
        text = json.dumps(outcome, default=str)
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                    structured_content=json.loads(text),
                                    is_error=outcome.get("status") in ERROR_STATUSES)

    return Server(name, version=__version__,
                  description="Tools whose side effects happen once per intent, however often called.",
                  on_list_tools=list_tools, on_call_tool=call_tool)


def _listed(tool: IdempotentTool | IntentStateTool) -> types.Tool:
    spec = tool.spec()
    hints = (types.ToolAnnotations(read_only_hint=True) if isinstance(tool, IntentStateTool)
             else types.ToolAnnotations(read_only_hint=False, idempotent_hint=True))
    return types.Tool(name=spec["name"], description=spec["description"], input_schema=spec["input_schema"],
                      output_schema=tool.output_schema(), annotations=hints)


def run_stdio(mcp_server: Server[Any]) -> None:
    """Serve over this process's stdin and stdout until the client closes them."""

    async def main() -> None:
        async with stdio_server() as (read, write):
            await mcp_server.run(read, write, mcp_server.create_initialization_options())

    anyio.run(main)


def run_http(mcp_server: Server[Any], *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Serve streamable HTTP at ``http://host:port/mcp`` until interrupted; ``host`` must be loopback (no login)."""
    import uvicorn  # the mcp SDK's own dependency

    if host not in LOOPBACK:
        raise ConfigurationError(f"the MCP server listens on loopback only ({', '.join(LOOPBACK)}), not {host!r}")
    # On these names the SDK turns on its DNS-rebinding check (Host and Origin must be loopback too).
    uvicorn.run(mcp_server.streamable_http_app(host=host), host=host, port=port, log_level="warning")

