"""Redis ledger: ``redis://``, ``rediss://``, ``redis+cluster://`` and ``sentinel://``.

A record in progress is a hash, a sent one an entry in an archive hash; every transition is one
Lua script (``ledger/lua/*.lua``, registered with the client's script support and called with
EVALSHA, loaded again on NOSCRIPT), so a claim, a completion or a replay is one atomic round trip.
Lease times come from the Redis server's clock (``TIME``), so worker clocks do
not have to agree.

**Buckets.** Keys are spread over ``buckets`` hash-tagged buckets (16 by default)
so that every script touches keys of one hash slot, as Redis Cluster requires::

    <prefix>:{<bb>}:r:<packed key>   a record not yet sent, or sent and kept longer than the archives reach (a hash)
    <prefix>:{<bb>}:p:<packed key>   its first payload (a string; gone on sent unless keep_payload)
    <prefix>:{<bb>}:s:<granule>      the bucket's sent records of one time granule (a hash; expires)
    <prefix>:{<bb>}:i:<state>        the bucket's index of claimed, released, failed or review records
    <prefix>:{<bb>}:c:sent           the bucket's count of sent records, by expiry (a hash)
    <prefix>:{<bb>}:h:<digest>       a reschedule's mark (see ``mark_hop``; expires)
    <prefix>:{<bb>}:epoch            the bucket's epoch marker (a hash)

``bb`` is the bucket number in two hex digits, chosen by CRC32 of the intent key.
On one Redis the buckets cost nothing on the hot path; listing, stats and purge
visit every bucket.

**A record in progress** (``claimed``, ``released``, ``failed``, ``review``) is a hash of its own:
short field names (see ``lua/prelude.lua``), times as integer microseconds, a 64-hex key packed in
43 base64url characters in its name, a 64-hex fingerprint in 37 base-126 ASCII characters (anything
else as ``~`` + itself), the owner, task name, result and error in chunks of at most 64 bytes, and
the payload in a string of its own: every value within Redis's ``hash-max-listpack-value``, so
the hash stays compact (listpack).

**A sent record has no key of its own** (layout 3). Most records are ``sent`` and stay for the
retention, and any key with a TTL costs Redis about 150 bytes before its first byte of data (the
key object, its dictionary entry, its expiry entry). So the completion that makes a record
``sent`` moves it, in the same script, into its bucket's *archive* of the time granule it was sent
in (``s:<granule>``, the granule number by the server's clock), and deletes its hash and payload.
An archive is one hash: field the key's 32 bytes (a 64-hex key; anything else ``~`` + itself),
value one string: expiry, token, attempts and reclaims (each only when not the usual 1, 1, 0), the
fingerprint (its 37 characters, copied as they are), and the result with its message id stored once
(a UUID packed in 22 characters; ``send_email``'s ``value`` repeating the message id is rebuilt on
read; anything else as JSON). Task name, owner and the time of the first claim are not kept: nothing
reads them once the intent is sent (a duplicate is told the result, a must-match check reads the
fingerprint, ``forget`` rewrites the result; attempts and reclaims stay for operators). The archive
expires by itself at its granule's end plus the ledger's retention, so no entry is ever visited to
be deleted; an entry counts, replays and lists only until its own expiry.
Fields are bytes, not text: read an archive through the ledger (or a client that does not decode
replies); the listing's script replies with them in hex.

A claim that finds no record looks in the bucket's live archives, newest first (one ``HGET``
each, inside the same script): the ledger's retention over the granule, plus one or two. The
granule is a trade-off, fixed in the markers when the ledger is created (``archive_ms``, from the
creating process's retention, kept in ``retention_ms``): retention / 8, within 1 s .. 1 day. A
smaller granule means more lookups per new claim; a larger one keeps spent entries in memory
longer (up to one granule past their expiry, 1/16 of the retention on average). Every key a
script touches must be named in KEYS (Redis Cluster), so the caller names the archives from its
own clock, a skew's worth wider either side, and the script checks them against the server's
``TIME``: a claim whose names miss a live granule writes nothing and answers ``clock``, and the
process follows the server's clock from then on. A completion writes into the granule of the
server's clock; if the caller did not name it, or if the record's retention is longer than the
ledger's (the archives would not be looked in that far back), the record stays a hash of its own
with a TTL, as in layout 2, which every claim still reads first. An operator's change
(``resolve``, ``confirm_sent``, ``_force``) writes a hash of its own too, taking a record out of
its archive: rare, and what the caller gets back is exactly what the store holds.

Measured (``python -m bench.memory``, 100,000 ``send_email`` records as workers write them, see
docs/benchmarks.md): 191 bytes each in ``INFO memory`` (178 by ``MEMORY USAGE``), 175 with a
result of the message id alone, from 553 and 425 in layout 2 (a key of its own per record, with
a TTL); about 13 µs more Redis CPU per send (the claim's lookups, the entry's building).
``stats`` still reads the per-bucket counters (``HLEN`` of the archives would count spent entries
up to a granule late), which count a record until its expiry's granule ends (at most 1% of the
retention late).

**Loss detection.** A Redis without persistence can be flushed or restart
empty, silently reopening every key. Each bucket holds an epoch marker; every
script is handed the epoch this process read at first use (a worker reads it in
its main process at start, see :meth:`RedisLedger.prepare`) and refuses, writing
nothing, when the bucket's marker is missing, different, or flagged lost. The
process then reads every marker again: an epoch an operator acknowledged (``ledger
ack-loss``) is adopted; anything else raises :class:`LedgerLostError` (a
:class:`LedgerUnavailableError`, so tasks fail closed and retry) and flags every
marker lost, so processes that start later stop too. A process that has seen a
loss remembers it: from then on it accepts only an epoch an operator acknowledged,
never a "new" store (emptied again, flags and all) nor an unacknowledged fresh
epoch. What is detected and what is not is in :meth:`RedisLedger.loss_status` and
docs/operations.md ("Ledger loss").

Operator tools and the metrics scrape build the ledger ``passive``: they read the
markers and never write them (no ``auto_init``, no lost flags); only
:meth:`~RedisLedger.init_store` and :meth:`~RedisLedger.acknowledge_loss` do.

**Old layouts.** Versions before the buckets kept ``<prefix>:r:<key>`` and
``<prefix>:i:<state>``. This version would not see those records, so at first use
it looks for the old index keys and refuses (:class:`UnsafeLedgerError`) if any exist.
Later layouts are told by the epoch markers' ``layout`` (none: layout 1, long field names and a
``sent`` index; ``2``: every record a hash of its own, ``sent`` ones with a TTL; ``3``: this one,
sent records archived). This version refuses any other layout at first use, naming the step: stop
the workers and run :meth:`RedisLedger.migrate_layout` once, which rewrites layout 1 records in
place (keeping state, token, lease and TTL) and marks the layout; layout 2 records need no
rewriting (this layout reads a ``sent`` hash with a TTL as layout 2 wrote it, and they expire
by themselves). A layout 2 worker refuses a layout 3 store the same way, so no older worker ever
claims a key whose ``sent`` record it could not see in an archive (it would send again).
Refusing, rather than reading every layout, keeps every script single-minded.

The store must not evict keys: an evicted ``sent`` record reopens its key and
the next duplicate sends again. At first use the ledger reads
``maxmemory-policy`` and refuses anything but ``noeviction`` unless built with
``allow_eviction=True``; the claim path reads it again every ``policy_recheck_seconds``
(30 s), so a policy changed at runtime is refused too, until it is set back. Run Redis
with AOF persistence for the same reason: a worker that meets a server with neither AOF
nor RDB save points logs a warning at start. Where CONFIG is disabled or renamed (managed
Redis), both checks log that they could not look, and the ledger carries on.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import re
import secrets
import threading
import time
import weakref
import zlib
from collections.abc import Iterator, Sequence
from importlib import resources
from typing import Any
from urllib.parse import unquote, urlsplit

import redis as redis_lib
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

try:  # the ``redis`` extra brings it; without it, redis-py packs commands in Python
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover - the test extras install hiredis
    _pack_command = None  # type: ignore[assignment]

from .._common import after_fork
from ..errors import (
    ConfigurationError,
    IllegalTransitionError,
    LedgerError,
    LedgerLostError,
    LedgerUnavailableError,
    RecordNotFoundError,
    StaleTokenError,
    UnsafeLedgerError,
)
from .base import (
    DEFAULT_RETENTION_SECONDS,
    Claim,
    ClaimRequest,
    ClaimStatus,
    Ledger,
    Record,
    State,
    _check_unique,
    default_owner,
    dumps_json,
    loads_json,
)

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = 16
#: Error replies meaning "not now", each refused before the script wrote anything: out of memory
#: (maxmemory with noeviction), a replica after a failover (READONLY), too few replicas acknowledging
#: (min-replicas-to-write), the last RDB/AOF write failed (MISCONF), a script or function running past
#: busy-reply-threshold (BUSY), a replica cut from its primary (MASTERDOWN), a dataset still loading
#: after a restart (LOADING), a cluster resharding or down (TRYAGAIN, CLUSTERDOWN).
_UNAVAILABLE_REPLIES = frozenset({
    "OOM", "READONLY", "NOREPLICAS", "MISCONF", "BUSY", "MASTERDOWN", "LOADING", "TRYAGAIN", "CLUSTERDOWN",
})
# ... as redis-py raises those it knows (it strips their code from the message), and the
# unreachable (a connection refused or lost, a timeout: LOADING is a ConnectionError there too).
_UNAVAILABLE_TYPES = (
    redis_lib.ConnectionError, redis_lib.TimeoutError, redis_lib.exceptions.OutOfMemoryError,
    redis_lib.exceptions.ReadOnlyError, redis_lib.exceptions.TryAgainError, redis_lib.exceptions.ClusterError,
    redis_lib.exceptions.ClusterDownError,
)
# The code of an error reply: its first word, or (a Redis 6 script error) the word after a '-'.
_REPLY_CODE = re.compile(r"^([A-Z]+)\b|\s-([A-Z]+)\s")

#: The scripts in ``lua/``, each one atomic transition; record scripts start with ``prelude.lua``.
_RECORD_SCRIPTS = ("claim", "finish", "renew", "force", "erase", "read", "page")


@functools.cache
def _lua(name: str) -> str:
    """The text of ``lua/<name>.lua`` (read once per process), after the prelude for a record script."""
    text = (resources.files(__package__) / "lua" / f"{name}.lua").read_text("utf-8")
    return _lua("prelude") + text if name in _RECORD_SCRIPTS else text


_STATES = (State.CLAIMED, State.RELEASED, State.SENT, State.FAILED, State.REVIEW)
#: States with an index (a sorted set per bucket): those an operator acts on, and ``failed`` for purge.
#: ``sent`` has none: its records expire by TTL, a counter keeps their number, listing them scans.
_INDEXED = (State.CLAIMED, State.RELEASED, State.FAILED, State.REVIEW)
#: This layout's version, in every epoch marker; a marker without it was written by the layout before.
LAYOUT = "3"
#: Longest value kept in a record field: Redis keeps a hash compact (listpack) while every value is at
#: most ``hash-max-listpack-value`` (64 by default), so longer results and errors are stored in chunks.
_CHUNK = 64
_HEX64 = re.compile(r"[0-9a-f]{64}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
#: A sent archive's granule is the ledger's retention over this (within 1 s .. 1 day): a claim that
#: finds no record looks in about this many archives (plus two), and an entry stays in memory up to
#: one granule past its expiry (its archive goes at the granule's end plus the retention).
_ARCHIVE_SPLIT = 8
#: How far the archives a caller names reach beyond its clock (at most one granule): a claim whose
#: names miss a granule by the server's clock is told so, and this process corrects its clock's offset.
_SKEW_MS = 60_000


def _archive_granule(retention_ms: int) -> int:
    return max(1_000, min(86_400_000, retention_ms // _ARCHIVE_SPLIT))


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while n > 0:
        n, d = divmod(n, 36)
        out = digits[d] + out
    return out or "0"


def _message_id(mid: str) -> str:
    """A message id as an entry holds it: a UUID in 22 base64url characters after ``u``, else ``=`` + itself."""
    if len(mid) == 36 and _UUID.fullmatch(mid):
        return "u" + base64.urlsafe_b64encode(bytes.fromhex(mid.replace("-", "")))[:22].decode("ascii")
    return "=" + mid


def _message_id_of(text: str) -> str:
    if text[0] == "=":
        return text[1:]
    h = base64.urlsafe_b64decode(text[1:] + "==").hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _body(result: dict[str, Any] | None, error: dict[str, Any] | None) -> str:
    """A sent record's result and error as its archive entry ends: the message id stored once.

    ``m<id>``: the result is the message id alone; ``v<json><id>``: the message id and a ``value``
    repeating it (what ``send_email`` stores), the value's other fields in JSON; ``r<json><id>``: the
    message id and other fields; ``*[result, error]``: anything else (an error, no message id);
    ``""``: neither. ``<id>`` is ``u`` + a UUID packed in 22 characters, or ``=`` + the id itself, last
    (it may hold any character). Whatever does not read back equal is stored the plain way.
    """
    r, e = dumps_json(result), dumps_json(error)
    plain = "" if r is None and e is None else f"*[{r or 'null'},{e or 'null'}]"
    if result is None or error is not None or not isinstance(result.get("message_id"), str):
        return plain
    mid = result["message_id"]
    rest = {k: v for k, v in result.items() if k != "message_id"}
    value = rest.get("value")
    if not rest:
        text = "m" + _message_id(mid)
    elif list(rest) == ["value"] and isinstance(value, dict) and value.get("message_id") == mid:
        text = "v" + (dumps_json({k: v for k, v in value.items() if k != "message_id"}) or "") + _message_id(mid)
    else:
        text = "r" + (dumps_json(rest) or "") + _message_id(mid)
    return text if _unbody(text) == (loads_json(r), None) else plain


_DECODER = json.JSONDecoder()


def _unbody(text: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The result and error of an archive entry's end (see :func:`_body`)."""
    if not text:
        return None, None
    kind = text[0]
    if kind == "*":
        result, error = json.loads(text[1:])
        return result, error
    if kind == "m":
        return {"message_id": _message_id_of(text[1:])}, None
    rest, end = _DECODER.raw_decode(text, 1)
    mid = _message_id_of(text[end:])
    if kind == "v":
        return {"message_id": mid, "value": {"message_id": mid, **rest}}, None
    return {"message_id": mid, **rest}, None


