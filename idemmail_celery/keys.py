"""Intent keys and must-match fingerprints.

An *intent* is what a task call means ("send the confirmation for order 4821 to
ann@example.com"), as opposed to a message or a task id, of which one intent may
have many. The intent key is a digest of that meaning:

1. the arguments are bound to the task's signature (so positional and keyword
   calls, and defaults, agree) and passed through the task serializer's round
   trip (so tuples become lists in the caller exactly as they do in the worker);
2. the declared fields are picked (all bound arguments when none are declared),
   email addresses are normalised by :func:`normalize_address` (display names
   dropped, domain lower-cased and in Unicode, local part NFC; recipient lists
   de-duplicated and sorted);
3. the values are written as canonical JSON (sorted keys, no whitespace, a float
   with an integral value written as the integer: ``1.0`` is ``1``) inside a
   namespace of task name, tenant and version;
4. that text is digested with HMAC-SHA256 under ``idemmail_key_secret``, or
   plain SHA-256 when no secret is set (then a key can be brute-forced back to
   a guessable address and order id: set a secret in production).

A caller's own key (``apply_async(idempotency_key=...)``, or a raw
``idempotency_key`` message header) is checked by :func:`check_explicit_key` and
goes through steps 3 and 4 the same way (:meth:`IntentKeyBuilder.explicit_key`).
A key the library itself puts on a message travels with a *seal*
(:meth:`IntentKeyBuilder.seal`: a keyed digest of the task name, the arguments and
every header the worker acts on), which is how ``apply_async`` and the worker tell
it from a caller's header, and how the worker tells its own chain headers (owner,
verdict, counters) from forged or copied ones.

**Secret rotation.** The builder takes several secrets, newest first: keys are
derived under the first, and :meth:`IntentKeyBuilder.older_keys` gives what the
same call's key was under each older one (``None`` among them: plain SHA-256,
for moving off "no secret"), so a claim can find records made before the
rotation; :meth:`IntentKeyBuilder.fingerprint_matches` does the same for
must-match fingerprints. With one secret they cost nothing.

Arguments pass through the task serializer's round trip (step 1). For JSON this module
does it itself, in kombu's form (datetimes, dates, times, decimals, UUIDs and bytes stay
typed; :func:`json_round_trip`), and stores payloads in the ledger in the same form
(:meth:`Payload.to_json`), so the state machine never needs Celery; the Celery adapter
passes kombu's own round trip (``round_trip=``), which also covers other serializers and
types registered with kombu.

The key is 64 lower-case hex characters and carries no raw argument values.
Changing anything in this module changes keys, which would re-send everything
in flight after an upgrade: ``tests/test_keys.py`` pins golden vectors.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import inspect
import json
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .chain import KEY_HEADER, KEY_MARK_HEADER, SEALED_HEADERS, intent_headers
from .email import parse_address
from .encoding import RoundTrip, _TypedEncoder, canonical_json, json_round_trip, typed_json_dumps, typed_json_loads
from .errors import ConfigurationError, IdempotencyKeyError, InvalidEmail, UnserializableArgumentsError

#: What a task may declare as ``idempotency_key``: nothing (all bound arguments),
#: argument names, or a function of ``(args, kwargs)`` returning a string.
KeySpec = Sequence[str] | Callable[[tuple[Any, ...], dict[str, Any]], str] | None

#: Names of arguments treated as email addresses when a task declares none.
DEFAULT_ADDRESS_FIELDS: tuple[str, ...] = ("to", "cc", "bcc", "reply_to", "from_", "sender")

_NAMESPACE = "idemmail/1"

#: Longest key a caller may choose (``idempotency_key=`` or the raw header).
MAX_EXPLICIT_KEY_LENGTH = 255
# Control characters, Unicode line/paragraph separators, lone surrogates: a key travels as a
# message header and shows in logs, so it may hold none of them.
_BAD_IN_KEY = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_DERIVED_KEY = re.compile("[0-9a-f]{64}")


#: Characters that never appear in a bare ``local@domain`` address: with none of them, no parsing is needed.
_BARE_ADDRESS = frozenset('<>",;:()[] \\\t')


def normalize_address(text: str) -> str:
    """The one form of an address keys and de-duplication compare: ``"Ann <Ann@Example.COM>"`` -> ``"Ann@example.com"``.

    Two spellings of one mailbox give the same string: the display name is dropped, the
    domain lower-cased and written in Unicode (``xn--`` labels decoded), the local part put
    in Unicode NFC and otherwise kept as it is (RFC 5321: it may be case-sensitive). Parsed
    by :func:`idemmail_celery.email.parse_address`, the same on every Python version. Text
    that is not one valid address is read leniently (what is inside ``<...>``, the part
    after the last ``@`` lower-cased), so its spellings still agree; it never equals a valid
    address's form. Use it to de-duplicate recipients (two entries with the same form would
    claim the same intent key).
    """
    if text.isascii() and text.count("@") == 1 and _BARE_ADDRESS.isdisjoint(text) and "xn--" not in text.lower():
        local, _, domain = text.partition("@")  # a bare ASCII address: nothing to parse or decode
        return f"{local}@{domain.lower()}"
    # Cached: the caller, the worker and every retry normalise the same display forms, and
    # email-validator takes ~30 us. Only address-sized texts, so the cache stays small.
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
    """Normalise one address or a list of them into a de-duplicated, sorted list.

    A string with commas outside quotes and angle brackets counts as several addresses
    (``send_email`` refuses such strings; other tasks' keys keep reading them so). Empty
    entries are dropped. Values that are not strings or lists of strings are returned unchanged.
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
    """A caller's own intent key (``idempotency_key=``, or a raw ``idempotency_key`` header), checked.

    It must be a ``str`` of 1 to :data:`MAX_EXPLICIT_KEY_LENGTH` characters without control
    characters, line separators or lone surrogates; :class:`IdempotencyKeyError` says which rule
    it breaks (never quoting it). It is then namespaced and hashed like a derived key
    (:meth:`IntentKeyBuilder.explicit_key`): whatever the caller chose never reaches the ledger,
    a log or a metric as given.
    """
    if not isinstance(value, str):
        raise IdempotencyKeyError(f"idempotency_key must be a str, not {type(value).__name__}")
    if not value.strip():
        raise IdempotencyKeyError("idempotency_key is empty")
    if len(value) > MAX_EXPLICIT_KEY_LENGTH:
        raise IdempotencyKeyError(
            f"idempotency_key is {len(value)} characters long, over {MAX_EXPLICIT_KEY_LENGTH}")
    bad = _BAD_IN_KEY.search(value)
    if bad:
        raise IdempotencyKeyError(f"idempotency_key contains U+{ord(bad.group()):04X}, a control character "
                                  "or line break")
    return value


def is_derived_key(value: Any) -> bool:
    """Is ``value`` shaped like a key this module made (64 lower-case hex digits)?

    The shape alone does not say who put it on a message (a caller may choose such a key, or copy
    one from a Message-ID): only a valid seal (:meth:`IntentKeyBuilder.check_seal`) does.
    """
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
    """The public ids of the key secrets ``secret`` names (the builder's ``secret`` option), newest first:
    what a seal names its secret by, and what a worker puts in its ledger's key-secret roster."""
    return tuple(_secret_id(s) for s in _secret_list(secret))


def _secret_id(secret: bytes | None) -> str:
    """A short public name of a key secret, so that a seal says which secret made it (``plain``: none).

    A digest of the secret: it reveals no more than any keyed digest the secret makes (a weak secret can
    be guessed from a known key either way; see docs/security.md)."""
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
        text = json.dumps({"args": payload.args, "kwargs": payload.kwargs}, cls=_TypedEncoder, sort_keys=True,
                          separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnserializableArgumentsError(f"task arguments have no JSON form to seal: {exc}") from exc
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def untrusted_removed(headers: Mapping[str, Any], *, keep: tuple[str, ...] = (KEY_HEADER,)) -> dict[str, Any]:
    """``headers`` without what only a valid seal vouches for (:data:`~idemmail_celery._common.SEALED_HEADERS`
    and the seal), but for ``keep`` (by default the key: a caller's own, to be checked and hashed)."""
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
            raise UnserializableArgumentsError(
                f"task arguments cannot be stored as JSON in the ledger: {exc}"
            ) from exc

    @classmethod
    def from_json(cls, text: str) -> Payload:
        data = typed_json_loads(text)
        return cls(list(data["args"]), dict(data["kwargs"]))


_CURRENT: Any = object()  # "the builder's first secret", for _digest


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
    #: One secret, or several newest first (rotation): keys are made under the first; ``None``
    #: (alone or among the older ones) is plain SHA-256, no secret.
    secret: bytes | str | Sequence[bytes | str | None] | None = None
    #: The task serializer's round trip (:data:`RoundTrip`); the Celery adapter passes kombu's.
    #: None: :func:`json_round_trip`, which only a ``"json"`` serializer may use.
    round_trip: RoundTrip | None = field(default=None, repr=False, compare=False)
    # Worked out once in __post_init__ for the hot path; not options.
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
        secrets = _secret_list(self.secret)
        macs = tuple(None if s is None else hmac.new(s, digestmod=hashlib.sha256) for s in secrets)
        object.__setattr__(self, "_mac", macs[0])
        object.__setattr__(self, "_older_macs", macs[1:])
        object.__setattr__(self, "_all_macs", macs)
        object.__setattr__(self, "_kids", tuple(_secret_id(s) for s in secrets))

    def _through(self, value: Any) -> Any:
        """``value`` as the worker will see it, after the task serializer's round trip."""
        return self._round(value)

    def _digest(self, material: str, mac: Any = _CURRENT) -> str:
        """HMAC-SHA256 of ``material`` under this builder's (first) secret; plain SHA-256 when there is none."""
        if mac is _CURRENT:
            mac = self._mac
        if mac is None:
            return hashlib.sha256(material.encode("utf-8")).hexdigest()
        mac = mac.copy()
        mac.update(material.encode("utf-8"))
        return str(mac.hexdigest())

    def _plain_signature(self) -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str], dict[str, Any]] | None:
        """For a signature of plain parameters (positional-or-keyword, then keyword-only; no ``*args``
        or ``**kw``): the names a positional argument can take, all names, and the defaults after the
        serializer round trip, so that :meth:`bound` can skip ``Signature.bind`` for a call that fits.
        None otherwise, or if a default cannot be serialized (``bind`` says so then, for a call that
        uses it)."""
        params = list(self.signature.parameters.values())
        kinds = [p.kind for p in params]
        keyword_only = inspect.Parameter.KEYWORD_ONLY
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        if kinds != [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(positional) + [keyword_only] * (
                len(params) - len(positional)):
            return None
        try:
            defaults = self._through({p.name: p.default for p in params if p.default is not p.empty})
        except UnserializableArgumentsError:
            return None
        names = tuple(p.name for p in params)
        return tuple(positional), names, frozenset(names), dict(defaults)

    def payload(self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None) -> Payload:
        """The call's arguments as the worker will receive them."""
        arg_list, kwarg_dict = list(args or ()), dict(kwargs or {})
        call = [arg_list, kwarg_dict]
        rt = self._through(call)
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
            values.update(self._through(defaults))
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
        """The intent key for one call, under the first secret.

        ``explicit`` is a caller-chosen key (``apply_async(idempotency_key=...)``), checked by
        :func:`check_explicit_key`, namespaced and digested like a derived one. ``tenant``
        overrides the task's tenant argument (the ``idempotency_tenant`` option/header).
        """
        return self._digest(self._material(payload, explicit, tenant))

    def older_keys(
        self,
        payload: Payload,
        *,
        explicit: str | None = None,
        tenant: str | None = None,
    ) -> tuple[str, ...]:
        """The keys :meth:`derive` gave the same call under each older secret, newest first.

        Empty, without any work, when the builder has one secret: a claim looks these up
        only during a rotation, so that an intent recorded before it is not sent again.
        """
        if not self._older_macs:
            return ()
        material = self._material(payload, explicit, tenant)
        return tuple(self._digest(material, mac) for mac in self._older_macs)

    def explicit_key(self, raw: Any, *, tenant: str | None = None) -> str:
        """A caller's own key (``idempotency_key=``, a raw ``idempotency_key`` header) as the ledger key.

        Checked by :func:`check_explicit_key` (:class:`IdempotencyKeyError`), then namespaced
        (task, ``tenant`` as given, version) and digested like :meth:`derive` with ``explicit=``.
        Unlike :meth:`derive`, a task's tenant argument is not read (a worker hashing a raw
        header has only the header's tenant): for a task with ``idempotency_tenant`` the two
        agree when ``tenant`` is given. :meth:`older_explicit_keys` gives its forms under older secrets.
        """
        return self._digest(self._explicit_head(raw) + self._tail(None if tenant is None else str(tenant)))

    def older_explicit_keys(self, raw: Any, *, tenant: str | None = None) -> tuple[str, ...]:
        """The keys :meth:`explicit_key` gave ``raw`` under each older secret, newest first.

        Empty, without any work, with one secret (see :meth:`older_keys`).
        """
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
        # The material is canonical_json({"explicit" or "intent": ..., **namespace}); the namespace's
        # keys sort after both, so its text is encoded once per tenant and appended.
        if explicit is not None:
            head = self._explicit_head(explicit)
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
        return head + self._tail(tenant)

    def _namespace(self, tenant: str | None) -> str:
        """``,"ns":…,"task":…,"tenant":…,"v":…}``: the rest of the canonical key material."""
        return "," + canonical_json({"ns": _NAMESPACE, "task": self.task_name, "tenant": tenant, "v": self.version})[1:]

    def seal(self, headers: Mapping[str, Any], payload: Payload, *, task_name: str | None = None) -> str:
        """The seal of a message's chain headers: what says this library wrote them, for this call.

        A keyed digest, under the first secret, of the task name (``task_name``, else the builder's),
        a digest of the arguments (:func:`args_digest`) and the canonical JSON of every header in
        :data:`~idemmail_celery._common.SEALED_HEADERS` the message carries (the intent key, the older
        keys, the counters, the enqueue time, the owner, the verdict, the campaign's pass state: all of
        them as one text, whatever fields their values hold). It travels as ``idemmail_key_mark``,
        prefixed with the secret's id (:meth:`check_seal` tells a secret it does not have from a forgery).
        Only the library's own publish points seal (``apply_async`` for a key it derived, the worker's
        retries and reschedules, a campaign's next pass); what a caller passes is never sealed as it is.
        Without a secret the seal is plain SHA-256: it tells the library's messages from a caller's
        mistakes, not from forgeries.
        """
        return f"{self._kids[0]}:{self._digest(self._seal_material(headers, payload, task_name))}"

    def check_seal(self, headers: Mapping[str, Any], payload: Payload, *, task_name: str | None = None) -> Seal:
        """Did :meth:`seal` (under the current secret or an older one) make the message's seal for these
        headers and arguments? :attr:`Seal.UNKNOWN_SECRET`: made under a secret this builder does not have
        (a newer one, during a rotation deployed web processes first)."""
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
        """``headers`` with their :meth:`seal` for the call ``payload`` (in place; returned): what every publish
        point of the library does last, after each header the worker acts on is set."""
        headers[KEY_MARK_HEADER] = self.seal(headers, payload)
        return headers

    def intent_headers(self, payload: Payload, *, explicit: str | None = None, tenant: str | None = None,
                       due: float | None = None) -> dict[str, Any]:
        """The sealed headers of a new intent for the call ``payload`` (validated by the caller): its key
        (derived, or ``explicit`` namespaced and hashed), its forms under older secrets during a rotation,
        the enqueue time and ``due`` (when a countdown or ETA lets it run), as :func:`~idemmail_celery.chain.
        intent_headers` spells them."""
        key = self.derive(payload, explicit=explicit, tenant=tenant)
        older = self.older_keys(payload, explicit=explicit, tenant=tenant)  # () unless rotating
        return self.sealed(intent_headers(key, older, enqueued_at=time.time(), due_at=due, tenant=tenant), payload)

    def call_headers(self, args: Any, kwargs: Any, headers: Mapping[str, Any], *,
                     validate: Callable[[Any, Any], Payload], explicit: str | None = None, tenant: str | None = None,
                     due: float | None = None) -> dict[str, Any]:
        """The headers a call is enqueued with (``apply_async``), from the ones the caller passed.

        A key the library sealed for these very arguments travels as it is: it was validated when it was
        derived. One sealed under a secret this process does not have (a rotation) travels too, but its
        arguments are validated (``validate``, the task's check: nothing vouches for them here). Any other
        carried key is the caller's own, like ``explicit``: the call is validated and a new intent derived
        from it, every chain header the caller copied from another message dropped. ``validate`` raises on
        bad input and returns the arguments as the worker will see them.
        """
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
        # Never canonical JSON alone (key and fingerprint material start with "{"): no seal is ever a key.
        sealed = {name: headers[name] for name in SEALED_HEADERS if headers.get(name) is not None}
        return f"idemmail/seal\n{task_name or self.task_name}\n{args_digest(payload)}\n{canonical_json(sealed)}"

    def _made_from(self, digest: str, material: str) -> bool:
        """Is ``digest`` the digest of ``material`` under the current secret or an older one?"""
        if hmac.compare_digest(digest, self._digest(material)):
            return True
        return any(hmac.compare_digest(digest, self._digest(material, mac)) for mac in self._older_macs)

    def fingerprint(self, payload: Payload) -> str:
        """Digest of the must-match fields' normalised values, which a later call must repeat.

        It covers those values only, so a duplicate is still checked after the ledger erased
        the first payload (on ``sent``), and a rewritten body or another spelling of the same
        address still replays. Empty for a task without must-match fields: nothing compares it.
        """
        if not self.must_match:
            return ""
        return self._digest(self._fingerprint_material(payload))

    def fingerprint_matches(self, stored: str, payload: Payload) -> bool:
        """Does a record's ``stored`` fingerprint match this call's, under the current or an older secret?

        What a must-match check compares during a rotation: a record made under an older
        secret holds that secret's fingerprint. True for a task without must-match fields.
        """
        if not self.must_match:
            return True
        return self._made_from(stored, self._fingerprint_material(payload))

    def _fingerprint_material(self, payload: Payload) -> str:
        values = self._normalised(self.bound(payload))
        return canonical_json({"must_match": {n: values.get(n) for n in self.must_match}})

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
