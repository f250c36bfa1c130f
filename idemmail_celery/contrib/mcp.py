"""The app's agent tools over the Model Context Protocol (the official ``mcp`` SDK; extra ``[mcp]``).

From the command line, with the app's settings (stdio for a client that starts the server,
streamable HTTP on loopback for one that connects to it)::

    celery -A proj idemmail mcp                       # stdio
    celery -A proj idemmail mcp --http --port 8000    # http://127.0.0.1:8000/mcp
    celery -A proj idemmail mcp --tools proj.agent:TOOLS

or from Python: ``run_stdio(server(app))``, ``run_http(server(app), port=8000)``.

It serves :func:`~idemmail_celery.tools.app_tools` (``email_tool`` and every
``idempotent_tool`` made on the app) or the list given, each under its own name with the
schema its ``spec()`` gives (bound arguments never shown) and its ``output_schema()``, plus
``intent_state`` (:class:`~idemmail_celery.tools.IntentStateTool`, read only); the server
reports the package's version. A call's result is the tool's outcome dict, as
``structuredContent`` and as JSON text; ``isError`` is set for the outcomes in
:data:`~idemmail_celery.tools.ERROR_STATUSES`. Each call waits in a thread of anyio's pool (40 at once by default;
more calls queue) for its outcome, or for the tool's ``timeout`` and then answers ``pending``.

**Call ids.** For a tool made with ``key="call_id"``, the intent is the client's tool-call
id, sent in the request's ``_meta`` under :data:`CALL_ID_META`; without one, the call's
arguments are. Tools keyed otherwise ignore it (see :mod:`~idemmail_celery.tools`).
The JSON-RPC request id is never used: the client gives a retried call a new one, and
numbers them afresh on each connection, so it would protect nothing and could join two
clients' calls into one intent.
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

#: The ``_meta`` key of a ``tools/call`` request that carries the client's tool-call id (the id the
#: model gave the call): the intent of a ``key="call_id"`` tool.
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
    """Serve streamable HTTP at ``http://host:port/mcp`` until interrupted; ``host`` must be loopback.

    The server has no authentication of its own: whoever reaches it can send the app's email.
    Put it behind an authenticating proxy on the same host to serve anyone else.
    """
    import uvicorn  # the mcp SDK's own dependency

    if host not in LOOPBACK:
        raise ConfigurationError(f"the MCP server listens on loopback only ({', '.join(LOOPBACK)}), not {host!r}")
    # On these names the SDK turns on its DNS-rebinding check (Host and Origin must be loopback too).
    uvicorn.run(mcp_server.streamable_http_app(host=host), host=host, port=port, log_level="warning")