def _seconds(value: str | None) -> float | None:
    """A stored time in seconds: the server's clock in integer microseconds, or (written by an operator's
    change, which keeps the caller's clock exactly) seconds with a point."""
    if value is None or value == "":
        return None
    return float(value) if "." in value or "e" in value else int(value) / 1_000_000


def _pack(text: str) -> str:
    """A 64-hex digest (every intent key and fingerprint the library makes) as 43 base64url characters,
    anything else as ``~`` + itself: shorter key names and fields, and never two texts packed alike."""
    if len(text) == 64 and _HEX64.fullmatch(text):
        return base64.urlsafe_b64encode(bytes.fromhex(text))[:43].decode("ascii")
    return "~" + text if text else ""


#: The digits of a packed fingerprint: ASCII but NUL and ``~``, so it is text (UTF-8) a script copies as it is.
_B126 = "".join(chr(i) for i in range(1, 128) if i != 0x7E)
_B126_PAIRS = [a + b for a in _B126 for b in _B126]  # index d: the two base-126 digits of d < 126 * 126
_B126_VALUE = {ch: i for i, ch in enumerate(_B126)}


def _pack_fp(fingerprint: str) -> str:
    """A 64-hex fingerprint as 37 base-126 characters (a record's ``f``, copied into its archive entry
    by the completion's script as it is), anything else as ``~`` + itself, none as ``""``."""
    if len(fingerprint) == 64 and _HEX64.fullmatch(fingerprint):
        n, pairs = int(fingerprint, 16), []
        for _ in range(19):  # two digits a step (half the big-number divisions); the 38th digit is always 0
            n, d = divmod(n, 126 * 126)
            pairs.append(_B126_PAIRS[d])
        return "".join(reversed(pairs))[1:]
    return "~" + fingerprint if fingerprint else ""


def _unpack_fp(packed: str) -> str:
    """A record's ``f`` read back: 37 base-126 characters, or (layout 2) 43 base64url ones, or ``~`` + text."""
    if len(packed) == 37 and packed[0] != "~":
        n = 0
        for ch in packed:
            n = n * 126 + _B126_VALUE[ch]
        return f"{n:064x}"
    return _unpack(packed)


def _field(key: str) -> bytes:
    """A key as its archive field: a 64-hex key as its 32 bytes, anything else ``~`` + itself (``!~`` +
    itself where that would be 32 bytes long too). Scripts give a 32-byte field back in hex."""
    if len(key) == 64 and _HEX64.fullmatch(key):
        return bytes.fromhex(key)
    text = ("~" + key).encode()
    return b"!" + text if len(text) == 32 else text


def _unfield(text: str) -> str:
    if text[:1] == "~":
        return text[1:]
    return text[2:] if text[:1] == "!" else text


#: An archive entry: expiry, retention, token, then its fingerprint's kind (see ``lua/prelude.lua``).
_ENTRY = re.compile(r"([0-9a-z]+)(?:R([0-9a-z]+))?(?:T([0-9a-z]+))?(?:A([0-9a-z]+))?(?:C([0-9a-z]+))?([.,~])")


def _unpack(packed: str) -> str:
    if not packed or packed[0] == "~":
        return packed[1:]
    return base64.urlsafe_b64decode(packed + "=").hex()


