"""Intent keys and must-match fingerprints.

An *intent* is what a task call means ("send the confirmation for order 4821 to
ann@example.com"), as opposed to a message or a task id, of which one intent may
have many. The intent key is a digest of that meaning:

1. the arguments are bound to the task's signature (so positional and keyword
   calls, and defaults, agree) and passed through the task serializer's round
   trip (so tuples become lists in the caller exactly as they do in the worker);
2. the declared fields are picked (all bound arguments when none are declared),
   email addresses are normalised (display names dropped, domain lower-cased,
   recipient lists de-duplicated and sorted);
3. the values are written as canonical JSON (sorted keys, no whitespace) inside
   a namespace of task name, tenant and version;
4. that text is digested with HMAC-SHA256 under ``idemmail_key_secret``, or
   plain SHA-256 when no secret is set (then a key can be brute-forced back to
   a guessable address and order id: set a secret in production).

The key is 64 lower-case hex characters and carries no raw argument values.
Changing anything in this module changes keys, which would re-send everything
in flight after an upgrade: ``tests/test_keys.py`` pins golden vectors.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import hashlib
import hmac
import inspect
import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import getaddresses
from typing import Any

from kombu.exceptions import KombuError
from kombu.serialization import dumps as kombu_dumps
from kombu.serialization import loads as kombu_loads
from kombu.utils.json import dumps as json_dumps
from kombu.utils.json import loads as json_loads

from .errors import IdempotencyKeyError, UnserializableArgumentsError

#: What a task may declare as ``idempotency_key``: nothing (all bound arguments),
#: argument names, or a function of ``(args, kwargs)`` returning a string.
KeySpec = Sequence[str] | Callable[[tuple[Any, ...], dict[str, Any]], str] | None

#: Names of arguments treated as email addresses when a task declares none.
DEFAULT_ADDRESS_FIELDS: tuple[str, ...] = ("to", "cc", "bcc", "reply_to", "from_", "sender")

_NAMESPACE = "idemmail/1"


def _json_plain(value: Any, depth: int = 0) -> bool:
    """True if ``value`` is made only of types a JSON round trip returns unchanged."""
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if depth > 20:
        return False
    if type(value) is list:
        return all(_json_plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _json_plain(v, depth + 1) for k, v in value.items())
    return False


def round_trip(value: Any, serializer: str) -> Any:
    """Return ``value`` as the worker will see it after the task serializer's round trip."""
    if serializer == "json" and _json_plain(value):
        return value  # the round trip would be the identity: skip two encodings per delay()
    try:
        content_type, encoding, data = kombu_dumps(value, serializer=serializer)  # type: ignore[no-untyped-call]
        return kombu_loads(data, content_type, encoding, accept={content_type})  # type: ignore[no-untyped-call]
    except (KombuError, TypeError, ValueError) as exc:
        raise UnserializableArgumentsError(
            f"task arguments cannot be serialized with {serializer!r}: {exc}"
        ) from exc


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
    """Canonical JSON text of ``value``: sorted keys, no whitespace, UTF-8, no NaN."""
    try:
        return _CANONICAL.encode(value)
    except (TypeError, ValueError) as exc:
        raise UnserializableArgumentsError(f"value has no canonical JSON form: {exc}") from exc


#: Characters that never appear in a bare ``local@domain`` address: with none of them, no parsing is needed.
_BARE_ADDRESS = frozenset('<>",;:()[] \\\t')


def normalize_address(text: str) -> str:
    """``"Ann <Ann@Example.COM>"`` -> ``"Ann@example.com"`` (the local part is case-sensitive)."""
    if text.count("@") == 1 and _BARE_ADDRESS.isdisjoint(text):
        local, _, domain = text.partition("@")  # a bare address: no parsing needed
        return f"{local}@{domain.lower()}"
    pairs = getaddresses([text])
    addr = pairs[0][1] if len(pairs) == 1 and pairs[0][1] else text
    addr = addr.strip()
    local, at, domain = addr.rpartition("@")
    return f"{local}@{domain.lower()}" if at else addr


def normalize_addresses(value: Any) -> Any:
    """Normalise one address or a list of them into a de-duplicated, sorted list.

    Values that are not strings or lists of strings are returned unchanged.
    """
    if isinstance(value, str):
        items: list[str] = [value]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        items = value
    else:
        return value
    found = set()
    for item in items:
        if item.count("@") == 1 and _BARE_ADDRESS.isdisjoint(item):
            found.add(normalize_address(item))
        else:
            found.update(normalize_address(addr) for _name, addr in getaddresses([item]) if addr)
    return sorted(found)


