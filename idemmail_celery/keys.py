"""Intent keys, must-match fingerprints and the seal on the library's own chain headers.

What a key is made of: docs/guarantee.md ("Intent keys"); rotation and seals: docs/security.md. Changing
anything here changes keys and re-sends everything in flight: ``tests/test_keys.py`` pins golden vectors.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import inspect
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .chain import KEY_HEADER, KEY_MARK_HEADER, SEALED_HEADERS, intent_headers
from .email import parse_address
from .encoding import (
    RoundTrip,
    canonical_json,
    json_round_trip,
    sorted_typed_json,
    typed_json_dumps,
    typed_json_loads,
)
from .errors import ConfigurationError, IdempotencyKeyError, InvalidEmail, UnserializableArgumentsError

#: What a task may declare as ``idempotency_key``: nothing (all bound arguments), argument names, or a
#: function of ``(args, kwargs)`` returning a string.
KeySpec = Sequence[str] | Callable[[tuple[Any, ...], dict[str, Any]], str] | None

#: Names of arguments treated as email addresses when a task declares none.
DEFAULT_ADDRESS_FIELDS: tuple[str, ...] = ("to", "cc", "bcc", "reply_to", "from_", "sender")

_NAMESPACE = "idemmail/1"

#: Longest key a caller may choose (``idempotency_key=`` or the raw header).
MAX_EXPLICIT_KEY_LENGTH = 255
# A key travels as a message header and shows in logs: no control characters, line breaks, lone surrogates.
_BAD_IN_KEY = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_DERIVED_KEY = re.compile("[0-9a-f]{64}")
#: Characters that never appear in a bare ``local@domain`` address: with none of them, no parsing is needed.
_BARE_ADDRESS = frozenset('<>",;:()[] \\\t')


def normalize_address(text: str) -> str:
    """The form of an address keys compare: ``"Ann <Ann@Example.COM>"`` -> ``"Ann@example.com"`` (lenient if bad)."""
    if text.isascii() and text.count("@") == 1 and _BARE_ADDRESS.isdisjoint(text) and "xn--" not in text.lower():
        local, _, domain = text.partition("@")  # a bare ASCII address: nothing to parse or decode
        return f"{local}@{domain.lower()}"
    # Cached (email-validator takes ~30 us, and every retry repeats it); address-sized texts only.
    return _parsed(text) if len(text) <= 512 else _parsed.__wrapped__(text)


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> str:
    try:
        return parse_address(text)[1]
    except InvalidEmail:
        spec = text.strip()
        if spec.endswith(">") and "<" in spec:
            spec = spec[spec.rfind("<") + 1:-1].strip()
        local, at, domain = spec.rpartition("@")
        return f"{local}@{domain.lower()}" if at else spec


def normalize_addresses(value: Any) -> Any:
    """One address or a list of them (a string may hold several, comma-separated) as a sorted list of distinct
    :func:`normalize_address` forms; values that are not strings or lists of strings are returned unchanged."""
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
            found.update(normalize_address(part) for part in _split_commas(item) if part.strip())
    return sorted(found)


def _split_commas(text: str) -> list[str]:
    """``text`` cut at each comma outside double quotes and angle brackets."""
    parts, start, quoted, angled, escaped = [], 0, False, False, False
    for i, c in enumerate(text):
        if escaped:
            escaped = False
        elif quoted:
            escaped, quoted = c == "\\", c != '"'
        elif c == '"':
            quoted = True
        elif c in "<>":
            angled = c == "<"
        elif c == "," and not angled:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def check_explicit_key(value: Any) -> str:
    """A caller's own intent key, returned as given if it is a ``str`` of 1 to :data:`MAX_EXPLICIT_KEY_LENGTH`
    characters without control characters, line separators or lone surrogates; else :class:`IdempotencyKeyError`
    saying which rule it breaks (never quoting it)."""
    if not isinstance(value, str):
        raise IdempotencyKeyError(f"idempotency_key must be a str, not {type(value).__name__}")
    if not value.strip():
        raise IdempotencyKeyError("idempotency_key is empty")
    if len(value) > MAX_EXPLICIT_KEY_LENGTH:
        raise IdempotencyKeyError(f"idempotency_key is {len(value)} characters long, over {MAX_EXPLICIT_KEY_LENGTH}")
    bad = _BAD_IN_KEY.search(value)
    if bad:
        raise IdempotencyKeyError(f"idempotency_key contains U+{ord(bad.group()):04X}, a control character "
                                  "or line break")
    return value


def is_derived_key(value: Any) -> bool:
    """Is ``value`` shaped like a key this module made (64 lower-case hex digits)? Only a seal says who made it."""
    return isinstance(value, str) and _DERIVED_KEY.fullmatch(value) is not None


def _secret_list(secret: Any) -> tuple[bytes | None, ...]:
    """The builder's ``secret`` option as a tuple, newest first; ``None`` stands for plain SHA-256."""
    if secret is None or isinstance(secret, (bytes, str)):
        values: list[Any] = [secret]
    elif isinstance(secret, Sequence):
        values = list(secret)
    else:
        raise ConfigurationError(f"idemmail_key_secret must be bytes, str or a list of them, not "
                                 f"{type(secret).__name__}")
    if not values:
        raise ConfigurationError("idemmail_key_secret is an empty list")
    out: list[bytes | None] = []
    for v in values:
        if isinstance(v, str):
            v = v.encode("utf-8")
        if v is not None and not (isinstance(v, bytes) and v):
            raise ConfigurationError("every idemmail_key_secret must be a non-empty str or bytes (or None for "
                                     "keys made without a secret)")
        if v not in out:
            out.append(v)
    return tuple(out)