def _chunked(value: dict[str, Any] | None) -> list[Any]:
    """The canonical JSON of ``value`` as script arguments: how many chunks, then the chunks."""
    return _counted(dumps_json(value) or "")


def _counted(text: str) -> list[Any]:
    """``text`` as script arguments: how many chunks, then the chunks."""
    parts = _chunks(text)
    return [len(parts), *parts]


def _chunks(text: str) -> list[str]:
    """``text`` in pieces of at most :data:`_CHUNK` bytes of UTF-8, cut between characters."""
    if text.isascii():
        parts = [text[i:i + _CHUNK] for i in range(0, len(text), _CHUNK)]
    else:
        parts, part, size = [], "", 0
        for ch in text:
            n = len(ch.encode("utf-8"))
            if size + n > _CHUNK:
                parts.append(part)
                part, size = "", 0
            part, size = part + ch, size + n
        if part:
            parts.append(part)
    return parts


def _joined(h: dict[str, str], base: str) -> str | None:
    """A chunked field read back: ``base``, ``base2``, ``base3``, ... joined."""
    first = h.get(base)
    if first is None:
        return None
    parts, i = [first], 2
    while f"{base}{i}" in h:
        parts.append(h[f"{base}{i}"])
        i += 1
    return "".join(parts)


def _connect(url: str, master_name: str | None, options: dict[str, Any]) -> Any:
    """A client for one of the URL forms; all decode responses to str."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis+cluster", "rediss+cluster"):
        nodes, user, password, _ = _hosts(url, 6379)
        startup = [ClusterNode(h, p) for h, p in nodes]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=startup, decode_responses=True,
                            ssl=scheme.startswith("rediss"), username=user, password=password, **options)
    if scheme == "sentinel":
        if not master_name:
            raise ConfigurationError("a sentinel:// ledger needs the master_name option (as Celery's)")
        nodes, user, password, db = _hosts(url, 26379)
        # Sentinels take their own options (Celery's ``sentinel_kwargs``, e.g. a password); timeouts by default.
        sentinel_options = options.pop("sentinel_kwargs", None) or {
            k: v for k, v in options.items() if k.startswith("socket_")}
        sentinel = Sentinel(nodes, sentinel_kwargs=sentinel_options, **options)  # type: ignore[no-untyped-call]
        return sentinel.master_for(  # type: ignore[no-untyped-call]
            master_name, decode_responses=True, db=db, username=user, password=password)
    return redis_lib.Redis.from_url(url, decode_responses=True, **options)


def _layout1_fields(h: dict[str, str]) -> list[str]:
    """A record of layout 1 (long names, seconds) as this layout's fields, flat."""
    out: list[Any] = ["s", h["state"], "t", h["token"], "a", h.get("attempts", "1"), "c", h.get("reclaims", "0"),
                      "f", _pack_fp(h.get("fp", ""))]
    for name, new in (("lease", "l"), ("created", "k"), ("updated", "u")):
        if h.get(name):
            out += [new, int(float(h[name]) * 1_000_000)]
    for name, base in (("task", "n"), ("owner", "o"), ("result", "r"), ("error", "e")):
        for i, part in enumerate(_chunks(h.get(name) or ""), start=1):
            out += [base if i == 1 else f"{base}{i}", part]
    return out


def _check_client(client: Any) -> None:
    """A caller's client must be a redis-py client that decodes replies to str, as the ledger's own do."""
    encoder = getattr(client, "get_encoder", None)
    if encoder is None or not callable(getattr(client, "register_script", None)):
        raise ConfigurationError(f"a Redis ledger's client must be a redis-py client, not {type(client).__name__}")
    if not encoder().decode_responses:
        raise ConfigurationError("a Redis ledger's client must decode replies: build it with decode_responses=True")


def _hosts(url: str, default_port: int) -> tuple[list[tuple[str, int]], str | None, str | None, int]:
    """``scheme://[user:pass@]h1:p1[,h2:p2][/db]``, or Celery's ``sentinel://h1:p1;sentinel://h2:p2``."""
    nodes: list[tuple[str, int]] = []
    user = password = None
    db = 0
    for part in url.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if "://" not in part:
            part = "x://" + part
        u = urlsplit(part)
        nodes.append((u.hostname or "127.0.0.1", u.port or default_port))
        user = unquote(u.username) if u.username else user
        password = unquote(u.password) if u.password else password
        if u.path.strip("/"):
            db = int(u.path.strip("/"))
    return nodes, user, password, db