@dataclass(frozen=True)
class Payload:
    """The arguments of one task call, after the serializer round trip."""

    args: list[Any]
    kwargs: dict[str, Any]

    def to_json(self) -> str:
        """JSON text for the ledger; kombu's encoder keeps datetimes, decimals and UUIDs typed."""
        try:
            return str(json_dumps({"args": self.args, "kwargs": self.kwargs}))  # type: ignore[no-untyped-call]
        except (TypeError, ValueError) as exc:
            raise UnserializableArgumentsError(
                f"task arguments cannot be stored as JSON in the ledger: {exc}"
            ) from exc

    @classmethod
    def from_json(cls, text: str) -> Payload:
        data = json_loads(text)  # type: ignore[no-untyped-call]
        return cls(list(data["args"]), dict(data["kwargs"]))


@dataclass(frozen=True)
class IntentKeyBuilder:
    """Derives intent keys and fingerprints for one task.

    Built once per task from its options (see :class:`~idemmail_celery.IdempotentTask`);
    ``derive()`` is what ``apply_async`` calls in the caller and the worker calls
    when a message arrives without a key.
    """

    task_name: str
    signature: inspect.Signature
    spec: KeySpec = None
    tenant_field: str | None = None
    version: int = 1
    address_fields: frozenset[str] = field(default_factory=frozenset)
    must_match: tuple[str, ...] = ()
    serializer: str = "json"
    secret: bytes | None = None
    # Worked out once in __post_init__ for the hot path; not options.
    _plain: tuple[tuple[str, ...], frozenset[str], dict[str, Any]] | None = field(
        init=False, repr=False, compare=False, default=None)
    _untenanted: str = field(init=False, repr=False, compare=False, default="")
    _mac: Any = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
            raise IdempotencyKeyError(f"{self.task_name}: idempotency_version must be an int >= 1")
        params = self.signature.parameters
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        declared = list(self.must_match)
        if self.tenant_field:
            declared.append(self.tenant_field)
        if self.spec is not None and not callable(self.spec):
            if isinstance(self.spec, str):
                raise IdempotencyKeyError(
                    f"{self.task_name}: idempotency_key must be a tuple of argument names, "
                    f"not the string {self.spec!r} (did you mean ({self.spec!r},)?)"
                )
            if not self.spec:
                raise IdempotencyKeyError(f"{self.task_name}: idempotency_key names no argument")
            declared.extend(self.spec)
        for name in declared:
            if name not in params and not has_var_kw:
                raise IdempotencyKeyError(
                    f"{self.task_name}: idempotency option names {name!r}, which is not an "
                    f"argument of the task (arguments: {', '.join(params) or 'none'})"
                )
        object.__setattr__(self, "_plain", self._plain_signature())
        object.__setattr__(self, "_untenanted", self._namespace(None))
        # The keyed hash with the secret already absorbed: a copy per key costs less than a new HMAC.
        object.__setattr__(self, "_mac", hmac.new(self.secret, digestmod=hashlib.sha256) if self.secret else None)

    def _digest(self, material: str) -> str:
        """HMAC-SHA256 of ``material`` under this builder's secret; plain SHA-256 when there is none."""
        if self._mac is None:
            return hashlib.sha256(material.encode("utf-8")).hexdigest()
        mac = self._mac.copy()
        mac.update(material.encode("utf-8"))
        return str(mac.hexdigest())

    def _plain_signature(self) -> tuple[tuple[str, ...], frozenset[str], dict[str, Any]] | None:
        """For a signature of plain parameters (no ``*args``, ``**kw``, keyword-only): their names and
        their defaults after the serializer round trip, so that :meth:`bound` can skip ``Signature.bind``
        for a call that fits. None otherwise, or if a default cannot be serialized (``bind`` says so
        then, for a call that uses it)."""
        params = list(self.signature.parameters.values())
        if any(p.kind is not p.POSITIONAL_OR_KEYWORD for p in params):
            return None
        try:
            defaults = round_trip({p.name: p.default for p in params if p.default is not p.empty}, self.serializer)
        except UnserializableArgumentsError:
            return None
        names = tuple(p.name for p in params)
        return names, frozenset(names), dict(defaults)

    def payload(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> Payload:
        """The call's arguments as the worker will receive them."""
        arg_list, kwarg_dict = list(args or ()), dict(kwargs or {})
        call = [arg_list, kwarg_dict]
        rt = round_trip(call, self.serializer)
        if rt is call:  # plain JSON: the copies just made are what the worker will see
            return Payload(arg_list, kwarg_dict)
        return Payload(list(rt[0]), dict(rt[1]))

    def bound(self, payload: Payload) -> dict[str, Any]:
        """Arguments by name, defaults applied, as the worker will see them."""
        plain = self._plain
        if plain is not None:
            names, known, defaults = plain
            values = dict(zip(names, payload.args, strict=False))  # too many: bind() says so
            if len(payload.args) <= len(names) and all(k in known and k not in values for k in payload.kwargs):
                values.update(payload.kwargs)
                if len(values) < len(names):
                    for name in names:
                        if name not in values and name in defaults:
                            values[name] = defaults[name]
                if len(values) == len(names):  # else a missing or unknown argument: bind() names it
                    return values
        try:
            ba = self.signature.bind(*payload.args, **payload.kwargs)
        except TypeError as exc:
            raise IdempotencyKeyError(
                f"{self.task_name}: arguments do not match the task signature: {exc}"
            ) from exc
        given = set(ba.arguments)
        ba.apply_defaults()
        values = dict(ba.arguments)
        defaults = {name: v for name, v in values.items() if name not in given}
        if defaults:  # defaults never went through the serializer: send them through too
            values.update(round_trip(defaults, self.serializer))
        for p in self.signature.parameters.values():
            if p.kind is p.VAR_KEYWORD:  # **extra: flatten, so f(a=1) and f(**{"a": 1}) agree
                values.update(values.pop(p.name, {}))
        return values

    def intent_values(self, payload: Payload) -> dict[str, Any]:
        """The normalised values that make up the intent (everything except the namespace)."""
        return self._intent(self.bound(payload))

    def _intent(self, values: dict[str, Any]) -> dict[str, Any]:
        if self.spec is None:
            chosen = values
        else:
            missing = [n for n in self.spec if n not in values]  # type: ignore[union-attr]
            if missing:
                raise IdempotencyKeyError(
                    f"{self.task_name}: key field(s) {', '.join(missing)} missing from the call"
                )
            chosen = {n: values[n] for n in self.spec}  # type: ignore[union-attr]
        return self._normalised(chosen)

    def derive(
        self,
        payload: Payload,
        *,
        explicit: str | None = None,
        tenant: str | None = None,
    ) -> str:
        """The intent key for one call.

        ``explicit`` is a caller-chosen key (``apply_async(idempotency_key=...)``),
        namespaced and digested like a derived one. ``tenant`` overrides the
        task's tenant argument (the ``idempotency_tenant`` option/header).
        """
        values: dict[str, Any] | None = None
        if tenant is not None:
            tenant = str(tenant)
        elif self.tenant_field:
            values = self.bound(payload)
            found = values.get(self.tenant_field)
            tenant = None if found is None else str(found)
        # The material is canonical_json({"explicit" or "intent": ..., **namespace}); the namespace's
        # keys sort after both, so its text is encoded once per tenant and appended.
        if explicit is not None:
            if not isinstance(explicit, str) or not explicit:
                raise IdempotencyKeyError(f"{self.task_name}: idempotency_key must be a non-empty str")
            head = '{"explicit":' + canonical_json(explicit)
        elif callable(self.spec):
            made = self.spec(tuple(payload.args), dict(payload.kwargs))
            if not isinstance(made, str) or not made:
                raise IdempotencyKeyError(
                    f"{self.task_name}: the idempotency_key function returned {type(made).__name__}, "
                    "expected a non-empty str"
                )
            head = '{"explicit":' + canonical_json(made)
        else:
            head = '{"intent":' + canonical_json(self._intent(self.bound(payload) if values is None else values))
        tail = self._untenanted if tenant is None else self._namespace(tenant)
        return self._digest(head + tail)

    def _namespace(self, tenant: str | None) -> str:
        """``,"ns":…,"task":…,"tenant":…,"v":…}``: the rest of the canonical key material."""
        return "," + canonical_json({"ns": _NAMESPACE, "task": self.task_name, "tenant": tenant, "v": self.version})[1:]

    def fingerprint(self, payload: Payload) -> str:
        """Digest of the must-match fields' normalised values, which a later call must repeat.

        It covers those values only, so a duplicate is still checked after the ledger erased
        the first payload (on ``sent``), and a rewritten body or another spelling of the same
        address still replays. Empty for a task without must-match fields: nothing compares it.
        """
        if not self.must_match:
            return ""
        values = self._normalised(self.bound(payload))
        body: dict[str, Any] = {"must_match": {n: values.get(n) for n in self.must_match}}
        return self._digest(canonical_json(body))

    def mismatched_fields(self, first: Payload, later: Payload) -> tuple[str, ...]:
        """Must-match fields whose values differ between the first call and a later one."""
        if not self.must_match:
            return ()
        a, b = self._normalised(self.bound(first)), self._normalised(self.bound(later))
        return tuple(
            n for n in self.must_match if canonical_json(a.get(n)) != canonical_json(b.get(n))
        )

    def _normalised(self, values: dict[str, Any]) -> dict[str, Any]:
        return {
            name: normalize_addresses(v) if name in self.address_fields else v
            for name, v in values.items()
        }


def address_fields_for(signature: inspect.Signature, declared: Iterable[str] | None) -> frozenset[str]:
    """The argument names to normalise as addresses: as declared, or the usual names present."""
    if declared is not None:
        return frozenset(declared)
    return frozenset(n for n in DEFAULT_ADDRESS_FIELDS if n in signature.parameters)