def secret_ids(secret: Any) -> tuple[str, ...]:
    """The public ids of the key secrets ``secret`` names, newest first (in seals and the key-secret roster)."""
    return tuple(_secret_id(s) for s in _secret_list(secret))


def _secret_id(secret: bytes | None) -> str:
    """A short public name of a key secret (``plain``: none): a digest, revealing no more than any key does."""
    if secret is None:
        return "plain"
    return hashlib.sha256(b"idemmail/secret-id\n" + secret).hexdigest()[:12]


class Seal(enum.Enum):
    """What :meth:`IntentKeyBuilder.check_seal` found."""

    #: Made by this library under one of the builder's secrets, for these headers and arguments.
    VALID = "valid"
    #: Made under a secret the builder does not have: a newer one (or a forgery naming one).
    UNKNOWN_SECRET = "unknown_secret"
    #: Not made for these headers and arguments under the secret it names: forged, copied or altered.
    INVALID = "invalid"
    #: No seal at all (a message sent by name).
    ABSENT = "absent"


def args_digest(payload: Payload) -> str:
    """SHA-256 of a call's arguments as the worker receives them (kombu's typed JSON, keys sorted)."""
    try:
        text = sorted_typed_json({"args": payload.args, "kwargs": payload.kwargs})
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnserializableArgumentsError(f"task arguments have no JSON form to seal: {exc}") from exc
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def untrusted_removed(headers: Mapping[str, Any], *, keep: tuple[str, ...] = (KEY_HEADER,)) -> dict[str, Any]:
    """``headers`` without the sealed headers and the seal, but for ``keep`` (by default a caller's own key)."""
    return {k: v for k, v in headers.items() if k in keep or (k not in SEALED_HEADERS and k != KEY_MARK_HEADER)}