class RedisLedger(Ledger):
    """Ledger on Redis: one server (``redis://host:port/db``, ``rediss://`` for TLS), a
    cluster (``redis+cluster://host:port[,host:port]``) or a Sentinel-managed primary
    (``sentinel://host:26379;sentinel://host2:26379`` with ``master_name``).

    Options: ``prefix`` (key prefix, default ``"idemmail"``), ``buckets`` (hash-tagged
    buckets, default 16; fixed for the life of a ledger), ``retention_seconds``,
    ``auto_init`` (default True: a process that finds no markers and no records starts a
    new ledger; False requires ``idemmail ledger init`` first, which tells a store emptied
    while no worker ran from a new one), ``passive`` (default False: never write epoch
    markers, neither ``auto_init`` nor lost flags; for operator reads and metrics, which
    report what the markers say), ``allow_eviction`` (accept an evicting
    ``maxmemory-policy``; unsafe), ``policy_recheck_seconds`` (default 30: how often the
    claim path reads ``maxmemory-policy`` again, so that a policy changed to an evicting one
    at runtime is refused too), ``keep_payload`` (keep the first payload after
    ``sent``, for audit), ``master_name`` (Sentinel), and any redis-py client keyword
    (timeouts default to 5 s).

    ``client``: a redis-py client of your own (``Redis``, ``RedisCluster`` or a Sentinel's
    ``master_for``, built with ``decode_responses=True``) instead of one built from the URL, so
    that your pool limits, timeouts and instrumentation (OpenTelemetry) apply to every ledger
    command. The URL is then optional and client keywords are refused. The ledger neither
    closes it nor bypasses it: the hot path's connections of its own (see ``_direct``) serve
    only clients it built.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        client: Any = None,
        prefix: str = "idemmail",
        buckets: int = DEFAULT_BUCKETS,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        auto_init: bool = True,
        passive: bool = False,
        allow_eviction: bool = False,
        policy_recheck_seconds: float = 30.0,
        keep_payload: bool = False,
        master_name: str | None = None,
        **client_options: Any,
    ) -> None:
        super().__init__(retention_seconds=retention_seconds, keep_payload=keep_payload)
        if "{" in prefix or "}" in prefix:
            raise ConfigurationError(f"Redis ledger prefix {prefix!r} must not contain braces (hash tags)")
        buckets = int(buckets)
        if not 1 <= buckets <= 256:
            raise ConfigurationError(f"buckets must be between 1 and 256, not {buckets}")
        #: Built here from the URL (closed by :meth:`close`, hot path on connections of its own), or
        #: the caller's, which every command goes through: its pool limits and instrumentation apply.
        self._own_client = client is None
        if client is not None:
            if client_options or master_name:
                named = ", ".join(client_options) or "master_name"
                raise ConfigurationError(f"a Redis ledger given a client takes no client options ({named}): "
                                         "set them on the client")
            _check_client(client)
        elif url is None:
            raise ConfigurationError("a Redis ledger needs a URL or a client")
        else:
            client_options.setdefault("socket_timeout", 5.0)
            client_options.setdefault("socket_connect_timeout", 5.0)
            client = _connect(url, master_name, client_options)
        #: The redis-py client every command goes through (``Redis``, ``RedisCluster``, or a Sentinel's).
        self.client: Any = client
        self.prefix = prefix
        self.buckets = buckets
        self.auto_init = bool(auto_init) if not isinstance(auto_init, str) else auto_init.lower() == "true"
        self.passive = bool(passive)
        self.allow_eviction = allow_eviction
        #: How often (seconds) the claim path reads ``maxmemory-policy`` again, one round trip each time.
        self.policy_recheck_seconds = float(policy_recheck_seconds)
        self._policy_due = 0.0
        self._policy_refusal = ""
        self._checked = False
        self._check_lock = threading.Lock()
        self._epoch: str | None = None  # the epoch this process holds; None before the check or while lost
        # Once this process has seen the ledger lost: the epoch it held then ("" if none). From then on
        # only an epoch an operator acknowledged is accepted, whatever the markers say (emptied again,
        # flags and all, looks "new"). Cleared when an acknowledged epoch is adopted.
        self._dead_epoch: str | None = None
        self._lost_reason = ""
        # Hot-path connections of our own (see _direct); plain single-server clients we built only.
        pool = getattr(client, "connection_pool", None)
        self._direct_ok = self._own_client and type(pool) is redis_lib.ConnectionPool
        self._spare: list[Any] = []
        _live.add(self)
        # redis-py Script objects: EVALSHA, loading the script on NOSCRIPT (a restarted server).
        self._claim = self.client.register_script(_lua("claim"))
        self._finish_script = self.client.register_script(_lua("finish"))
        self._renew = self.client.register_script(_lua("renew"))
        self._force_script = self.client.register_script(_lua("force"))
        self._purge = self.client.register_script(_lua("purge"))
        self._erase_script = self.client.register_script(_lua("erase"))
        self._flag = self.client.register_script(_lua("flag"))
        self._mark = self.client.register_script(_lua("mark"))
        self._hop = self.client.register_script(_lua("hop"))
        self._migrate = self.client.register_script(_lua("migrate"))
        self._read = self.client.register_script(_lua("read"))
        self._page = self.client.register_script(_lua("page"))
        # Per bucket, built once: the record key's stem and the bucket's other keys (indexes, marker).
        self._stems = [f"{prefix}:{{{b:02x}}}:" for b in range(buckets)]
        self._tails = [[*(f"{stem}i:{s.value}" for s in _INDEXED), f"{stem}c:sent", f"{stem}epoch"]
                       for stem in self._stems]
        # The sent archives' granule and the ledger's retention (ms), as the markers say (read at first use).
        self._archive_ms = self._lookback_ms = 0
        self._clock_ms = 0.0  # the server's clock minus this one's, as a claim told it (see _archives)
        self._archive_names: tuple[int, int, dict[int, list[str]]] = (0, 0, {})

    # -- keys --

    def _bucket(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.buckets

    def _rec(self, key: str) -> str:
        return f"{self._stems[self._bucket(key)]}r:{_pack(key)}"

    def _payload(self, key: str) -> str:
        """The name of the string holding the record's first payload (beside it, in its bucket)."""
        return f"{self._stems[self._bucket(key)]}p:{_pack(key)}"

    def _keys(self, key: str) -> list[str]:
        """A record script's KEYS: record, indexes, sent counter, epoch marker, payload, sent archives."""
        if not self._checked:
            self._check_store()
        b = zlib.crc32(key.encode()) % self.buckets
        packed = _pack(key)
        return [f"{self._stems[b]}r:{packed}", *self._tails[b], f"{self._stems[b]}p:{packed}", *self._archives(b)]

    def _archives(self, bucket: int) -> list[str]:
        """The bucket's sent archives a live entry can be in, newest first, by this process's clock
        (corrected by what the server said): every granule from the retention ago to now, and one
        skew's worth either side. Scripts choose among them by the server's clock."""
        now = time.time() * 1000 + self._clock_ms
        width = self._archive_ms
        skew = min(_SKEW_MS, width)
        hi, lo = int((now + skew) // width), int((now - self._lookback_ms - skew) // width)
        cached_hi, cached_lo, names = self._archive_names
        if (hi, lo) != (cached_hi, cached_lo):
            names = {}
            self._archive_names = (hi, lo, names)
        found = names.get(bucket)
        if found is None:
            found = names[bucket] = [f"{self._stems[bucket]}s:{g}" for g in range(hi, lo - 1, -1)]
        return found

    def _entry_record(self, key: str, value: str, granule: int, payload: str | None) -> Record:
        """An archived ``sent`` record: expiry, retention, token, attempts, reclaims, fingerprint,
        result and error.

        Task name, owner and the time of the first claim are not kept (empty, empty, the time it
        was sent)."""
        m = _ENTRY.match(value)
        if m is None:
            raise LedgerError(f"Redis ledger error: the archived record of {key} cannot be read")
        expires, retention, token, attempts, reclaims, kind = m.groups()
        at = m.end()
        if kind == ".":
            fp, body = _unpack_fp(value[at:at + 37]), value[at + 37:]
        elif kind == ",":
            fp, body = _unpack(value[at:at + 43]), value[at + 43:]
        else:
            space = value.index(" ", at)
            fp, body = bytes.fromhex(value[at:space]).decode(), value[space + 1:]
        expires_ms = granule * self._archive_ms + int(expires, 36)
        updated = (expires_ms - (int(retention, 36) if retention else self._lookback_ms)) / 1000
        result, error = _unbody(body)
        return Record(
            key=key, task_name="", state=State.SENT, token=int(token, 36) if token else 1, owner="",
            lease_expires_at=None, attempts=int(attempts, 36) if attempts else 1,
            reclaims=int(reclaims, 36) if reclaims else 0, payload=payload or None, fingerprint=fp, result=result,
            error=error, created_at=updated, updated_at=updated, expires_at=expires_ms / 1000,
        )

    def _archive_settings(self, marker: dict[str, Any]) -> dict[str, int]:
        """The markers' archive fields: kept from ``marker`` when it has them, else from this retention."""
        if marker.get("archive_ms") and marker.get("retention_ms"):
            return {"archive_ms": int(marker["archive_ms"]), "retention_ms": int(marker["retention_ms"])}
        retention = max(1, int(self.retention_seconds * 1000))
        return {"archive_ms": _archive_granule(retention), "retention_ms": retention}

    def _index(self, bucket: int, state: State) -> str:
        """The name of the bucket's index of ``state`` (``sent`` has none: that name is never written)."""
        return f"{self._stems[bucket]}i:{state.value}"

    def _counter(self, bucket: int) -> str:
        """The bucket's count of ``sent`` records: a hash of expiry granule (ms) -> records."""
        return self._tails[bucket][-2]

    def _granule_ms(self) -> int:
        """Width of a counter granule (µs): a record counts until the end of its expiry's granule (<= 1% late)."""
        return max(1, min(60_000_000, int(self.retention_seconds * 10_000)))

    def _marker(self, bucket: int) -> str:
        return self._tails[bucket][-1]

    # -- plumbing --

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._checked:
            self._check_store()
        return self._raw(fn, *args, **kwargs)

    def _eval(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a record script under this process's epoch; on a ``lost`` answer, look at the markers."""
        if not self._checked:
            self._check_store()
        out = self._script(script, keys, [self._epoch or "", *args])
        if out[0] == "lost":
            self._confirm_loss()  # raises unless an acknowledged epoch was adopted
            out = self._script(script, keys, [self._epoch, *args])
            if out[0] == "lost":
                raise self._lost_error()
        return out

    def _script(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        if self._direct_ok:
            return self._raw(self._direct, script, keys, args)
        return self._raw(script, keys=keys, args=args)

    def _direct(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA ``script`` on a connection of the ledger's own, past redis-py's command layer.

        redis-py's pool checkout, retry wrapper, ``Script`` object and response callbacks cost
        about as much client CPU as the round trip itself; a claim and a completion per task pay
        them twice. Each connection serves one call at a time (taken from a spare list, put back
        after), so threads and greenlets never share one, and there are never more than the
        calls under way at once. Anything out of the ordinary goes the ordinary way: NOSCRIPT (a
        restarted server) through ``Script``, which loads it, and a broken connection (closed by
        the server, a restart) through the client, which retries on a fresh one, as before.
        """
        try:
            conn = self._spare.pop()
        except IndexError:
            conn = self.client.connection_pool.make_connection()
        try:
            if _pack_command is not None:  # hiredis: one C call (redis-py's packer adds a Python pass per argument)
                conn.send_packed_command((_pack_command(("EVALSHA", script.sha, len(keys), *keys, *args)),))
            else:
                conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
            out = conn.read_response()
        except redis_lib.exceptions.NoScriptError:
            self._spare.append(conn)
            return script(keys=keys, args=args)
        except (redis_lib.ConnectionError, redis_lib.TimeoutError):
            conn.disconnect()
            return script(keys=keys, args=args)
        except redis_lib.ResponseError:
            self._spare.append(conn)  # an error reply (out of memory, read-only): the connection is fine
            raise
        except BaseException:
            conn.disconnect()  # interrupted mid-reply (a soft time limit): its stream is unusable
            raise
        self._spare.append(conn)
        return out

    def _check_store(self) -> None:
        with self._check_lock:
            if self._checked:
                return
            self._check_policy(warn=True)
            if not self.passive:  # a worker, not an operator's look or a metrics scrape
                self._check_persistence()
            self._check_layout()
            self._look(expected=None)
            self._checked = True

    def _settings(self, name: str, *, warn: bool) -> list[str] | None:
        """A setting on every primary, or None when CONFIG is disabled or renamed (managed Redis: an
        unknown command, or no permission), with a warning if ``warn``. Unreachable: raises."""
        try:
            return self._config_get(name)
        except redis_lib.RedisError as exc:
            error = _ledger_error(exc)
            if isinstance(error, LedgerUnavailableError):
                raise error from exc
            if warn:
                log.warning("idemmail: cannot read Redis %s (%s); check it by hand (see the Redis ledger's docs)",
                            name, exc)
            return None

    def _check_policy(self, *, warn: bool = False) -> None:
        """Refuse an evicting ``maxmemory-policy`` (at first use, then on the claim path every
        ``policy_recheck_seconds``: a policy changed at runtime is refused too, until set back)."""
        self._policy_due = time.monotonic() + self.policy_recheck_seconds
        bad = sorted({p for p in self._settings("maxmemory-policy", warn=warn) or [] if p != "noeviction"})
        if bad and not self.allow_eviction:
            self._policy_refusal = (
                f"Redis maxmemory-policy is {bad[0]!r}: evicted ledger records would reopen "
                "their keys and re-send. Set it to 'noeviction' (or pass allow_eviction=True)."
            )
            if self._checked:  # it changed at runtime
                log.error("idemmail: Redis ledger %s refuses new claims: %s", self.prefix, self._policy_refusal)
            raise UnsafeLedgerError(self._policy_refusal)
        self._policy_refusal = ""

    def _watch_policy(self) -> None:
        """On the claim path: refuse while the policy is known bad; read it again when due (one
        round trip per ``policy_recheck_seconds`` per process, nothing in between)."""
        if time.monotonic() >= self._policy_due:
            try:
                self._check_policy()
            except LedgerUnavailableError:
                return  # the claim meets the outage itself
        elif self._policy_refusal:
            raise UnsafeLedgerError(self._policy_refusal)

    def _check_persistence(self) -> None:
        """Warn (not refuse) when a server keeps no copy on disk: no AOF and no RDB save point.

        A restart then empties the ledger; the epoch markers detect it and stop every claim until
        an operator acknowledges the loss, but every intent recorded before it is forgotten.
        """
        aof = self._settings("appendonly", warn=False)
        saves = self._settings("save", warn=False)
        if aof is None or saves is None:
            log.warning("idemmail: cannot read the Redis persistence settings; make sure AOF is on (appendonly yes)")
            return
        if "yes" not in aof and not any(v.strip() for v in saves):
            log.warning(
                "idemmail: Redis ledger %s: the server keeps no copy on disk (appendonly no, no save points): a "
                "restart empties the ledger, and every intent recorded before it is forgotten (the loss is "
                "detected and claims stop until `idemmail ledger ack-loss`). Turn on AOF: appendonly yes.",
                self.prefix)

    def _check_layout(self, *, allow_old: bool = False) -> None:
        """Refuse a store that still holds the pre-bucket key layout (one pipeline, at first use), or
        (unless ``allow_old``) one whose markers were written by the earlier record layout."""
        old = [f"{self.prefix}:i:{s.value}" for s in _STATES]
        found = [name for name, n in zip(old, self._pipeline([("exists", (name,)) for name in old]), strict=True)
                 if int(n)]
        if found:
            raise UnsafeLedgerError(
                f"Redis ledger prefix {self.prefix!r} holds keys of the old, pre-bucket layout ({', '.join(found)}): "
                f"this version keeps records under {self.prefix}:{{bb}}:r:<key> and would not see them, so every "
                "intent recorded there would look new and send again. Drain the old ledger first (stop the old "
                "workers, let its claims and reviews be resolved and its sent records expire, delete the old keys), "
                "or give this version a new `prefix`."
            )
        epoch, layout = self._raw(self.client.hmget, self._marker(0), "epoch", "layout")
        if epoch and layout != LAYOUT and not allow_old:
            # Layout 1 records would not be found; a layout 2 process would not find layout 3's archived
            # sent records (so an older worker refuses this store the same way, by its layout).
            raise UnsafeLedgerError(
                f"Redis ledger prefix {self.prefix!r} was written by an earlier version (record layout "
                f"{layout or '1'}; this version reads layout {LAYOUT}, sent records in per-bucket archives) and "
                "would not find its records, so every intent recorded there would look new and send again. "
                "Stop the old workers, then convert it once: "
                "`python -c 'from idemmail_celery.ledger import from_url; "
                f"from_url(URL, prefix={self.prefix!r}).migrate_layout()'` (idempotent; safe to run again)."
            )

    def _config_get(self, name: str) -> list[str]:
        """The setting on every server holding ledger keys (every primary of a cluster)."""
        if isinstance(self.client, RedisCluster):
            out = self.client.config_get(name, target_nodes=RedisCluster.PRIMARIES)
            values = out.values() if isinstance(out, dict) and name not in out else [out]
            return [str(v.get(name)) for v in values if isinstance(v, dict) and v.get(name)]
        value = self.client.config_get(name).get(name)
        return [value] if value else []

    def _pipeline(self, commands: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Run (method, args) pairs in one non-transactional pipeline (split per node on a cluster)."""
        pipe = self.client.pipeline(transaction=False)
        for name, args in commands:
            getattr(pipe, name)(*args)
        return list(self._raw(pipe.execute))

    @staticmethod
    def _raw(fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except redis_lib.RedisError as exc:
            # Never a raw redis-py error: a caller catches LedgerUnavailableError to fail closed and
            # retry (a raw error would fail the task and ack the message), LedgerError for the rest.
            raise _ledger_error(exc) from exc

    def _run_scripts(self, script: Any, calls: Sequence[tuple[list[str], list[Any]]], *,
                     partial: bool = False) -> list[Any]:
        """EVALSHA every call in one pipeline; calls refused with NOSCRIPT (a restarted server) are
        run again with EVAL, which loads the script on that server, and only they: the others ran.
        (EVAL, not SCRIPT LOAD: on a cluster that goes to every node, and fails if one is down.)

        Raises the first call's error, unless ``partial``: then errors are returned in place (on a
        cluster one node can fail while the others ran their calls)."""
        def run(batch: Sequence[tuple[list[str], list[Any]]], command: str, body: str) -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for keys, args in batch:  # by name: a cluster pipeline refuses .evalsha(), not the command
                pipe.execute_command(command, body, len(keys), *keys, *args)
            return list(self._raw(pipe.execute, raise_on_error=False))

        outs = run(calls, "EVALSHA", script.sha)
        again = [i for i, out in enumerate(outs) if isinstance(out, redis_lib.exceptions.NoScriptError)]
        if again:
            for i, out in zip(again, run([calls[i] for i in again], "EVAL", script.script), strict=True):
                outs[i] = out
        if not partial:
            for out in outs:
                if isinstance(out, Exception):
                    raise _ledger_error(out)
        return outs

    def _write_markers(self, fields: dict[str, Any], *, replace: bool) -> None:
        flat = ["1" if replace else "0", *(x for kv in fields.items() for x in kv)]
        self._run_scripts(self._mark, [([self._marker(b)], flat) for b in range(self.buckets)])

    def _record(self, key: str, flat: list[str] | dict[str, str], payload: str | None) -> Record:
        h = flat if isinstance(flat, dict) else dict(zip(flat[::2], flat[1::2], strict=True))
        state = State(h["s"])
        updated = _seconds(h.get("u")) or 0.0
        return Record(
            key=key,
            task_name=_joined(h, "n") or "",
            state=state,
            token=int(h["t"]),
            owner=_joined(h, "o") or "",
            lease_expires_at=_seconds(h.get("l")),
            attempts=int(h.get("a", 0)),
            reclaims=int(h.get("c", 0)),
            payload=payload or None,
            fingerprint=_unpack_fp(h.get("f", "")),
            result=loads_json(_joined(h, "r")),
            error=loads_json(_joined(h, "e")),
            created_at=_seconds(h.get("k")) or 0.0,
            updated_at=updated,
            # Not stored (the TTL holds it): the retention this process knows, from the last update.
            expires_at=updated + self.retention_seconds if state.expires else None,
        )

    # -- epoch markers: loss detection --

    def _markers(self) -> list[dict[str, str]]:
        return self._pipeline([("hgetall", (self._marker(b),)) for b in range(self.buckets)])

    def _has_records(self) -> bool:
        """Any index or sent counter in any bucket (one pipeline)."""
        checks = [("exists", (idx,)) for b in range(self.buckets) for idx in self._tails[b][:-1]]
        return any(self._pipeline(checks))

    def loss_status(self) -> dict[str, Any]:
        """What the markers say, read fresh: ``state`` is ``ok``, ``new`` or ``lost``.

        ``ok``: every bucket carries the same epoch. ``new``: no marker and no record
        anywhere (a new ledger, or one emptied while no process held its epoch: the two
        look the same). ``lost``: a marker flagged lost by a process that saw its epoch
        go, markers missing or disagreeing between buckets, records without markers, or
        markers from another bucket count. Also ``epoch``, ``reason``, ``buckets`` and,
        after an acknowledgement, ``acked_by``/``acked_at``/``note``.
        """
        return self._status(None)

    def _status(self, expected: str | None) -> dict[str, Any]:
        markers = self._markers()
        if all(markers):
            return self._judge(markers, expected, True)
        # A marker is missing (first use, or trouble): are there records? If so, read the markers
        # again: a new ledger's markers are all written before its first record, so a partial
        # read taken while another process was writing them is not mistaken for a loss.
        has_records = self._has_records()
        if has_records:
            markers = self._markers()
        return self._judge(markers, expected, has_records)

    def _judge(self, markers: list[dict[str, str]], expected: str | None, has_records: bool) -> dict[str, Any]:
        n = self.buckets
        first = next((m for m in markers if m), {})
        out: dict[str, Any] = {"state": "ok", "buckets": n, "epoch": first.get("epoch"), "reason": ""}
        for name in ("created_at", "created_by", "acked_at", "acked_by", "note", "archive_ms", "retention_ms"):
            if first.get(name):
                out[name] = first[name]
        counts = {m["buckets"] for m in markers if m.get("buckets")}
        if counts and counts != {str(n)}:
            raise UnsafeLedgerError(
                f"this Redis ledger was created with {'/'.join(sorted(counts))} buckets; this process is "
                f"configured with {n}: records would be looked for in the wrong buckets. Use the same `buckets`."
            )
        flagged = [b for b, m in enumerate(markers) if m.get("lost")]
        missing = [b for b, m in enumerate(markers) if not m.get("epoch")]
        epochs = {m["epoch"] for m in markers if m.get("epoch")}
        if flagged:
            m = markers[flagged[0]]
            return {**out, "state": "lost", "reason": f"{m['lost']} (flagged by {m.get('lost_by')})"}
        if not missing and len(epochs) == 1:
            if expected is not None and first["epoch"] != expected and not first.get("acked_at"):
                return {**out, "state": "lost", "reason": (
                    f"the epoch changed from {expected} to {first['epoch']} without an acknowledgement: "
                    "the store was emptied and a process that never saw it started afresh")}
            return out
        if len(missing) == n:
            if expected is not None:
                return {**out, "state": "lost", "reason": f"every epoch marker is gone (this process held {expected})"}
            if has_records:
                return {**out, "state": "lost", "reason": "records exist but no bucket has an epoch marker"}
            return {**out, "state": "new", "reason": "no marker and no record"}
        if (missing and expected is None and not has_records and len(epochs) == 1 and markers[0].get("epoch")
                and not first.get("acked_at") and time.time() - float(first.get("created_at") or 0) < 30):
            # Another process is writing a new ledger's markers (bucket 0 first): join it.
            return {**out, "state": "new", "reason": "a new ledger's markers are being written"}
        if missing:
            return {**out, "state": "lost", "reason": f"buckets {_ranges(missing)} lost their epoch marker"}
        return {**out, "state": "lost", "reason": f"buckets disagree on the epoch ({', '.join(sorted(epochs))})"}

    def _look(self, expected: str | None) -> None:
        """Read the markers and settle this process's epoch (or lost reason). Call with the lock held.

        A passive ledger writes nothing here: no new epoch, no lost flag.
        """
        dead = self._dead_epoch
        held = expected if expected is not None else dead or None
        status = self._status(held)
        if status["state"] == "new" and held is None and dead is None and self.auto_init and not self.passive:
            status = self._create_markers(default_owner(), "auto_init")
        archive = self._archive_settings(status)
        self._archive_ms, self._lookback_ms = archive["archive_ms"], archive["retention_ms"]
        if dead is not None and status["state"] != "lost" and (not status.get("acked_at") or status["epoch"] == dead):
            # Seen lost once: the flags may be gone with the data (emptied again), but not the memory of it.
            said = status["reason"] or f"epoch {status['epoch']}, not acknowledged since"
            status = {**status, "state": "lost", "reason": (
                f"this process saw the ledger lost{f' (it held epoch {dead})' if dead else ''} and the markers "
                f"show no acknowledgement since ({said}): the store was emptied again, or restored from an old copy")}
        if status["state"] == "ok":
            if held is not None and status["epoch"] != held:
                log.warning("idemmail: Redis ledger %s: adopting epoch %s acknowledged by %s (%s)",
                            self.prefix, status["epoch"], status.get("acked_by"), status.get("note"))
            self._epoch, self._lost_reason, self._dead_epoch = status["epoch"], "", None
            self.recovered_at = float(status["acked_at"]) if status.get("acked_at") else None
            return
        if status["state"] == "new":  # auto_init=False (or passive), and no loss seen by this process
            reason = (f"the ledger is not initialised ({'passive' if self.passive else 'auto_init=False'}): "
                      "run `idemmail ledger init`")
        else:
            reason = status["reason"]
            self._dead_epoch = held or ""
            if not self.passive:
                self._flag_lost(self._dead_epoch, reason)
        if reason != self._lost_reason:
            if not self.passive:
                log.critical(
                    "idemmail: Redis ledger %s is LOST: %s. Nothing is claimed or sent until an operator "
                    "decides: check the store, then run `celery -A proj idemmail ledger ack-loss --note ...` "
                    "(intents recorded before the loss are then forgotten).", self.prefix, reason)
            elif status["state"] == "lost":
                log.warning("idemmail: Redis ledger %s is LOST: %s", self.prefix, reason)
        self._epoch, self._lost_reason = None, reason

    def _flag_lost(self, dead_epoch: str, reason: str) -> None:
        """Mark every bucket lost, so that processes starting later stop too."""
        args = [dead_epoch, reason, default_owner(), time.time()]
        self._run_scripts(self._flag, [([self._marker(b)], args) for b in range(self.buckets)])

    def _create_markers(self, actor: str, note: str) -> dict[str, Any]:
        """A new ledger's markers. Concurrent creators converge on the epoch bucket 0 got first."""
        fields = {"epoch": secrets.token_hex(8), "buckets": self.buckets, "layout": LAYOUT, "created_at": time.time(),
                  "created_by": actor, "note": note, **self._archive_settings({})}
        marker0 = self._marker(0)
        self._run_scripts(self._mark, [([marker0], ["0", *(x for kv in fields.items() for x in kv)])])
        # Bucket 0's epoch and archive settings (a concurrent creator's retention may differ from ours).
        fields["epoch"], fields["archive_ms"], fields["retention_ms"] = self._raw(
            self.client.hmget, marker0, "epoch", "archive_ms", "retention_ms")
        self._write_markers(fields, replace=False)
        return self._judge(self._markers(), None, True)

    def _confirm_loss(self) -> None:
        """A script said ``lost``: read the markers again; raise unless an acknowledged epoch was adopted.

        While the store is lost every claim costs this one extra read (and tasks back off).
        """
        with self._check_lock:
            self._look(expected=self._epoch)
        if self._epoch is None:
            raise self._lost_error()

    def _lost_error(self) -> LedgerLostError:
        return LedgerLostError(
            f"Redis ledger {self.prefix!r} is lost: {self._lost_reason or 'its epoch marker changed'}. "
            "Nothing is claimed until an operator runs `idemmail ledger ack-loss --note ...`."
        )

    def migrate_layout(self) -> dict[str, int]:
        """Convert a ledger written by an earlier record layout (1 or 2) to this one (3), in place; idempotent.

        Run it once with every worker stopped (old ones would keep writing the old layout, and a
        layout 2 worker would not see archived sent records; new ones refuse until it is done):
        ``RedisLedger(url, prefix=...).migrate_layout()``. Layout 1: each record is rewritten
        atomically under its own bucket (so a cluster is fine) keeping its TTL, token and state; a
        record that changes meanwhile is left for a second run. Layout 2 records stay as they are
        (this layout still reads a ``sent`` record kept as a hash of its own; they expire by their
        TTL). The markers then say layout 3, with the archives' granule and retention (this
        process's retention). Returns how many records were converted per state, and ``left``
        (changed meanwhile).
        """
        self._check_layout(allow_old=True)
        granule = self._granule_ms()
        done = {s.value: 0 for s in State}
        done["left"] = 0
        layout = self._raw(self.client.hget, self._marker(0), "layout")
        for b in range(self.buckets if layout in (None, "1") else 0):
            stem = self._stems[b]
            for state in _STATES:
                index = self._index(b, state)
                ids = list(self._raw(self.client.zrange, index, 0, -1))
                for i in range(0, len(ids), 500):
                    chunk = ids[i:i + 500]
                    olds = self._pipeline([("hgetall", (f"{stem}r:{k}",)) for k in chunk])
                    calls = []
                    for key, h in zip(chunk, olds, strict=True):
                        if not h:
                            if state is State.SENT:  # expired: its entry goes
                                self._raw(self.client.zrem, index, key)
                            continue
                        if h.get("state") != state.value:
                            continue  # met again under its own state's index
                        fields = _layout1_fields(h)
                        score = int(float(h.get("updated") or 0) * 1_000_000)
                        if state.expires and h.get("expires"):
                            score = int(float(h["expires"]) * 1_000_000)
                        calls.append(([f"{stem}r:{key}", self._rec(key), index, self._counter(b), self._payload(key)],
                                      [key, h.get("token", ""), state.value, score, granule, h.get("payload") or "",
                                       *fields]))
                    for out in self._run_scripts(self._migrate, calls):
                        done[state.value if int(out) else "left"] += 1
            if not self._raw(self.client.zcard, self._index(b, State.SENT)):
                self._raw(self.client.delete, self._index(b, State.SENT))
        if not done["left"]:
            markers = self._markers()
            marked: dict[str, Any] = {"layout": LAYOUT, **self._archive_settings(next((m for m in markers if m), {}))}
            self._pipeline([("hset", (self._marker(b), None, None, marked)) for b, m in enumerate(markers)
                            if m.get("epoch")])
        log.warning("idemmail: Redis ledger %s: layout migrated: %s", self.prefix, done)
        return done

    def init_store(self, *, actor: str = "") -> dict[str, Any]:
        """Create the epoch markers of a new (empty) ledger; a no-op on an initialised one.

        Raises :class:`IllegalTransitionError` on a lost store: that takes ``acknowledge_loss``.
        """
        self._check_layout()
        status = self.loss_status()
        if status["state"] == "lost":
            raise IllegalTransitionError(f"the ledger is lost ({status['reason']}): acknowledge it with ack-loss")
        if status["state"] == "new":
            status = self._create_markers(actor or default_owner(), "init")
        return status

    def acknowledge_loss(self, *, note: str, actor: str = "") -> dict[str, Any]:
        """An operator's decision that the loss is understood: every bucket gets a fresh, acknowledged epoch.

        Workers adopt it on their next claim and proceed. Intents recorded before the
        loss are forgotten; a copy enqueued before this acknowledgement may be one of them,
        so :class:`~idemmail_celery.IdempotentTask` sends it only with its key carried
        downstream, and otherwise parks it for review (see ``recovered_at``). Raises
        :class:`IllegalTransitionError` when the markers show no loss.
        """
        before = self._status(None)
        if before["state"] != "lost":
            raise IllegalTransitionError(f"the ledger is not lost (state {before['state']}): nothing to acknowledge")
        now = time.time()
        fields = {"epoch": secrets.token_hex(8), "buckets": self.buckets, "layout": LAYOUT, "created_at": now,
                  "created_by": actor or default_owner(), "acked_at": now, "acked_by": actor or default_owner(),
                  "note": note, "previous": before.get("epoch") or "", "loss": before["reason"],
                  **self._archive_settings(before)}
        self._write_markers(fields, replace=True)
        with self._check_lock:
            self._epoch, self._lost_reason, self._dead_epoch = str(fields["epoch"]), "", None
            self.recovered_at = now
        return self._judge(self._markers(), None, True)

    # -- contract --

    def claim(self, request: ClaimRequest) -> Claim:
        if self._checked:
            self._watch_policy()
        out = self._eval(self._claim, self._keys(request.key), self._claim_args(request))
        if out[0] == "clock":
            self._set_clock(out[1])
            out = self._eval(self._claim, self._keys(request.key), self._claim_args(request))
            if out[0] == "clock":  # nothing written; a clock still moving (or nodes that disagree): fail closed
                raise LedgerUnavailableError(f"Redis ledger {self.prefix}: the server's clock keeps moving")
        return self._claim_result(request, out)

    def _set_clock(self, server_ms: Any) -> None:
        """A claim said this process's archive names miss a granule by the server's clock: follow the server's."""
        offset = int(server_ms) - time.time() * 1000
        log.warning("idemmail: Redis ledger %s: this clock is %.1f s off the server's; following the server's",
                    self.prefix, -offset / 1000)
        self._clock_ms = offset

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """The batch's claim scripts in one pipeline (one per node on a cluster)."""
        _check_unique(requests)
        if not requests:
            return []
        if not self._checked:
            self._check_store()
        else:
            self._watch_policy()

        def run() -> tuple[list[Any], str]:
            epoch = self._epoch or ""
            calls = [(self._keys(r.key), [epoch, *self._claim_args(r)]) for r in requests]
            outs = self._run_scripts(self._claim, calls, partial=True)
            failed = next((out for out in outs if isinstance(out, Exception)), None)
            if failed is not None:
                # A node failed (a cluster node down mid-batch) after the others ran their claims.
                try:
                    self._release_held(requests, outs, epoch, "batch_met_failed_node")
                except LedgerError as exc:  # their leases will run out
                    log.warning("idemmail: Redis ledger %s: could not hand back a failed batch's claims: %s",
                                self.prefix, exc)
                raise _ledger_error(failed)
            return outs, epoch

        outs, epoch = run()
        if any(out[0] == "lost" for out in outs):
            # Some buckets refused: hand back what the others gave (nothing ran), before the
            # loss is flagged and refuses that too; then the whole batch again if an epoch is adopted.
            self._release_held(requests, outs, epoch, "batch_met_lost_ledger")
            self._confirm_loss()
            outs, epoch = run()
            if any(out[0] == "lost" for out in outs):
                self._release_held(requests, outs, epoch, "batch_met_lost_ledger")
                raise self._lost_error()
        if any(out[0] == "clock" for out in outs):  # nothing written for those: claim them again
            self._set_clock(next(out[1] for out in outs if out[0] == "clock"))
            return [self.claim(r) if out[0] == "clock" else self._claim_result(r, out)
                    for r, out in zip(requests, outs, strict=True)]
        return [self._claim_result(r, out) for r, out in zip(requests, outs, strict=True)]

    def _release_held(self, requests: Sequence[ClaimRequest], outs: list[Any], epoch: str, reason: str) -> None:
        """Hand back the claims a batch took before it gave up; nothing was sent under them.

        ``acquired`` and ``reopened`` claims are released: nothing had been sent for them. A
        ``reclaimed`` claim took over an expired lease whose holder may have sent: it stays
        claimed with its lease ended, so that the next claim reclaims it and the reclaim rules
        decide, as they would have here (released, the next claim would reopen it and send). A
        ``resumed`` claim stays as it is, held by this batch's owner: its chain may carry a verdict
        for it (sent, not yet recorded), which the chain's next pass records when it resumes it.
        """
        error = {"reason": reason, "at": time.time()}
        release: list[tuple[list[str], list[Any]]] = []
        expire: list[tuple[list[str], list[Any]]] = []
        for r, out in zip(requests, outs, strict=True):
            if isinstance(out, Exception) or out[0] in ("lost", "clock") or not ClaimStatus(out[0]).holds:
                continue
            status = ClaimStatus(out[0])
            if status is ClaimStatus.RESUMED:
                continue
            token = self._claim_result(r, out).token
            if status is ClaimStatus.RECLAIMED:
                expire.append((self._keys(r.key), [epoch, token, 0]))
            else:
                release.append((self._keys(r.key), [epoch, *self._finish_args(r.key, token, State.RELEASED,
                                                                               None, error)]))
        if release:
            self._run_scripts(self._finish_script, release)
        if expire:
            self._run_scripts(self._renew, expire)

    def _claim_args(self, request: ClaimRequest) -> list[Any]:
        return [request.key, request.payload, _pack_fp(request.fingerprint), int(request.lease_seconds * 1000),
                request.resume_owner or "", *_counted(request.task_name), *_counted(request.owner),
                _field(request.key), self._archive_ms, self._lookback_ms]

    def _claim_result(self, request: ClaimRequest, out: list[Any]) -> Claim:
        status = ClaimStatus(out[0])
        if status is ClaimStatus.ACQUIRED:
            now, lease = int(out[1]) / 1_000_000, int(out[2]) / 1_000_000
            record = Record(
                key=request.key, task_name=request.task_name, state=State.CLAIMED, token=1,
                owner=request.owner, lease_expires_at=lease, attempts=1, reclaims=0,
                payload=request.payload, fingerprint=request.fingerprint,
                created_at=now, updated_at=now,
            )
            return Claim(status, record)
        if len(out) > 3:  # archived
            return Claim(status, self._entry_record(request.key, out[3], int(out[4]), out[2]))
        return Claim(status, self._record(request.key, out[1], out[2]))

    def _finish(
        self,
        key: str,
        token: int,
        state: State,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> float | None:
        out = self._eval(self._finish_script, self._keys(key), self._finish_args(key, token, state, result, error))
        if out[0] == "missing":
            raise RecordNotFoundError(f"no ledger record for key {key}")
        if out[0] == "stale":
            raise StaleTokenError(
                f"token {token} no longer holds {key}: it is {out[1]} with token {out[2]}"
            )
        return _seconds(str(out[1])) if len(out) > 1 else None  # the time written, as a read gives it back

    def _finish_args(self, key: str, token: int, state: State, result: dict[str, Any] | None,
                     error: dict[str, Any] | None) -> list[Any]:
        return [key, token, state.value, int(self.retention_seconds * 1000), "0" if self.keep_payload else "1",
                self._granule_ms(), *_chunked(result), *_chunked(error), _field(key), self._archive_ms,
                self._lookback_ms, _body(result, error) if state is State.SENT else ""]

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        return bool(self._eval(self._renew, self._keys(key), [token, int(lease_seconds * 1000)])[0] == "ok")

    def get(self, key: str) -> Record | None:
        if not self._checked:
            self._check_store()
        out = self._call(self._read, keys=self._keys(key), args=[_field(key), self._archive_ms, self._lookback_ms])
        if out[0] == "clock":  # this process's clock names the wrong archives: follow the server's, once
            self._set_clock(out[1])
            out = self._call(self._read, keys=self._keys(key), args=[_field(key), self._archive_ms, self._lookback_ms])
            if out[0] == "clock":
                raise LedgerUnavailableError(f"Redis ledger {self.prefix}: the server's clock keeps moving")
        h = dict(zip(out[0][::2], out[0][1::2], strict=True))
        if h:
            return self._record(key, h, out[1])
        if len(out) > 2:
            record = self._entry_record(key, out[2], int(out[3]), out[1])
            return record if (record.expires_at or 0) > time.time() else None
        return None

    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        """Indexed states from their indexes; ``sent`` (no index) and all records by SCAN of the buckets
        (records) and HSCAN of their archives."""
        if not self._checked:
            self._check_store()
        for b in range(self.buckets):
            if state in _INDEXED:
                assert state is not None
                keys = list(self._call(self.client.zrange, self._index(b, state), 0, -1))
            else:
                pattern = _glob_escape(f"{self._stems[b]}r:") + "*"
                stem = len(self._stems[b]) + 2
                keys = [_unpack(name[stem:]) for name in self._call(self._scan, pattern)]
            for i in range(0, len(keys), 500):
                chunk = keys[i:i + 500]
                commands = [(c, (name,)) for k in chunk for c, name in (("hgetall", self._rec(k)),
                                                                       ("get", self._payload(k)))]
                read = self._pipeline(commands)
                for key, h, payload in zip(chunk, read[::2], read[1::2], strict=True):
                    if h and (state is None or h.get("s") == state.value):
                        yield self._record(key, h, payload)
            if state in (None, State.SENT):
                yield from self._archived(b)

    def _archived(self, bucket: int) -> Iterator[Record]:
        """The bucket's archived ``sent`` records, not yet expired."""
        stem = self._stems[bucket]
        for name in self._call(self._scan, _glob_escape(f"{stem}s:") + "*"):
            granule = name[len(stem) + 2:]
            if not granule.isdigit():
                continue
            cursor = "0"
            while True:
                cursor, items = self._call(self._page, keys=[name], args=[cursor, 500])
                chunk = [(_unfield(f), v) for f, v in zip(items[::2], items[1::2], strict=True)]
                payloads = self._pipeline([("get", (self._payload(key),)) for key, _ in chunk]) if chunk else []
                now = time.time()
                for (key, value), payload in zip(chunk, payloads, strict=True):
                    record = self._entry_record(key, value, int(granule), payload)
                    if (record.expires_at or 0) > now:
                        yield record
                if str(cursor) == "0":
                    break

    def _scan(self, pattern: str) -> list[str]:
        return list(self.client.scan_iter(match=pattern, count=1000))

    def stats(self) -> dict[str, int]:
        """Records per state, from the indexes and the sent counters (one pipeline); expired
        ``sent``/``failed`` excluded (a ``sent`` record counts until the end of its expiry's granule,
        at most 1% of the retention, or a minute, after it expired)."""
        if not self._checked:
            self._check_store()
        now_us = time.time() * 1_000_000
        commands: list[tuple[str, tuple[Any, ...]]] = []
        for b in range(self.buckets):
            commands += [("zcount", (self._index(b, s), now_us if s.expires else "-inf", "+inf")) for s in _INDEXED]
            commands.append(("hgetall", (self._counter(b),)))
        counts = {s.value: 0 for s in State}
        for (_, (name, *_)), n in zip(commands, self._pipeline(commands), strict=True):
            if isinstance(n, dict):
                counts[State.SENT.value] += sum(int(v) for k, v in n.items() if int(k) > now_us)
            else:
                counts[name.rsplit(":", 1)[1]] += int(n)
        return counts

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        ttl = "" if new.expires_at is None else int((new.expires_at - new.updated_at) * 1000)
        drop = new.payload is None or (new.state is State.SENT and not self.keep_payload)
        args = [key, expected_token, new.state.value, new.token, repr(float(new.updated_at)), ttl,
                "1" if drop else "0", self._granule_ms(), _field(key), self._archive_ms, _pack_fp(new.fingerprint),
                repr(float(new.created_at)), new.attempts, new.reclaims, *_counted(new.owner), *_chunked(new.result),
                *_chunked(new.error), *_counted(new.task_name)]
        return bool(self._call(self._force_script, keys=self._keys(key), args=args))

    def _erase(self, key: str, expected_token: int, result: dict[str, Any] | None,
               error: dict[str, Any] | None) -> bool:
        args = [expected_token, *_chunked(result), *_chunked(error), _field(key), self._archive_ms,
                _body(result, error)]
        return bool(self._call(self._erase_script, keys=self._keys(key), args=args))

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool:
        """A mark in the key's bucket, named by a digest of key and hop (no raw text), set if absent.

        The mark holds this call's nonce: should the client send the script again after a lost reply,
        the call that set it still answers True (a plain SET NX would answer False to its own write).
        """
        digest = hashlib.blake2b(f"{key}\0{hop}".encode(), digest_size=16).hexdigest()
        mark = f"{self._stems[self._bucket(key)]}h:{digest}"
        nonce = secrets.token_hex(8)
        return bool(self._call(self._hop, keys=[mark], args=[nonce, max(1, int(ttl_seconds * 1000))]))

    def purge_expired(self, now: float | None = None) -> int:
        """Expired ``failed`` records' index entries, and the sent counters' spent granules.

        ``sent`` and ``failed`` records go by themselves (TTL); this keeps the ``failed`` index
        and the counters from growing. Returns how many expired records it accounted for: the
        ``failed`` entries removed, and the ``sent`` records the spent granules counted.
        """
        if not self._checked:
            self._check_store()
        now_us = (time.time() if now is None else now) * 1_000_000
        gone = 0
        for b in range(self.buckets):
            index = self._index(b, State.FAILED)
            ids = self._call(self.client.zrangebyscore, index, "-inf", now_us)
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                gone += sum(self._run_scripts(self._purge, [([self._rec(k), index, self._payload(k)],
                                                             [k, State.FAILED.value]) for k in chunk]))
            counter = self._counter(b)
            spent = {k: int(v) for k, v in self._call(self.client.hgetall, counter).items() if int(k) <= now_us}
            if spent:
                self._call(self.client.hdel, counter, *spent)
                gone += sum(spent.values())
        return gone

    def ping(self) -> None:
        self._call(self.client.ping)

    def prepare(self) -> None:
        """Check the store (eviction policy, layout) and read the epoch this process holds."""
        if not self._checked:
            self._check_store()

    def close(self) -> None:
        spare, self._spare = self._spare, []
        for conn in spare:
            conn.disconnect()
        if self._own_client:
            self.client.close()

    def _after_fork(self) -> None:
        """In a forked child: the spare connections are the parent's sockets (dropped, not closed), and
        a lock one of its threads held (a metrics scrape checking the store) would never be released.
        redis-py's own pool notices the fork by itself."""
        self._spare, self._check_lock = [], threading.Lock()


_live: weakref.WeakSet[RedisLedger] = weakref.WeakSet()


@after_fork
def _reset_after_fork() -> None:
    for ledger in list(_live):
        ledger._after_fork()


def _ledger_error(exc: Exception) -> LedgerError:
    """A redis-py error as a ledger error: :class:`LedgerUnavailableError` (tasks fail closed and
    retry) when the store cannot be reached or refused for a passing reason (:data:`_UNAVAILABLE_REPLIES`),
    :class:`LedgerError` for anything else (a bug, a wrong type under a ledger key, no permission).
    The message names the reply's code."""
    if isinstance(exc, LedgerError):
        return exc
    code = getattr(exc, "status_code", None) or ""
    if not code and isinstance(exc, redis_lib.ResponseError):
        # A pipeline's error says "Command # 1 (HGETALL ...) of pipeline caused error: <reply>".
        found = _REPLY_CODE.search(str(exc).rsplit("caused error: ", 1)[-1])
        code = (found[1] or found[2]) if found else ""
    said = f"{code} {exc}" if code and not str(exc).startswith(code) else str(exc)
    error: LedgerError
    if isinstance(exc, (redis_lib.ConnectionError, redis_lib.TimeoutError)) and not code:
        error = LedgerUnavailableError(f"Redis ledger unreachable: {said}")
    elif isinstance(exc, _UNAVAILABLE_TYPES) or code in _UNAVAILABLE_REPLIES:
        error = LedgerUnavailableError(f"Redis ledger unavailable: {said}")
    else:
        error = LedgerError(f"Redis ledger error: {type(exc).__name__}: {said}")
    error.__cause__ = exc
    return error


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a SCAN pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(out)
