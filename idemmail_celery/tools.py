"""Agent tools whose side effects happen once per intent, however often the agent loop calls them.

Each call is an :class:`~idemmail_celery.task.IdempotentTask` message with an intent key, so a repeated
call replays the first outcome (``"status": "duplicate"``). Which key to choose, what the model may pass
(only the schema's names: anything else is ``invalid``, nothing enqueued) and what it sees:
docs/agent-tools.md. The MCP and LangChain adapters in ``idemmail_celery.contrib`` serve :func:`app_tools`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import inspect
import re
import threading
import types
import typing
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

from celery import Celery
from celery.backends.base import DisabledBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError

from .chain import KEY_HEADER
from .errors import (
    ConfigurationError,
    IdemmailError,
    IdempotencyKeyReuseError,
    PermanentSendError,
    SendNeedsReview,
    ToolArgumentError,
)
from .handler import Outcome
from .ledger import Ledger, Record, State, from_url, passive_options
from .mail import TASK_NAME, _send_email
from .task import IdempotentTask

__all__ = ["ERROR_STATUSES", "IdempotentTool", "IntentStateTool", "KeySource", "ToolArgumentError", "app_tools",
           "email_tool", "idempotent_tool", "parameters_of"]

#: Where a tool call's intent key comes from: the tool-call id, declared argument names, or all arguments.
KeySource = Literal["call_id"] | Sequence[str] | None

#: The outcomes an adapter reports as errors (MCP's ``isError``, LangChain's ``status="error"``): the model reads why.
ERROR_STATUSES = frozenset({Outcome.INVALID.value, Outcome.FAILED.value, Outcome.ERROR.value})

#: What a tool may be named: MCP's rule (letters, digits, ``_``, ``-`` and ``.``; 1 to 128 of them).
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")

_JSON_TYPES: Mapping[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                                  list: "array", tuple: "array", dict: "object"}

#: What a model may set on an email: who gets it, and its words; the rest is bound (docs/agent-tools.md).
_EMAIL_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {
    "to": {"type": ["string", "array"], "items": {"type": "string"}, "description": "recipient address(es)"},
    "subject": {"type": "string"}, "text": {"type": "string", "description": "plain-text body"},
    "html": {"type": "string", "description": "HTML body"}, "reply_to": {"type": "string"},
}, "required": ["to", "subject"], "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class IdempotentTool:
    """An agent tool backed by an :class:`IdempotentTask`, made by :func:`idempotent_tool` or :func:`email_tool`;
    ``fixed`` arguments (:meth:`bind`) are the application's, not shown to the model."""

    task: IdempotentTask
    name: str
    description: str
    parameters: Mapping[str, Any]
    key: KeySource = "call_id"
    timeout: float = 10.0
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: The JSON Schema of what the side effect returns (an outcome's ``result``); ``{}``: any JSON.
    returns: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_name(self.name)

    def bind(self, **fixed: Any) -> IdempotentTool:
        """A copy whose ``fixed`` arguments are set by the application (an ``event_id``, a tenant)."""
        return dataclasses.replace(self, fixed={**self.fixed, **fixed})

    def spec(self) -> dict[str, Any]:
        """The tool as a model is shown it: ``{"name", "description", "input_schema"}`` (JSON Schema; OpenAI-style
        APIs call it ``parameters``)."""
        schema = dict(self.parameters)
        schema["properties"] = {k: v for k, v in dict(schema.get("properties", {})).items() if k not in self.fixed}
        schema["required"] = [k for k in schema.get("required", []) if k not in self.fixed]
        schema["additionalProperties"] = False  # enforced: see _checked
        return {"name": self.name, "description": self.description, "input_schema": schema}

    def output_schema(self) -> dict[str, Any]:
        """The JSON Schema of what a call returns (MCP's ``outputSchema``), ``result`` typed by :attr:`returns`."""
        return {"type": "object", "properties": {
            "status": {"type": "string", "enum": [outcome.value for outcome in Outcome]},
            "key": {"type": ["string", "null"], "description": "the intent key (null when refused before one)"},
            "result": _nullable(self.returns),
            "message_id": {"description": "the side effect's id for it, if its result names one"},
            "error": _ERROR_SCHEMA,
        }, "required": ["status"]}

    def key_for(self, arguments: Mapping[str, Any], *, call_id: str | None = None) -> str:
        """The intent key a call would get (to look it up in the ledger); validates like :meth:`submit`."""
        return self._headers(arguments, call_id)[1][KEY_HEADER]

    def submit(self, arguments: Mapping[str, Any], *, call_id: str | None = None) -> tuple[str, Any]:
        """Enqueue one call; ``(key, AsyncResult)``. :class:`~idemmail_celery.errors.IdemmailError` (or
        ``TypeError``) before enqueueing when the arguments are refused."""
        kwargs, headers = self._headers(arguments, call_id)
        return headers[KEY_HEADER], self.task.apply_async(kwargs=kwargs, headers=headers)

    def _checked(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The model's arguments, unless a name is not one the model is shown or a required one is missing."""
        if not isinstance(arguments, Mapping):
            raise ToolArgumentError(f"tool {self.name}: arguments must be an object, not {type(arguments).__name__}")
        allowed = set(self.parameters.get("properties") or {}) - set(self.fixed)
        for name in arguments:
            if name not in allowed:
                raise ToolArgumentError(f"tool {self.name}: unexpected argument {str(name)[:64]!r} "
                                        f"(allowed: {', '.join(sorted(allowed)) or 'none'})", field=str(name)[:64])
        for name in self.parameters.get("required") or ():
            if name in allowed and name not in arguments:
                raise ToolArgumentError(f"tool {self.name}: missing argument {name!r}", field=name)
        return dict(arguments)

    def _headers(self, arguments: Mapping[str, Any], call_id: str | None) -> tuple[dict[str, Any], dict[str, str]]:
        kwargs = {**self._checked(arguments), **self.fixed}
        explicit = call_id if self.key == "call_id" and call_id else None
        return kwargs, self.task.intent_headers((), kwargs, explicit=explicit)

    def __call__(self, arguments: Mapping[str, Any], *, call_id: str | None = None,
                 timeout: float | None = None) -> dict[str, Any]:
        """Run one tool call and wait up to ``timeout`` seconds (default :attr:`timeout`) for its outcome: a dict
        whose ``status`` is an :class:`~idemmail_celery.handler.Outcome` value, even for bad arguments."""
        if isinstance(self.task.backend, DisabledBackend):
            raise ConfigurationError(f"tool {self.name}: the Celery app needs a result backend to wait for outcomes")
        try:
            key, async_result = self.submit(arguments, call_id=call_id)
        except (IdemmailError, TypeError) as exc:
            return {"status": Outcome.INVALID.value, "key": None, "error": _error(exc)}
        try:
            value = async_result.get(timeout=self.timeout if timeout is None else timeout, propagate=False)
        except CeleryTimeoutError:
            return {"status": Outcome.PENDING.value, "key": key, "task_id": async_result.id,
                    "note": "still running; calling again with the same arguments (and call_id) will not repeat it"}
        if isinstance(value, dict):
            return dict(value)
        status = next((outcome for kind, outcome in _ERROR_OUTCOMES if isinstance(value, kind)), Outcome.ERROR)
        return {"status": status.value, "key": key, "error": _error(value)}


#: The outcome of a call whose task ended in one of these errors (in this order).
_ERROR_OUTCOMES = ((SendNeedsReview, Outcome.REVIEW), (PermanentSendError, Outcome.FAILED),
                   (IdempotencyKeyReuseError, Outcome.KEY_REUSE))
_ERROR_SCHEMA: Mapping[str, Any] = {"type": "object", "properties": {"type": {"type": "string"},
                                                                    "message": {"type": "string"}}}


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ConfigurationError(f"a tool's name is 1 to 128 letters, digits, '_', '-' or '.', not {name!r}")


def _nullable(schema: Mapping[str, Any]) -> dict[str, Any]:
    """``schema`` or null (``{}`` already allows anything)."""
    kind = schema.get("type")
    if not schema or kind == "null":
        return dict(schema)
    if isinstance(kind, str) and len(schema) == 1:
        return {"type": [kind, "null"]}
    return {"anyOf": [dict(schema), {"type": "null"}]}


def _error(exc: object) -> dict[str, Any]:
    found = {attr: getattr(exc, attr, None) for attr in ("field", "reason")}
    return {"type": type(exc).__name__, "message": str(exc), **{k: v for k, v in found.items() if v}}


def _json_type(hint: Any) -> dict[str, Any]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    kind = _JSON_TYPES.get(typing.get_origin(hint) or hint)
    return {"type": kind} if kind else {}


def _hints(func: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(func)
    except (NameError, TypeError):  # a hint that does not resolve: as if there were none
        return {}


def _returns_of(func: Callable[..., Any]) -> dict[str, Any]:
    """A JSON Schema for what ``func`` returns, from its return type hint (``{}``: any JSON)."""
    hint = _hints(func).get("return")
    return {"type": "null"} if hint is type(None) else _json_type(hint)


def parameters_of(func: Callable[..., Any], *, bound: bool = False) -> dict[str, Any]:
    """A JSON Schema for ``func``'s arguments from its signature and type hints (``self`` skipped if ``bound``)."""
    params = [p for p in list(inspect.signature(func).parameters.values())[1 if bound else 0:]
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    hints = _hints(func)
    return {"type": "object", "properties": {p.name: _json_type(hints.get(p.name)) for p in params},
            "required": [p.name for p in params if p.default is p.empty]}


def idempotent_tool(app: Celery, *, key: KeySource = "call_id", name: str | None = None,
                    description: str | None = None, parameters: Mapping[str, Any] | None = None, timeout: float = 10.0,
                    **task_options: Any) -> Callable[[Callable[..., Any]], IdempotentTool]:
    """Decorator: register ``func`` as an :class:`IdempotentTask` on ``app`` (only) and return it as a tool
    (``key`` and ``name``: docs/agent-tools.md). ``description`` defaults to the docstring's first paragraph,
    ``parameters`` (a JSON Schema) to one built from the type hints; ``task_options`` go to ``app.task``."""
    if isinstance(key, str) and key != "call_id":
        raise ConfigurationError(f"key must be 'call_id', a sequence of argument names or None, not {key!r}")
    if name is not None:
        _check_name(name)

    def wrap(func: Callable[..., Any]) -> IdempotentTool:
        tool_name = name or func.__name__
        _check_name(tool_name)
        fields = None if key is None or key == "call_id" else tuple(key)
        schema = parameters or parameters_of(func, bound=bool(task_options.get("bind")))
        options: dict[str, Any] = {"shared": False, **task_options}
        if name is not None:
            options["name"] = name
        if key == "call_id":
            # A call id is the client's number, not the call: one that comes back with other arguments (two
            # sessions both numbering from call_1) is refused as a key reuse, never given the first outcome.
            options.setdefault("idempotency_must_match", tuple(schema.get("properties") or ()))
        with _registry_lock:
            made = _registered.setdefault(app, {})
            if tool_name in made and made[tool_name][0] is not func:
                # Celery would keep the first function under the task's name: the tool would run it.
                raise ConfigurationError(f"a tool named {tool_name!r} is already declared on this app "
                                         f"({made[tool_name][0].__qualname__}): give this one another name=")
            task = app.task(base=IdempotentTask, idempotency_key=fields, **options)(func)
            summary = description or (inspect.getdoc(func) or "").split("\n\n")[0]
            tool = IdempotentTool(task=task, name=tool_name, description=summary, parameters=schema, key=key,
                                  timeout=timeout, returns=_returns_of(func))
            made[tool_name] = (func, tool)
        return tool

    return wrap


#: The tools ``idempotent_tool`` made on each app, by name, with the function each runs (weak: by app).
_registered: weakref.WeakKeyDictionary[Celery, dict[str, tuple[Callable[..., Any], IdempotentTool]]] = (
    weakref.WeakKeyDictionary())
_registry_lock = threading.Lock()


def app_tools(app: Celery) -> list[IdempotentTool]:
    """What an adapter serves by default: ``email_tool(app)`` (unbound), then every :func:`idempotent_tool`
    made on ``app``, in the order they were made. To serve bound tools, hand an adapter your own list."""
    with _registry_lock:
        made = [tool for _, tool in _registered.get(app, {}).values()]
    email = email_tool(app)
    if any(tool.name == email.name for tool in made):
        raise ConfigurationError(f"an idempotent_tool is named {email.name!r}, as the email tool is: rename it "
                                 "(name=), or serve a list of your own")
    return [email, *made]


def email_tool(app: Celery, *, name: str = "send_email", description: str | None = None,
               timeout: float = 10.0) -> IdempotentTool:
    """``send_email`` on ``app`` as a tool: one email per ``event_id`` and recipients, however often called.
    The model sets ``to``, ``subject``, ``text``, ``html`` and ``reply_to``; bind the rest (docs/agent-tools.md)."""
    return IdempotentTool(
        task=app.tasks[TASK_NAME], name=name, parameters=_EMAIL_PARAMETERS, key=None, timeout=timeout,
        returns=_returns_of(_send_email),
        description=description or ("Send one email. Asking again for the same email and recipients does "
                                    "not send it twice: the first request's text is the one that ships."),
    )


#: The longest ``key`` the state tool looks up (keys are hashes of about 70 characters).
_MAX_KEY = 256


@dataclasses.dataclass(frozen=True)
class IntentStateTool:
    """A read-only tool: where one intent stands in the ledgers of ``tools``, by the ``key`` an outcome gave
    (docs/agent-tools.md): ``{"key", "state", ...}``, never the payload; ``{"status": "error"}`` when a ledger
    does not answer, never ``unknown``."""

    tools: Sequence[IdempotentTool]
    name: str = "intent_state"
    description: str = ("Look up where an earlier tool call stands, by the key its outcome gave: claimed "
                        "(still running), sent, failed, review, or unknown. Changes nothing.")

    def __post_init__(self) -> None:
        _check_name(self.name)

    def spec(self) -> dict[str, Any]:
        """The tool as a model is shown it (see :meth:`IdempotentTool.spec`)."""
        return {"name": self.name, "description": self.description,
                "input_schema": {"type": "object",
                                 "properties": {"key": {"type": "string", "description": "the outcome's key"}},
                                 "required": ["key"], "additionalProperties": False}}

    def output_schema(self) -> dict[str, Any]:
        """The JSON Schema of what a call returns (see :meth:`IdempotentTool.output_schema`)."""
        return {"type": "object", "properties": {
            "key": {"type": ["string", "null"]},
            "state": {"type": "string", "enum": [*(state.value for state in State), "unknown"]},
            "status": {"type": "string", "enum": [Outcome.INVALID.value, Outcome.ERROR.value]},
            "attempts": {"type": "integer"}, "updated_at": {"type": ["string", "null"]},
            "sent_at": {"type": ["string", "null"]}, "error": _ERROR_SCHEMA,
        }, "required": ["key"]}

    @functools.cached_property
    def _ledgers(self) -> list[Ledger]:
        """One passive ledger per distinct ledger the tools' tasks use (most apps: one)."""
        seen: dict[tuple[str, str], Ledger] = {}
        for tool in self.tools:
            settings = tool.task.idem_settings
            options = {**settings.ledger_kwargs(), **passive_options(settings.ledger_url)}
            ident = (settings.ledger_url, repr(sorted(options.items())))
            if ident not in seen:
                seen[ident] = from_url(settings.ledger_url, **options)
        return list(seen.values())

    def __call__(self, arguments: Mapping[str, Any], *, call_id: str | None = None,
                 timeout: float | None = None) -> dict[str, Any]:
        """Look one key up; ``call_id`` and ``timeout`` are accepted and unused (a read)."""
        key = arguments.get("key") if isinstance(arguments, Mapping) else None
        extra = sorted(set(arguments) - {"key"}) if isinstance(arguments, Mapping) else []
        if extra or not isinstance(key, str) or not key or len(key) > _MAX_KEY:
            field = str(extra[0])[:64] if extra else "key"
            problem = f"unexpected argument {field!r}" if extra else "key must be the string an outcome gave"
            return {"status": Outcome.INVALID.value, "key": None,
                    "error": _error(ToolArgumentError(f"tool {self.name}: {problem}", field=field))}
        try:
            for ledger in self._ledgers:
                record = ledger.get(key)
                if record is not None:
                    return _state_of(key, record)
        except IdemmailError as exc:  # the ledger is down (or lost): say so, never guess "unknown"
            return {"status": Outcome.ERROR.value, "key": key, "error": _error(exc)}
        return {"key": key, "state": "unknown"}


def _state_of(key: str, record: Record) -> dict[str, Any]:
    at, error = record.updated_at, record.error
    out: dict[str, Any] = {"key": key, "state": record.state.value, "attempts": record.attempts,
                           "updated_at": dt.datetime.fromtimestamp(at, dt.timezone.utc).isoformat() if at else None}
    if record.state is State.SENT:
        stored = record.result or {}
        out.update(message_id=stored.get("message_id"), sent_at=out["updated_at"], result=stored.get("value"))
    elif error:
        out["error"] = {k: error[k] for k in ("type", "reason", "message") if k in error}
    return out