@dataclass(frozen=True)
class Payload:
    """The arguments of one task call, after the serializer round trip."""

    args: list[Any]
    kwargs: dict[str, Any]

    def to_json(self) -> str:
        """JSON text for the ledger, in kombu's form: datetimes, decimals, UUIDs and bytes stay typed."""
        try:
            return typed_json_dumps({"args": self.args, "kwargs": self.kwargs})
        except (TypeError, ValueError, RecursionError) as exc:
            raise UnserializableArgumentsError(f"task arguments cannot be stored as JSON in the ledger: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> Payload:
        data = typed_json_loads(text)
        return cls(list(data["args"]), dict(data["kwargs"]))


_CURRENT: Any = object()  # "the builder's first secret", for _digest


@dataclass(frozen=True)
class IntentKeyBuilder:
    """Derives intent keys, fingerprints and seals for one task, built once from its options."""

    task_name: str
    signature: inspect.Signature
    spec: KeySpec = None
    tenant_field: str | None = None
    version: int = 1
    address_fields: frozenset[str] = field(default_factory=frozenset)
    must_match: tuple[str, ...] = ()
    serializer: str = "json"
    #: One secret, or several newest first (rotation): keys are made under the first; ``None`` is plain SHA-256.
    secret: bytes | str | Sequence[bytes | str | None] | None = None
    #: The task serializer's round trip (the Celery adapter passes kombu's); None: :func:`json_round_trip`.
    round_trip: RoundTrip | None = field(default=None, repr=False, compare=False)
    # Worked out once in __post_init__, for the hot path.
    _plain: tuple[tuple[str, ...], tuple[str, ...], frozenset[str], dict[str, Any]] | None = field(
        init=False, repr=False, compare=False, default=None)
    _untenanted: str = field(init=False, repr=False, compare=False, default="")
    _mac: Any = field(init=False, repr=False, compare=False, default=None)
    _older_macs: tuple[Any, ...] = field(init=False, repr=False, compare=False, default=())
    _all_macs: tuple[Any, ...] = field(init=False, repr=False, compare=False, default=())
    _kids: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())
    _round: Any = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
            raise IdempotencyKeyError(f"{self.task_name}: idempotency_version must be an int >= 1")
        if self.round_trip is None and self.serializer != "json":
            raise ConfigurationError(f"{self.task_name}: the {self.serializer!r} serializer needs its round trip "
                                     "(round_trip=); only 'json' has one here")
        object.__setattr__(self, "_round", self.round_trip or json_round_trip)
        params = self.signature.parameters
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        declared = list(self.must_match)
        if self.tenant_field:
            declared.append(self.tenant_field)
        if self.spec is not None and not callable(self.spec):
            if isinstance(self.spec, str):
                raise IdempotencyKeyError(f"{self.task_name}: idempotency_key must be a tuple of argument names, "
                                          f"not the string {self.spec!r} (did you mean ({self.spec!r},)?)")
            if not self.spec:
                raise IdempotencyKeyError(f"{self.task_name}: idempotency_key names no argument")
            declared.extend(self.spec)
        for name in declared:
            if name not in params and not has_var_kw:
                raise IdempotencyKeyError(f"{self.task_name}: idempotency option names {name!r}, which is not an "
                                          f"argument of the task (arguments: {', '.join(params) or 'none'})")
        object.__setattr__(self, "_plain", self._plain_signature())
        object.__setattr__(self, "_untenanted", self._namespace(None))
        # The secret already absorbed: a copy per key costs less than a new HMAC.
        secrets = _secret_list(self.secret)
        macs = tuple(None if s is None else hmac.new(s, digestmod=hashlib.sha256) for s in secrets)
        object.__setattr__(self, "_mac", macs[0])
        object.__setattr__(self, "_older_macs", macs[1:])
        object.__setattr__(self, "_all_macs", macs)
        object.__setattr__(self, "_kids", tuple(_secret_id(s) for s in secrets))

    def _digest(self, material: str, mac: Any = _CURRENT) -> str:
        """HMAC-SHA256 of ``material`` under ``mac`` (default: the first secret); plain SHA-256 for None."""
        if mac is _CURRENT:
            mac = self._mac
        if mac is None:
            return hashlib.sha256(material.encode("utf-8")).hexdigest()
        mac = mac.copy()
        mac.update(material.encode("utf-8"))
        return str(mac.hexdigest())

    def _plain_signature(self) -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str], dict[str, Any]] | None:
        """For plain parameters (no ``*args``, ``**kw``): positional names, all names, set of names and
        round-tripped defaults, so that :meth:`bound` can skip ``Signature.bind``; else None."""
        params = list(self.signature.parameters.values())
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        keyword_only = [inspect.Parameter.KEYWORD_ONLY] * (len(params) - len(positional))
        if [p.kind for p in params] != [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(positional) + keyword_only:
            return None
        try:
            defaults = self._round({p.name: p.default for p in params if p.default is not p.empty})
        except UnserializableArgumentsError:
            return None
        names = tuple(p.name for p in params)
        return tuple(positional), names, frozenset(names), dict(defaults)

    def payload(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> Payload:
        """The call's arguments as the worker will receive them."""
        arg_list, kwarg_dict = list(args or ()), dict(kwargs or {})
        call = [arg_list, kwarg_dict]
        rt = self._round(call)
        if rt is call:  # plain JSON: the copies just made are what the worker will see
            return Payload(arg_list, kwarg_dict)
        return Payload(list(rt[0]), dict(rt[1]))

    def bound(self, payload: Payload) -> dict[str, Any]:
        """Arguments by name, defaults applied, as the worker will see them."""
        plain = self._plain
        if plain is not None:
            positional, names, known, defaults = plain
            values = dict(zip(positional, payload.args, strict=False))  # too many: bind() says so
            if len(payload.args) <= len(positional) and all(k in known and k not in values for k in payload.kwargs):
                values.update(payload.kwargs)
                if len(values) < len(names):
                    values.update({name: defaults[name] for name in names if name not in values and name in defaults})
                if len(values) == len(names):  # else a missing or unknown argument: bind() names it
                    return values
        try:
            ba = self.signature.bind(*payload.args, **payload.kwargs)
        except TypeError as exc:
            raise IdempotencyKeyError(f"{self.task_name}: arguments do not match the task signature: {exc}") from exc
        given = set(ba.arguments)
        ba.apply_defaults()
        values = dict(ba.arguments)
        defaults = {name: v for name, v in values.items() if name not in given}
        if defaults:  # defaults never went through the serializer: send them through too
            values.update(self._round(defaults))
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
                raise IdempotencyKeyError(f"{self.task_name}: key field(s) {', '.join(missing)} missing from the call")
            chosen = {n: values[n] for n in self.spec}  # type: ignore[union-attr]
        return self._normalised(chosen)

    def derive(self, payload: Payload, *, explicit: str | None = None, tenant: str | None = None) -> str:
        """The intent key of a call (or of a caller's ``explicit`` key) under the first secret; ``tenant`` overrides
        the task's tenant argument."""
        return self._digest(self._material(payload, explicit, tenant))

    def older_keys(self, payload: Payload, *, explicit: str | None = None,
                   tenant: str | None = None) -> tuple[str, ...]:
        """The keys :meth:`derive` gave the call under each older secret, newest first (one secret: none)."""
        if not self._older_macs:
            return ()
        material = self._material(payload, explicit, tenant)
        return tuple(self._digest(material, mac) for mac in self._older_macs)

    def explicit_key(self, raw: Any, *, tenant: str | None = None) -> str:
        """A caller's own key as the ledger key: :meth:`derive` with ``explicit=``, but the task's tenant argument
        is not read (a raw header has only the header's tenant)."""
        return self._digest(self._explicit_head(raw) + self._tail(None if tenant is None else str(tenant)))

    def older_explicit_keys(self, raw: Any, *, tenant: str | None = None) -> tuple[str, ...]:
        """The keys :meth:`explicit_key` gave ``raw`` under each older secret, newest first (one secret: none)."""
        if not self._older_macs:
            return ()
        material = self._explicit_head(raw) + self._tail(None if tenant is None else str(tenant))
        return tuple(self._digest(material, mac) for mac in self._older_macs)

    def _explicit_head(self, raw: Any) -> str:
        try:
            return '{"explicit":' + canonical_json(check_explicit_key(raw))
        except IdempotencyKeyError as exc:
            raise IdempotencyKeyError(f"{self.task_name}: {exc}") from None

    def _tail(self, tenant: str | None) -> str:
        return self._untenanted if tenant is None else self._namespace(tenant)

    def _material(self, payload: Payload, explicit: Any, tenant: str | None) -> str:
        values: dict[str, Any] | None = None
        if tenant is not None:
            tenant = str(tenant)
        elif self.tenant_field:
            values = self.bound(payload)
            found = values.get(self.tenant_field)
            tenant = None if found is None else str(found)
        # canonical_json({"explicit" or "intent": ..., **namespace}): the namespace's keys sort last, so its
        # text is encoded once per tenant and appended.
        if explicit is not None:
            head = self._explicit_head(explicit)
        elif callable(self.spec):
            made = self.spec(tuple(payload.args), dict(payload.kwargs))
            if not isinstance(made, str) or not made:
                raise IdempotencyKeyError(f"{self.task_name}: the idempotency_key function returned "
                                          f"{type(made).__name__}, expected a non-empty str")
            head = '{"explicit":' + canonical_json(made)
        else:
            head = '{"intent":' + canonical_json(self._intent(self.bound(payload) if values is None else values))
        return head + self._tail(tenant)

    def _namespace(self, tenant: str | None) -> str:
        """``,"ns":…,"task":…,"tenant":…,"v":…}``: the rest of the canonical key material."""
        return "," + canonical_json({"ns": _NAMESPACE, "task": self.task_name, "tenant": tenant, "v": self.version})[1:]

    def seal(self, headers: Mapping[str, Any], payload: Payload, *, task_name: str | None = None) -> str:
        """The seal of a message's chain headers: a keyed digest of the task name, the arguments and every sealed
        header, prefixed with the secret's id (without a secret it stops mistakes, not forgeries)."""
        return f"{self._kids[0]}:{self._digest(self._seal_material(headers, payload, task_name))}"

    def check_seal(self, headers: Mapping[str, Any], payload: Payload, *, task_name: str | None = None) -> Seal:
        """Did :meth:`seal`, under any of the builder's secrets, make the message's seal for these headers and
        arguments? :attr:`Seal.UNKNOWN_SECRET`: under a secret this builder does not have (a newer one)."""
        mark = headers.get(KEY_MARK_HEADER)
        if mark is None:
            return Seal.ABSENT
        if not isinstance(mark, str) or not mark.isascii() or ":" not in mark:
            return Seal.INVALID
        kid, _, digest = mark.partition(":")
        if kid not in self._kids:
            return Seal.UNKNOWN_SECRET
        mac = self._all_macs[self._kids.index(kid)]
        try:
            material = self._seal_material(headers, payload, task_name)
        except (UnserializableArgumentsError, TypeError, ValueError):
            return Seal.INVALID
        return Seal.VALID if hmac.compare_digest(digest, self._digest(material, mac)) else Seal.INVALID

    def sealed(self, headers: dict[str, Any], payload: Payload) -> dict[str, Any]:
        """``headers`` with their :meth:`seal` for the call ``payload`` (in place; returned), set last."""
        headers[KEY_MARK_HEADER] = self.seal(headers, payload)
        return headers

    def intent_headers(self, payload: Payload, *, explicit: str | None = None, tenant: str | None = None,
                       due: float | None = None) -> dict[str, Any]:
        """The sealed headers of a new intent for the (validated) call ``payload``: its key, its older keys
        during a rotation, the enqueue time and ``due`` (when a countdown or ETA lets it run)."""
        key = self.derive(payload, explicit=explicit, tenant=tenant)
        older = self.older_keys(payload, explicit=explicit, tenant=tenant)  # () unless rotating
        return self.sealed(intent_headers(key, older, enqueued_at=time.time(), due_at=due, tenant=tenant), payload)

    def call_headers(self, args: Any, kwargs: Any, headers: Mapping[str, Any], *,
                     validate: Callable[[Any, Any], Payload], explicit: str | None = None, tenant: str | None = None,
                     due: float | None = None) -> dict[str, Any]:
        """The headers ``apply_async`` enqueues a call with: a key the library sealed travels as it is, any other is
        the caller's own (like ``explicit``) and copied chain headers are dropped; ``validate`` raises on bad input."""
        carried = headers.get(KEY_HEADER)
        if explicit is None and carried is not None:
            seal = self.check_seal(headers, self.payload(args, kwargs))
            if seal is Seal.VALID:
                return dict(headers)
            if seal is Seal.UNKNOWN_SECRET:
                validate(args, kwargs)
                return dict(headers)
            explicit = carried  # 64 hex digits too: checked and hashed, never trusted as it is
        payload = validate(args, kwargs)
        return {**untrusted_removed(headers, keep=()),
                **self.intent_headers(payload, explicit=explicit, tenant=tenant, due=due)}

    def _seal_material(self, headers: Mapping[str, Any], payload: Payload, task_name: str | None) -> str:
        # Never starts with "{" as key and fingerprint material do: no seal is ever a key.
        sealed = {name: headers[name] for name in SEALED_HEADERS if headers.get(name) is not None}
        return f"idemmail/seal\n{task_name or self.task_name}\n{args_digest(payload)}\n{canonical_json(sealed)}"

    def fingerprint(self, payload: Payload) -> str:
        """Digest of the must-match fields' normalised values ("" without any); it outlives the stored payload."""
        if not self.must_match:
            return ""
        return self._digest(self._fingerprint_material(payload))

    def fingerprint_matches(self, stored: str, payload: Payload) -> bool:
        """Does a record's ``stored`` fingerprint match this call's under any secret (always, without must-match)?"""
        if not self.must_match:
            return True
        material = self._fingerprint_material(payload)
        return any(hmac.compare_digest(stored, self._digest(material, mac)) for mac in self._all_macs)

    def _fingerprint_material(self, payload: Payload) -> str:
        values = self._normalised(self.bound(payload))
        return canonical_json({"must_match": {n: values.get(n) for n in self.must_match}})

    def mismatched_fields(self, first: Payload, later: Payload) -> tuple[str, ...]:
        """Must-match fields whose values differ between the first call and a later one."""
        if not self.must_match:
            return ()
        a, b = self._normalised(self.bound(first)), self._normalised(self.bound(later))
        return tuple(n for n in self.must_match if canonical_json(a.get(n)) != canonical_json(b.get(n)))

    def _normalised(self, values: dict[str, Any]) -> dict[str, Any]:
        return {name: normalize_addresses(v) if name in self.address_fields else v for name, v in values.items()}


def address_fields_for(signature: inspect.Signature, declared: Iterable[str] | None) -> frozenset[str]:
    """The argument names to normalise as addresses: as declared, or the usual names present."""
    if declared is not None:
        return frozenset(declared)
    return frozenset(n for n in DEFAULT_ADDRESS_FIELDS if n in signature.parameters)
