"""Agent tools as LangChain tools, for LangGraph's ``ToolNode`` and any LangChain agent (extra ``[langchain]``).

``ToolNode([as_langchain_tool(t) for t in tools])``: given a whole tool call, a tool answers a ``ToolMessage``
holding its outcome dict as JSON, and the call's ``id`` is the ``call_id`` (docs/agent-tools.md).
"""

from __future__ import annotations

import contextvars
import json
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool

from ..tools import ERROR_STATUSES, IdempotentTool, IntentStateTool

__all__ = ["IdempotentLangChainTool", "as_langchain_tool"]

#: The tool-call id of the call running in this context: ``BaseTool.run`` is told it, ``_run`` is not.
_call_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("idemmail_tool_call_id", default=None)


class IdempotentLangChainTool(BaseTool):
    """A LangChain ``BaseTool`` over an :class:`~idemmail_celery.tools.IdempotentTool` (or the state tool)."""

    tool: IdempotentTool | IntentStateTool

    def run(self, tool_input: Any, *args: Any, **kwargs: Any) -> Any:
        token = _call_id.set(kwargs.get("tool_call_id"))
        try:
            return super().run(tool_input, *args, **kwargs)
        finally:
            _call_id.reset(token)

    async def arun(self, tool_input: Any, *args: Any, **kwargs: Any) -> Any:
        token = _call_id.set(kwargs.get("tool_call_id"))
        try:
            return await super().arun(tool_input, *args, **kwargs)
        finally:
            _call_id.reset(token)

    # Only **arguments: a `run_manager` or config parameter here would let LangChain swallow a model's
    # argument of that name instead of the tool refusing it.
    def _run(self, **arguments: Any) -> dict[str, Any] | ToolMessage:
        # The async path runs this in an executor thread (LangChain's default _arun): the wait blocks only it.
        call_id = _call_id.get()
        outcome = self.tool(arguments, call_id=call_id)
        if call_id is None:
            return outcome
        # LangChain marks a ToolMessage an error only for an exception; an outcome is no exception.
        return ToolMessage(json.dumps(outcome, default=str), tool_call_id=call_id, name=self.name,
                           status="error" if outcome.get("status") in ERROR_STATUSES else "success")


def as_langchain_tool(tool: IdempotentTool | IntentStateTool) -> IdempotentLangChainTool:
    """``tool`` as a LangChain tool: its name, description and schema as ``tool.spec()`` gives them."""
    spec = tool.spec()
    return IdempotentLangChainTool(tool=tool, name=spec["name"], description=spec["description"],
                                   args_schema=dict(spec["input_schema"]))
