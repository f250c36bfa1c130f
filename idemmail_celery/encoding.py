"""How a call's arguments are written: canonical JSON (what keys and fingerprints are made of), kombu's typed
JSON without kombu (how the ledgers store payloads), and the bounds arguments must keep before a worker runs them.

Nothing here knows about keys, ledgers or Celery.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from .errors import UnserializableArgumentsError


def is_json_plain(value: Any, _depth: int = 0) -> bool:
    """True if ``value`` is made only of types a JSON round trip returns unchanged (no copy needed)."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if _depth > 20:
        return False
    if type(value) is list:
        return all(is_json_plain(v, _depth + 1) for v in value)
    if type(value) is dict:
        return all(type(k) is str and is_json_plain(v, _depth + 1) for k, v in value.items())
    return False


#: A message serializer's round trip: a value in, the value the worker will see out
#: (:class:`~idemmail_celery.errors.UnserializableArgumentsError` for what it cannot carry).
RoundTrip = Callable[[Any], Any]


# kombu's JSON writes datetimes, dates, times, decimals, UUIDs and bytes as {"__type__": ..., "__value__": ...}: so
# does this, without kombu, for the Celery-free handler (the adapter passes kombu's own round trip for the rest).


def _typed(kind: str, value: Any) -> dict[str, Any]:
    return {"__type__": kind, "__value__": value}


class _TypedEncoder(json.JSONEncoder):
    """kombu's ``JSONEncoder`` for its default types: the same text, byte for byte."""

    def default(self, o: Any) -> Any:
        reducer = getattr(o, "__json__", None)
        if reducer is not None:
            return reducer()
        # A datetime is also a date: it goes first.
        if isinstance(o, _dt.datetime):
            return _typed("datetime", o.isoformat())
        if isinstance(o, _dt.date):
            return _typed("date", o.isoformat())
        if isinstance(o, _dt.time):
            return _typed("time", o.isoformat())
        if isinstance(o, decimal.Decimal):
            return _typed("decimal", str(o))
        if isinstance(o, uuid.UUID):
            return _typed("uuid", {"hex": o.hex})
        if isinstance(o, bytes):
            try:
                return _typed("bytes", o.decode("utf-8"))
            except UnicodeDecodeError:
                return _typed("base64", base64.b64encode(o).decode("utf-8"))
        return super().default(o)


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "datetime": _dt.datetime.fromisoformat,
    "date": lambda v: _dt.datetime.fromisoformat(v).date(),
    "time": _dt.time.fromisoformat,
    "decimal": decimal.Decimal,
    "uuid": lambda v: uuid.UUID(**v),
    "bytes": lambda v: v.encode("utf-8"),
    "base64": lambda v: base64.b64decode(v.encode("utf-8")),
}


def _typed_hook(o: dict[str, Any]) -> Any:
    if o.keys() == {"__type__", "__value__"}:
        decode = _DECODERS.get(o["__type__"])
        if decode is not None:
            return decode(o["__value__"])
    return o  # an envelope of a type registered with kombu only stays a dict


# Built once (json.dumps() with options builds a new encoder per call); an encoder keeps no state between calls.
_TYPED = _TypedEncoder()
_TYPED_SORTED = _TypedEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def typed_json_dumps(value: Any) -> str:
    """``value`` as kombu's JSON writes it (typed values in ``__type__`` envelopes); ``TypeError`` otherwise."""
    return _TYPED.encode(value)


def sorted_typed_json(value: Any) -> str:
    """``value`` in kombu's typed JSON with keys sorted, no whitespace, UTF-8 (what a seal digests); ``TypeError``
    or ``ValueError`` for what it cannot hold."""
    return _TYPED_SORTED.encode(value)


def typed_json_loads(text: str | bytes) -> Any:
    """Text written by :func:`typed_json_dumps` (or by kombu's JSON), typed values restored."""
    return json.loads(text, object_hook=_typed_hook)


def json_round_trip(value: Any) -> Any:
    """What Celery's JSON serializer does to ``value`` (its default typed values included)."""
    if is_json_plain(value):
        return value  # the round trip would be the identity: skip two encodings per delay()
    try:
        return typed_json_loads(typed_json_dumps(value))
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnserializableArgumentsError(f"task arguments cannot be serialized with 'json': {exc}") from exc


def _json_default(value: Any) -> Any:
    # Types kombu's JSON serializer carries natively; written in one stable textual form.
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=canonical_json)
    raise TypeError(f"{type(value).__name__} has no canonical JSON form")


# Built once: json.dumps() with options builds a new encoder per call.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False,
                              default=_json_default)


def canonical_json(value: Any) -> str:
    """Canonical JSON text of ``value``: sorted keys, no whitespace, UTF-8, no NaN, ``1.0`` written ``1``."""
    try:
        return _CANONICAL.encode(_integral(value, 0))
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnserializableArgumentsError(f"value has no canonical JSON form: {exc}") from exc


def _integral(value: Any, depth: int) -> Any:
    """``value`` with every integral float made an int (``1.0`` from a form or JavaScript is the intent of ``1``);
    only the containers that change are copied."""
    kind = type(value)
    if kind is float:  # a finite integral float is exactly one integer, however large (2.0**60 is 2**60)
        return int(value) if value.is_integer() else value
    if kind is not dict and kind is not list and kind is not tuple:
        return value  # str, int, bool, None; datetimes, decimals, UUIDs...: _json_default writes them
    if depth > MAX_NESTING:
        raise ValueError(f"nested more than {MAX_NESTING} levels deep")
    changed: Any = None
    for k, v in value.items() if kind is dict else enumerate(value):
        if type(v) in _SCALARS:
            continue
        new = _integral(v, depth + 1)
        if new is not v:
            if changed is None:
                changed = dict(value) if kind is dict else list(value)
            changed[k] = new
    return value if changed is None else changed


_SCALARS = frozenset({str, int, bool, type(None)})

#: How deeply a task's arguments may nest (a list or mapping argument is level 1): deeper input overflows the
#: stack of whatever walks it recursively (pickle in a prefork worker's main process, JSON, this module).
MAX_NESTING = 100


def arguments_problem(args: Any, kwargs: Any, max_size: int | None = None) -> str | None:
    """Why a call's arguments may not be run (nested past :data:`MAX_NESTING`, or larger than ``max_size``,
    where a text or mapping key counts its length and any other value 1), or None. Quotes no value."""
    items = list(args) if isinstance(args, (list, tuple)) else [args]
    size = 0
    if isinstance(kwargs, Mapping):
        size += sum(len(k) if isinstance(k, str) else 1 for k in kwargs)
        items.extend(kwargs.values())
    else:
        items.append(kwargs)
    stack: list[tuple[Any, int]] = [(v, 1) for v in items]
    while stack:
        value, level = stack.pop()
        if isinstance(value, (str, bytes, bytearray)):
            size += len(value)
        elif isinstance(value, (list, tuple, Mapping)):
            if level > MAX_NESTING:
                return f"task arguments nested more than {MAX_NESTING} levels deep"
            size += 1
            if isinstance(value, Mapping):
                size += sum(len(k) if isinstance(k, str) else 1 for k in value)
                stack.extend((v, level + 1) for v in value.values())
            else:
                stack.extend((v, level + 1) for v in value)
        else:
            size += 1
        if max_size is not None and size > max_size:
            return f"task arguments are larger than {max_size} (characters and values)"
    return None
