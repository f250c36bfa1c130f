"""The Redis ledger's moves: :class:`RedisLedger`, each transition one script beside this module
(``<name>.lua``, after ``prelude.lua`` for a record script), the store's checks (eviction policy,
persistence, layout, epoch markers) and the migration from older layouts. Key names and packing:
``layout.py``; what the layout is and why: the package docstring.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
import logging
import re
import secrets
import threading
import time
import weakref
from collections import Counter
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

from ..._common import after_fork, logsafe
from ...errors import (
    ConfigurationError,
    IllegalTransitionError,
    LedgerError,
    LedgerLostError,
    LedgerUnavailableError,
    RecordNotFoundError,
    StaleTokenError,
    UnsafeLedgerError,
)
from ..base import (
    DEFAULT_RETENTION_SECONDS,
    Claim,
    ClaimRequest,
    ClaimStatus,
    Ledger,
    Record,
    RosterEntry,
    State,
    _check_unique,
    ahead_error,
    check_roster_entry,
    default_owner,
    dumps_json,
    loads_json,
)
from ..listing import Counts, Position, RecordQuery, Selection
from .layout import (
    _ENTRY,
    _INDEXED,
    _STATES,
    _SWEEP_SPLIT,
    DEFAULT_BUCKETS,
    DEFAULT_SHELVES,
    LAYOUT,
    Names,
    _b36,
    _body,
    _chunked,
    _counted,
    _counted_name,
    _field,
    _joined,
    _layout1_fields,
    _pack_all,
    _pack_fp,
    _seconds,
    _unbody,
    _unfield,
    _unpack,
    _unpack_fp,
)

log = logging.getLogger("idemmail_celery.ledger.redis")  # the package's name, as before the split

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

#: A claim script's answer as its status (a dict: calling the Enum costs as much as building the call's keys).
_CLAIM_STATUS = {status.value: status for status in ClaimStatus}

#: The scripts beside this module, each one atomic transition; record scripts start with ``prelude.lua``.
_RECORD_SCRIPTS = ("claim", "finish", "renew", "force", "erase", "read", "page", "restock", "sweep", "withdraw",
                   "listing")
#: Records a filtered listing first asks the listing script about, one call per bucket (Redis runs nothing
#: else meanwhile: a few ms a call); each next stretch twice as long, up to 8 times this.
LISTING_STRETCH = 500


#: A record script's first line naming the prelude's parts it uses (none named: all of them).
_PARTS_USED = re.compile(r"-- Runs after prelude\.lua: ([a-z, ]+)\.")
_PART = re.compile(r"^-- part: ([a-z]+)\n", re.M)


@functools.cache
def _lua(name: str) -> str:
    """The text of ``<name>.lua`` beside this module (read once per process), after the prelude for a
    record script: the parts of it the script's first line names, or all of it."""
    text = (resources.files(__package__) / f"{name}.lua").read_text("utf-8")
    if name not in _RECORD_SCRIPTS:
        return text
    used = _PARTS_USED.match(text)
    if used is None:
        return _lua("prelude") + text
    return _prelude(tuple(part.strip() for part in used[1].split(","))) + text


@functools.cache
def _prelude(parts: tuple[str, ...]) -> str:
    """The prelude's opening comment, then ``parts`` in the prelude's own order (later parts call earlier ones).

    Each helper a script defines costs every call of it (a closure made per call; a script keeps no
    state between calls), so a hot script carries only the parts it uses."""
    pieces = _PART.split(_lua("prelude"))  # [intro, name, body, name, body, ...]
    known = dict(zip(pieces[1::2], pieces[2::2], strict=True))
    unknown = sorted(set(parts) - set(known))
    if unknown:
        raise LedgerError(f"Redis ledger scripts name unknown prelude parts: {', '.join(unknown)}")
    return pieces[0] + "".join(f"-- part: {name}\n{body}" for name, body in known.items() if name in parts)


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
    buckets, default 16; fixed for the life of a ledger), ``shelves`` (hashes per bucket holding
    ``sent`` records, default 64; the markers' value wins once the ledger exists: about 100 records
    a shelf at 100,000 sent records is the memory sweet spot), ``retention_seconds``,
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

    marks_takeovers = True  # a reclaim from a holder without the write-ahead promise marks it 'unknown'

    def __init__(
        self,
        url: str | None = None,
        *,
        client: Any = None,
        prefix: str = "idemmail",
        buckets: int = DEFAULT_BUCKETS,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        shelves: int = DEFAULT_SHELVES,
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
        shelves = int(shelves)
        if not 1 <= shelves <= 65536:
            raise ConfigurationError(f"shelves must be between 1 and 65536, not {shelves}")
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
        self._roster = self.client.register_script(_lua("roster"))
        self._migrate = self.client.register_script(_lua("migrate"))
        self._restock = self.client.register_script(_lua("restock"))
        self._fence = self.client.register_script(_lua("fence"))
        self._sweep = self.client.register_script(_lua("sweep"))
        self._read = self.client.register_script(_lua("read"))
        self._page = self.client.register_script(_lua("page"))
        self._withdraw = self.client.register_script(_lua("withdraw"))
        self._listing = self.client.register_script(_lua("listing"))
        #: Every key name (see ``layout.py``); its shelves per bucket are this process's until the markers say.
        self.names = Names(prefix, buckets, shelves)
        self._stems = self.names.stems
        # The ledger's retention (ms): this process's until the markers say (first use).
        self._retention_ms = max(1, int(self.retention_seconds * 1000))

    # -- keys (spelled in layout.Names) --

    @property
    def shelves(self) -> int:
        """Shelves per bucket: the markers' once the ledger exists (fixed when it was created)."""
        return self.names.shelves

    @shelves.setter
    def shelves(self, value: int) -> None:
        self.names.shelves = value

    def _bucket(self, key: str) -> int:
        return self.names.bucket(key)

    def _rec(self, key: str) -> str:
        return self.names.record(key)

    def _payload(self, key: str) -> str:
        return self.names.payload(key)

    def _shelf_of(self, key: str) -> str:
        return self.names.shelf(key)

    def _keys(self, key: str) -> list[str]:
        """A record script's KEYS (the store checked first: its shelves are the markers')."""
        if not self._checked:
            self._check_store()
        return self.names.script_keys(key)

    def _claim_keys(self, key: str) -> list[str]:
        """The claim script's KEYS (the store checked first, as for :meth:`_keys`)."""
        if not self._checked:
            self._check_store()
        return self.names.claim_keys(key)

    def _entry_record(self, key: str, value: str, payload: str | None) -> Record:
        """A shelved ``sent`` record: expiry, retention, token, attempts, reclaims, fingerprint,
        result and error.

        Task name, owner and the time of the first claim are not kept (empty, empty, the time it
        was sent)."""
        m = _ENTRY.match(value)
        if m is None:
            raise LedgerError(f"Redis ledger error: the shelved record of {key} cannot be read")
        expires, retention, token, attempts, reclaims, kind = m.groups()
        at = m.end()
        if kind == ".":
            fp, body = _unpack_fp(value[at:at + 37]), value[at + 37:]
        elif kind == ",":
            fp, body = _unpack(value[at:at + 43]), value[at + 43:]
        else:
            space = value.index(" ", at)
            fp, body = bytes.fromhex(value[at:space]).decode(), value[space + 1:]
        expires_ms = int(expires, 36) * 100  # tenths of a second
        updated = (expires_ms - (int(retention, 36) if retention else self._retention_ms)) / 1000
        result, error = _unbody(body)
        return Record(
            key=key, task_name="", state=State.SENT, token=int(token, 36) if token else 1, owner="",
            lease_expires_at=None, attempts=int(attempts, 36) if attempts else 1,
            reclaims=int(reclaims, 36) if reclaims else 0, payload=payload or None, fingerprint=fp, result=result,
            error=error, created_at=updated, updated_at=updated, expires_at=expires_ms / 1000,
        )

    def _store_settings(self, marker: dict[str, Any]) -> dict[str, int]:
        """The markers' shelf fields (shelves per bucket, the ledger's retention in ms): kept from
        ``marker`` when it has them, else this process's."""
        if marker.get("shelves") and marker.get("retention_ms"):
            return {"shelves": int(marker["shelves"]), "retention_ms": int(marker["retention_ms"])}
        return {"shelves": self.shelves, "retention_ms": max(1, int(self.retention_seconds * 1000))}

    def _sweep_ms(self) -> int:
        """How often a shelf's dead entries are swept (ms): see :data:`_SWEEP_SPLIT`."""
        return max(1_000, self._retention_ms // _SWEEP_SPLIT)

    def _index(self, bucket: int, state: State) -> str:
        return self.names.index(bucket, state)

    def _counter(self, bucket: int) -> str:
        return self.names.counter(bucket)

    def _granule_ms(self) -> int:
        """Width of a counter granule (µs): a record counts until the end of its expiry's granule (<= 1% late)."""
        return max(1, min(60_000_000, int(self.retention_seconds * 10_000)))

    def _marker(self, bucket: int) -> str:
        return self.names.marker(bucket)

    def _old_marker(self, bucket: int) -> str:
        return self.names.old_marker(bucket)

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
                self._check_version()
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
                            name, logsafe(exc))
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

    def _check_version(self) -> None:
        """Refuse a server older than Redis 7.0: a completion grows its shelf's TTL with ``PEXPIREAT ... GT``,
        which an older server refuses (every completion would fail). Where INFO is disabled: a warning."""
        try:
            info = self._raw(self.client.info, "server")
        except LedgerUnavailableError:
            raise
        except LedgerError as exc:
            log.warning("idemmail: cannot read the Redis version (%s); this ledger needs Redis 7.0 or later",
                        logsafe(exc))
            return
        found = [info] if "redis_version" in info else [v for v in info.values() if isinstance(v, dict)]
        for node in found:
            version = str(node.get("redis_version", ""))
            parts = version.split(".")
            if len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) < 7:
                raise UnsafeLedgerError(f"Redis {version}: this ledger (record layout {LAYOUT}) needs Redis 7.0 or "
                                        "later (PEXPIREAT ... GT on its shelves of sent records)")

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
        # EXISTS, not a read: it leaves the markers' idle time alone, which the migration reads as the
        # last sign of life of an older worker (see migrate_layout).
        ours, older = self._which_markers()
        if older and not ours and not allow_old:
            raise UnsafeLedgerError(
                f"Redis ledger prefix {self.prefix!r} was written by an earlier version (record layout 1-3; this "
                f"version reads layout {LAYOUT}, sent records on shelves found by their key) and would not find its "
                "records, so every intent recorded there would look new and send again. Convert it once, after "
                "stopping the old workers (the command refuses while they run): "
                f"`celery -A proj idemmail ledger migrate` (or RedisLedger(URL, prefix={self.prefix!r})"
                ".migrate_layout(); idempotent, safe to run again)."
            )

    def _which_markers(self) -> tuple[bool, bool]:
        """Whether bucket 0 has a marker of this layout, and one of layouts 1-3 (EXISTS: not touched)."""
        new, old = self._pipeline([("exists", (self._marker(0),)), ("exists", (self._old_marker(0),))])
        return bool(int(new)), bool(int(old))

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
        checks = [("exists", (idx,)) for b in range(self.buckets) for idx in self.names.tails[b][:-1]]
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
        for name in ("created_at", "created_by", "acked_at", "acked_by", "note", "shelves", "retention_ms"):
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
        settings = self._store_settings(status)
        self.shelves, self._retention_ms = settings["shelves"], settings["retention_ms"]
        if dead is not None and status["state"] != "lost" and (not status.get("acked_at") or status["epoch"] == dead):
            # Seen lost once: the flags may be gone with the data (emptied again), but not the memory of it.
            said = status["reason"] or f"epoch {status['epoch']}, not acknowledged since"
            status = {**status, "state": "lost", "reason": (
                f"this process saw the ledger lost{f' (it held epoch {dead})' if dead else ''} and the markers "
                f"show no acknowledgement since ({said}): the store was emptied again, or restored from an old copy")}
        if status["state"] == "ok":
            if held is not None and status["epoch"] != held:
                log.warning("idemmail: Redis ledger %s: adopting epoch %s acknowledged by %s (%s)",
                            self.prefix, logsafe(status["epoch"]), logsafe(status.get("acked_by")),
                            logsafe(status.get("note")))
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
                    "(intents recorded before the loss are then forgotten).", self.prefix, logsafe(reason))
            elif status["state"] == "lost":
                log.warning("idemmail: Redis ledger %s is LOST: %s", self.prefix, logsafe(reason))
        self._epoch, self._lost_reason = None, reason

    def _flag_lost(self, dead_epoch: str, reason: str) -> None:
        """Mark every bucket lost, so that processes starting later stop too; the older layouts' markers
        too (a store emptied has lost its fence: an older worker would start a ledger of its own there)."""
        args = [dead_epoch, reason, default_owner(), time.time()]
        self._run_scripts(self._flag, [([self._marker(b)], args) for b in range(self.buckets)])
        self._fence_old_layouts(f"the layout {LAYOUT} ledger here is lost ({reason})")

    def _create_markers(self, actor: str, note: str) -> dict[str, Any]:
        """A new ledger's markers. Concurrent creators converge on the epoch bucket 0 got first."""
        fields = {"epoch": secrets.token_hex(8), "buckets": self.buckets, "layout": LAYOUT, "created_at": time.time(),
                  "created_by": actor, "note": note, **self._store_settings({})}
        marker0 = self._marker(0)
        self._run_scripts(self._mark, [([marker0], ["0", *(x for kv in fields.items() for x in kv)])])
        # After bucket 0's: a process of this version starting meanwhile sees it and joins (old markers
        # and no new one would read as a store to migrate).
        self._fence_old_layouts(f"this ledger is layout {LAYOUT}, created by {actor}")
        # Bucket 0's epoch and shelf settings (a concurrent creator's may differ from ours).
        fields["epoch"], fields["shelves"], fields["retention_ms"] = self._raw(
            self.client.hmget, marker0, "epoch", "shelves", "retention_ms")
        self._write_markers(fields, replace=False)
        return self._judge(self._markers(), None, True)

    def _fence_old_layouts(self, reason: str) -> None:
        """Flag every marker of layouts 1-3 (``<prefix>:{bb}:epoch``) lost, writing one where there is
        none: a worker of an older version then refuses this store, at start (its layout check) and on
        its next script (its epoch check), and never creates a ledger of its own beside this one."""
        marked = ["layout", LAYOUT, "buckets", self.buckets, "lost", f"{reason}: upgrade this worker",
                  "lost_by", default_owner(), "lost_at", time.time()]
        self._run_scripts(self._fence, [([self._old_marker(b)], marked) for b in range(self.buckets)])

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

    def migrate_layout(self, *, quiet_seconds: float = 60.0, actor: str = "") -> dict[str, int]:
        """Convert a ledger written by an earlier record layout (1, 2 or 3) to this one (4), in place.

        The command behind ``celery -A proj idemmail ledger migrate``; idempotent. It refuses
        (:class:`UnsafeLedgerError`, nothing written) while a worker of an older version uses the
        store: every script of layouts 1-3 reads its bucket's marker ``<prefix>:{bb}:epoch``, which
        this version never reads (it only asks whether it exists), so the markers' idle time
        (``OBJECT IDLETIME``) is how long ago an older worker, or an older version's operator tool,
        last ran anything. Under ``quiet_seconds`` (60 s) in any bucket: refused. Then, in order:

        1. the old markers are flagged lost (layout 4): an older worker that wakes up later writes
           nothing (its scripts check that flag atomically) and one that starts refuses the store;
        2. layout 1 records are rewritten in place (keeping TTL, token, state; a record that changes
           meanwhile is left for a second run); layout 2 records stay as they are (this layout reads a
           ``sent`` record kept as a hash of its own; they expire by their TTL);
        3. layout 3's time-granule archives (``s:<granule>``) are put on the shelves, their entries'
           expiry made absolute, and deleted;
        4. the layout 4 markers (``<prefix>:{bb}:epoch4``) are written, keeping the epoch: only now do
           workers of this version, which refuse a store with old markers and no new ones, start.

        A run again within ``quiet_seconds`` of the last (which read the old markers) is refused too.
        Returns how many records were converted per state, ``shelved`` (archive entries moved) and
        ``left`` (changed meanwhile: run it again).
        """
        self._check_layout(allow_old=True)
        new, old = self._which_markers()
        done = {s.value: 0 for s in State}
        done["left"] = done["shelved"] = 0
        if new or not old:
            return done  # layout 4 already (or nothing here yet)
        self._check_quiet(quiet_seconds)
        olds = self._pipeline([("hgetall", (self._old_marker(b),)) for b in range(self.buckets)])
        first: dict[str, str] = next((m for m in olds if m.get("epoch")), {})
        layout = first.get("layout") or "1"
        if layout == LAYOUT:  # fenced by a run that stopped half-way: the layout it came from is noted
            layout = first.get("from_layout") or "3"
        else:
            # A loss the older version saw (or markers that disagree) stays its operator's call: carried
            # over, the new markers would hide it and the intents it forgot would send again unasked.
            epochs = {m.get("epoch") for m in olds}
            lost = next((m["lost"] for m in olds if m.get("lost")), "")
            if lost or len(epochs) != 1:
                raise UnsafeLedgerError(
                    f"Redis ledger prefix {self.prefix!r}: the older version's markers say the ledger is lost or "
                    f"disagree ({lost or 'epochs ' + ', '.join(sorted(str(e) for e in epochs))}): settle it with "
                    "that version (`ledger stats`, `ledger ack-loss`) before migrating. Nothing was changed.")
            if layout == "3" and not first.get("archive_ms"):
                raise UnsafeLedgerError(f"Redis ledger prefix {self.prefix!r}: layout 3 markers without archive_ms: "
                                        "its archived sent records cannot be found. Nothing was changed.")
            self._raw(self.client.hset, self._old_marker(0), "from_layout", layout)
        self._fence_old_layouts(f"migrated to layout {LAYOUT} (from {layout})")
        granule = self._granule_ms()
        for b in range(self.buckets if layout in (None, "", "1") else 0):
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
        if layout == "3" and first.get("archive_ms"):
            done["shelved"] = self._restock_archives(int(first["archive_ms"]))
        if not done["left"]:
            kept = {k: v for k, v in first.items() if k in ("epoch", "created_at", "created_by", "acked_at",
                                                           "acked_by", "note", "previous", "loss")}
            settings = self._store_settings({"retention_ms": first.get("retention_ms"), "shelves": self.shelves})
            marked: dict[str, Any] = {**kept, "buckets": self.buckets, "layout": LAYOUT, **settings,
                                      "migrated_at": time.time(), "migrated_by": actor or default_owner(),
                                      "migrated_from": layout}
            if marked.get("epoch"):
                self._write_markers(marked, replace=True)
        log.warning("idemmail: Redis ledger %s: layout migrated: %s", self.prefix, done)
        return done

    def _check_quiet(self, quiet_seconds: float) -> None:
        """Refuse while a worker of layouts 1-3 ran anything in the last ``quiet_seconds`` (see
        :meth:`migrate_layout`): the idle time of the old markers, read without touching them."""
        try:
            idle = self._pipeline([("object", ("idletime", self._old_marker(b))) for b in range(self.buckets)])
        except LedgerError as exc:
            raise UnsafeLedgerError(f"cannot tell whether older workers still run ({exc}); "
                                    "the migration needs OBJECT IDLETIME (an LFU maxmemory-policy hides it)") from exc
        busy = [(int(s), b) for b, s in enumerate(idle) if s is not None and int(s) < quiet_seconds]
        if busy:
            seconds, bucket = min(busy)
            raise UnsafeLedgerError(
                f"Redis ledger prefix {self.prefix!r}: a worker of an older version (or its operator tools) used "
                f"the store {seconds} s ago (bucket {bucket:02x}): stop every older worker, then run the migration "
                f"again once the store has been quiet for {quiet_seconds:g} s. Nothing was changed.")

    def _restock_archives(self, archive_ms: int) -> int:
        """Layout 3's time-granule archives onto the shelves (absolute expiries), then deleted."""
        moved, step = 0, self._sweep_ms()
        for b in range(self.buckets):
            stem = self._stems[b]
            for name in self._raw(self._scan, _glob_escape(f"{stem}s:") + "*"):
                granule = name[len(stem) + 2:]
                if not granule.isdigit():
                    continue
                cursor, start = "0", int(granule) * archive_ms
                while True:
                    cursor, items = self._raw(self._page, keys=[name], args=[cursor, 500])
                    shelves: dict[str, list[Any]] = {}
                    for field, value in zip(items[::2], items[1::2], strict=True):
                        m = _ENTRY.match(value)
                        if m is None:
                            continue
                        key, expires = _unfield(field), -(-(start + int(m[1], 36)) // 100)  # 1/10 s, rounded up
                        shelves.setdefault(self._shelf_of(key), []).extend(
                            [_field(key), _b36(expires) + value[len(m[1]):], expires * 100])
                    if shelves:
                        self._run_scripts(self._restock, [([shelf], [step, *args]) for shelf, args in shelves.items()])
                        moved += sum(len(args) // 3 for args in shelves.values())
                    if str(cursor) == "0":
                        break
                self._raw(self.client.delete, name)
        return moved

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
                  **self._store_settings(before)}
        self._fence_old_layouts(f"this ledger is layout {LAYOUT}, its loss acknowledged by {fields['acked_by']}")
        self._write_markers(fields, replace=True)
        with self._check_lock:
            self._epoch, self._lost_reason, self._dead_epoch = str(fields["epoch"]), "", None
            self.recovered_at = now
        return self._judge(self._markers(), None, True)

    # -- contract --

    def claim(self, request: ClaimRequest) -> Claim:
        if self._checked:
            self._watch_policy()
        return self._claim_result(request, self._eval(self._claim, self._claim_keys(request.key),
                                                      self._claim_args(request)))

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
            calls = [(self._claim_keys(r.key), [epoch, *self._claim_args(r)]) for r in requests]
            outs = self._run_scripts(self._claim, calls, partial=True)
            failed = next((out for out in outs if isinstance(out, Exception)), None)
            if failed is not None:
                # A node failed (a cluster node down mid-batch) after the others ran their claims.
                try:
                    self._release_held(requests, outs, epoch, "batch_met_failed_node")
                except LedgerError as exc:  # their leases will run out
                    log.warning("idemmail: Redis ledger %s: could not hand back a failed batch's claims: %s",
                                self.prefix, logsafe(exc))
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
            if isinstance(out, Exception) or out[0] == "lost" or not ClaimStatus(out[0]).holds:
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
                request.resume_owner or "", *_counted_name(request.task_name), *_counted(request.owner),
                _field(request.key)]

    def _claim_result(self, request: ClaimRequest, out: list[Any]) -> Claim:
        status = _CLAIM_STATUS[out[0]]
        if status is ClaimStatus.ACQUIRED:
            now, lease = int(out[1]) / 1_000_000, int(out[2]) / 1_000_000
            record = Record(
                key=request.key, task_name=request.task_name, state=State.CLAIMED, token=1,
                owner=request.owner, lease_expires_at=lease, attempts=1, reclaims=0,
                payload=request.payload, fingerprint=request.fingerprint,
                created_at=now, updated_at=now,
            )
            return Claim(status, record)
        if status is ClaimStatus.DONE:
            if len(out) > 3:  # shelved
                return Claim(status, self._entry_record(request.key, out[3], out[2]))
            return Claim(status, self._record(request.key, out[1], out[2]))
        previous = str(out[3]) if len(out) > 3 and out[3] else None  # who held it before (taken over)
        return Claim(status, self._record(request.key, out[1], out[2]), previous_owner=previous)

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
        if state is State.SENT:
            # Gone with the record's hash, a sent record's result and error are never written in chunks:
            # the script only reads them whole (into the entry, beside one the record keeps), so each
            # goes as one "chunk" (every argument costs the call).
            texts = [*_whole(dumps_json(result)), *_whole(dumps_json(error))]
        else:
            texts = [*_chunked(result), *_chunked(error)]
        return [key, token, state.value, int(self.retention_seconds * 1000), "0" if self.keep_payload else "1",
                self._granule_ms(), *texts, _field(key), self._retention_ms,
                self._sweep_ms(), _body(result, error) if state is State.SENT else ""]

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        return bool(self._eval(self._renew, self._keys(key), [token, int(lease_seconds * 1000)])[0] == "ok")

    def withdraw(self, key: str, token: int) -> bool:
        """One script: the record, its payload and its index entry go together (see :meth:`Ledger.withdraw`)."""
        return bool(self._eval(self._withdraw, self._keys(key), [key, token])[0] == "ok")

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        """The lease's renewal with the mark written in the same script (see :meth:`Ledger.write_ahead`)."""
        mark = _chunked(ahead_error(stage, time.time(), token, owner))
        return bool(self._eval(self._renew, self._keys(key), [token, int(lease_seconds * 1000), *mark])[0] == "ok")

    def get(self, key: str) -> Record | None:
        if not self._checked:
            self._check_store()
        out = self._call(self._read, keys=self._keys(key), args=[_field(key)])
        h = dict(zip(out[0][::2], out[0][1::2], strict=True))
        if h:
            return self._record(key, h, out[1])
        return self._entry_record(key, out[2], out[1]) if len(out) > 2 else None

    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        """Indexed states from their indexes; ``sent`` (no index) and all records by SCAN of the buckets
        (records) and HSCAN of their shelves."""
        if not self._checked:
            self._check_store()
        scanned = None if state in _INDEXED else self._names_by_bucket()
        for b in range(self.buckets):
            if scanned is None:
                assert state is not None
                keys = list(self._call(self.client.zrange, self._index(b, state), 0, -1))
            else:
                stem = len(self._stems[b]) + 2
                keys = [_unpack(name[stem:]) for name in scanned[b]["r:"]]
            for i in range(0, len(keys), 500):
                chunk = keys[i:i + 500]
                commands = [(c, (name,)) for k in chunk for c, name in (("hgetall", self._rec(k)),
                                                                       ("get", self._payload(k)))]
                read = self._pipeline(commands)
                for key, h, payload in zip(chunk, read[::2], read[1::2], strict=True):
                    if h and (state is None or h.get("s") == state.value):
                        yield self._record(key, h, payload)
            if scanned is not None and state in (None, State.SENT):
                yield from self._shelved(scanned[b]["d:"])

    def _names_by_bucket(self) -> list[dict[str, list[str]]]:
        """Every bucket's record (``r:``) and shelf (``d:``) names, from ONE scan of the ledger's names: a
        listing walks the keyspace once, not twice per bucket (32 walks of a shared Redis's every key)."""
        found: list[dict[str, list[str]]] = [{"r:": [], "d:": []} for _ in range(self.buckets)]
        at = len(self.prefix) + 2  # "<prefix>:{" then the bucket's two hex digits
        for name in self._call(self._scan, _glob_escape(f"{self.prefix}:{{") + "*"):
            try:
                b = int(name[at:at + 2], 16)
            except ValueError:
                continue
            stem = self._stems[b] if b < self.buckets else ""
            kind = name[len(stem):len(stem) + 2]
            if stem and name.startswith(stem) and kind in ("r:", "d:"):
                found[b][kind].append(name)
        return found

    def _shelved(self, names: list[str]) -> Iterator[Record]:
        """The shelved ``sent`` records on the shelves ``names``, not yet expired (by this process's clock: a
        listing)."""
        for name in names:
            cursor = "0"
            while True:
                cursor, items = self._call(self._page, keys=[name], args=[cursor, 500])
                chunk = [(_unfield(f), v) for f, v in zip(items[::2], items[1::2], strict=True)]
                payloads = self._pipeline([("get", (self._payload(key),)) for key, _ in chunk]) if chunk else []
                now = time.time()
                for (key, value), payload in zip(chunk, payloads, strict=True):
                    record = self._entry_record(key, value, payload)
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

    # -- listing: the review queue (see ``ledger.listing``) --

    def _listing_window(self, query: RecordQuery, position: Position | None, want: int, skip: int) -> Selection:
        """The state's indexes walked in order across buckets (:class:`_Walk`; with a task, a reason or words,
        each bucket's stretch checked in the store by the listing script as it is read), then the records
        read in one pipeline. ``sent`` (no index) and every state at once: the base class's scan."""
        if query.state not in _INDEXED:
            return super()._listing_window(query, position, want, skip)
        if not self._checked:
            self._check_store()
        failed_by_time = query.state is State.FAILED and (query.since is not None or query.until is not None)
        skip = skip if not (query.words or failed_by_time) else 0  # the store's matches are exact: skip there
        walk = _Walk(self, query, position)
        found = walk.take(skip + want)
        skipped = min(skip, len(found))
        taken = found[skipped:]
        read = self._pipeline([(c, (name,)) for at in taken
                               for c, name in (("hgetall", self._rec(at.key)), ("get", self._payload(at.key)))])
        items = [(at, self._record(at.key, h, payload))
                 for at, h, payload in zip(taken, read[::2], read[1::2], strict=True) if h]
        return Selection(items, None if walk.ended else walk.last, skipped)

    def _check(self, query: RecordQuery, bucket: int, keys: list[str]) -> tuple[list[str], Any]:
        """The listing script's call on ``keys`` of one bucket: is each a match (``1``) of ``query``?"""
        return self._listing_call("check", query, bucket, keys, query.plain_words)

    def _listing_call(self, mode: str, query: RecordQuery, bucket: int, keys: list[str],
                      words: tuple[str, ...]) -> tuple[list[str], list[Any]]:
        assert query.state is not None
        stem = self._stems[bucket]
        packed = _pack_all(keys)
        if not words:  # the keys themselves are for words only
            return [f"{stem}r:{p}" for p in packed], [mode, query.state.value, query.task, query.reason, 0]
        names = [f"{stem}r:{p}" for p in packed] + [f"{stem}p:{p}" for p in packed]
        return names, [mode, query.state.value, query.task, query.reason, len(words), *words, *keys]

    def count(self, query: RecordQuery | None = None) -> Counts:
        """Counted by the listing script over every record of the state's index in the time range, bucket by
        bucket. ``sent`` (no index) and all states: the base class's scan; so is ``failed`` in a time range
        (its index is by expiry)."""
        query = query or RecordQuery()
        if query.state not in _INDEXED or (query.state is State.FAILED and (query.since, query.until) != (None, None)):
            return super().count(query)
        if not self._checked:
            self._check_store()
        state = query.state
        assert state is not None
        plain = RecordQuery(state=state, since=query.since, until=query.until)
        cells = Counter[tuple[str, str, int]]()
        lo, hi = _Walk.bounds(plain)
        # A failed record is scored by its expiry: its day is the score less the ledger's retention.
        shift = self._retention_ms * 1000 if state is State.FAILED else 0
        stretch = LISTING_STRETCH * 2
        starts = dict.fromkeys(range(self.buckets), 0)
        while starts:
            ranges = self._pipeline([("zrangebyscore", (self._index(b, state), lo, hi, at, stretch, True))
                                     for b, at in starts.items()])
            calls, scores = [], []
            for (b, at), found in zip(list(starts.items()), ranges, strict=True):
                if found:
                    calls.append(self._listing_call("tally", plain, b, [str(k) for k, _ in found], ()))
                    scores.append([s for _, s in found])
                if len(found) < stretch:
                    del starts[b]
                else:
                    starts[b] = at + len(found)
            for (pairs, numbers), stretch_scores in zip(self._run_scripts(self._listing, calls), scores, strict=True):
                named = [(str(pairs[i]), str(pairs[i + 1])) for i in range(0, len(pairs), 2)]
                cells.update((*named[number - 1], int((score - shift) // 86_400_000_000))
                             for number, score in zip(numbers, stretch_scores, strict=True) if number)
        return Counts(dict(cells))

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        ttl = "" if new.expires_at is None else int((new.expires_at - new.updated_at) * 1000)
        drop = new.payload is None or (new.state is State.SENT and not self.keep_payload)
        args = [key, expected_token, new.state.value, new.token, repr(float(new.updated_at)), ttl,
                "1" if drop else "0", self._granule_ms(), _field(key), "", _pack_fp(new.fingerprint),
                repr(float(new.created_at)), new.attempts, new.reclaims, *_counted(new.owner), *_chunked(new.result),
                *_chunked(new.error), *_counted(new.task_name)]
        return bool(self._call(self._force_script, keys=self._keys(key), args=args))

    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None) -> bool:
        args = [expected_token, expected_state.value, *_chunked(result), *_chunked(error), _field(key),
                _body(result, error)]
        return bool(self._call(self._erase_script, keys=self._keys(key), args=args))

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool:
        """A mark in the key's bucket, named by a digest of key and hop (no raw text), set if absent.

        The mark holds this call's nonce: should the client send the script again after a lost reply,
        the call that set it still answers True (a plain SET NX would answer False to its own write).
        """
        nonce = secrets.token_hex(8)
        return bool(self._call(self._hop, keys=[self._hop_name(key, hop)],
                               args=[nonce, max(1, int(ttl_seconds * 1000))]))

    def hop_marked(self, key: str, hop: str) -> bool:
        """One ``EXISTS`` of the mark (it expires by its TTL)."""
        return bool(self._call(self.client.exists, self._hop_name(key, hop)))

    def _hop_name(self, key: str, hop: str) -> str:
        return self.names.hop(key, hashlib.blake2b(f"{key}\0{hop}".encode(), digest_size=16).hexdigest())

    def announce(self, member: str, secret_ids: Sequence[str], ttl_seconds: float) -> None:
        """One script on the roster hash (bucket 0's slot): the entry's expiry on the server's clock, so
        hosts whose clocks disagree still agree on who is live."""
        ids = check_roster_entry(member, secret_ids)
        self._call(self._roster, keys=[self.names.roster()], args=[member, ids, int(ttl_seconds * 1000)])

    def roster(self) -> list[RosterEntry]:
        out = self._call(self._roster, keys=[self.names.roster()], args=["", "", 0])
        return [RosterEntry(str(out[i]), tuple(str(out[i + 2]).split(",")), int(out[i + 1]) / 1000)
                for i in range(0, len(out), 3)]

    def purge_expired(self, now: float | None = None) -> int:
        """Expired ``failed`` records' index entries, the sent counters' spent granules, and the shelves'
        dead entries.

        ``failed`` records go by themselves (TTL) and ``sent`` ones are swept from their shelf by the
        next completion onto it; this keeps the ``failed`` index and the counters from growing, and
        sweeps every shelf now. Returns how many expired records it accounted for: the
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
            shelves = self._call(self._scan, _glob_escape(f"{self._stems[b]}d:") + "*")
            if shelves:  # counted above, by the counters
                self._run_scripts(self._sweep, [([name], []) for name in shelves])
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


class _Walk:
    """The matches of one query in one state, in the listing's order, across every bucket's index of the state
    (a sorted set by the time each record entered it).

    Each bucket's index is read a stretch at a time (ZRANGE BYSCORE, one pipeline for the buckets that need
    more); with a task, a reason or words, the stretch is checked by the listing script (one pipeline too) and
    only its matches are kept. A match is handed out once every bucket still being read has been read past it
    (the least of where they are), so no later record is ever handed out before an earlier one of another
    bucket. Without such a filter no record is read: the index is the answer."""

    def __init__(self, ledger: RedisLedger, query: RecordQuery, position: Position | None) -> None:
        assert query.state is not None
        self.ledger, self.query, self.newest = ledger, query, query.newest_first
        self.filtered = bool(query.task or query.reason or query.plain_words)
        self.index = [ledger._index(b, query.state) for b in range(ledger.buckets)]
        self.lo, self.hi = self.bounds(query)
        start = None if position is None else (position.at, position.key)
        #: Per bucket still being read: how far it has been read ((score, key); None: from the start).
        self.read: dict[int, tuple[float, str] | None] = dict.fromkeys(range(ledger.buckets), start)
        #: Per bucket: its matches read and not handed out yet, in order.
        self.pending: dict[int, list[tuple[float, str]]] = {b: [] for b in range(ledger.buckets)}
        #: The position the walk stands at: the last handed out, or where every bucket has been read to.
        self.last: Position | None = position
        self._batch = 0  # entries a bucket is read by at least (grows while a filter keeps too few)

    @staticmethod
    def bounds(query: RecordQuery) -> tuple[str, str]:
        """The index's score range for the query's time range (scores are microseconds). ``failed`` is scored
        by its expiry (the time it failed plus the retention): only the live ones, times checked by the caller."""
        us = 1_000_000
        if query.state is State.FAILED:
            return f"({time.time() * us:.17g}", "+inf"
        return ("-inf" if query.since is None else f"{query.since * us:.17g}",
                "+inf" if query.until is None else f"({query.until * us:.17g}")

    @property
    def ended(self) -> bool:
        return not self.read and not any(self.pending.values())

    def take(self, n: int) -> list[Position]:
        """The next ``n`` matches (fewer at the end)."""
        out: list[Position] = []
        while len(out) < n and not self.ended:
            missing = n - len(out)
            short = [b for b in self.read if len(self.pending[b]) < missing]
            if short:
                per_bucket = max(32, 2 * -(-missing // len(self.read)))
                kept = sum(len(p) for p in self.pending.values())
                self._fill(short, max(per_bucket, self._batch))
                if self.filtered and sum(len(p) for p in self.pending.values()) - kept < missing:
                    # The filter kept too few: read twice as much a bucket next time, up to LISTING_STRETCH.
                    self._batch = min(max(self._batch, per_bucket) * 2, LISTING_STRETCH)
            live = [p for p in self.read.values() if p is not None]
            frontier = (max(live) if self.newest else min(live)) if live else None
            ready = heapq.merge(*([p for p in pending if frontier is None or not _beyond(p, frontier, self.newest)]
                                  for pending in self.pending.values()), reverse=self.newest)
            taken = list(itertools.islice(ready, missing))
            gone = set(taken)
            for b in self.pending:  # what each bucket gave is the front of its pending
                while self.pending[b] and self.pending[b][0] in gone:
                    self.pending[b].pop(0)
            out += [Position(*p) for p in taken]
            if taken:
                self.last = out[-1]
            elif frontier is not None and self.filtered:
                self.last = Position(*frontier)  # read this far, nothing found: a later call starts here
        return out

    def _fill(self, buckets: list[int], batch: int) -> None:
        """Read the next ``batch`` entries of each of ``buckets``' indexes (and those tied with where it stands),
        then, with a filter, keep only the matches."""
        commands: list[tuple[str, tuple[Any, ...]]] = []
        for b in buckets:
            at = self.read[b]
            if self.newest:
                top = self.hi if at is None else f"({at[0]:.17g}"
                commands.append(("execute_command", ("ZRANGE", self.index[b], top, self.lo, "BYSCORE", "REV",
                                                     "LIMIT", 0, batch, "WITHSCORES")))
            else:
                low = self.lo if at is None else f"({at[0]:.17g}"
                commands.append(("execute_command", ("ZRANGE", self.index[b], low, self.hi, "BYSCORE",
                                                     "LIMIT", 0, batch, "WITHSCORES")))
            if at is not None:  # the entries with the very same score that follow its key
                score = f"{at[0]:.17g}"
                commands.append(("execute_command", ("ZRANGE", self.index[b], score, score, "BYSCORE",
                                                     "WITHSCORES")))
        replies = iter(self.ledger._pipeline(commands))
        read: dict[int, list[tuple[float, str]]] = {}
        for b in buckets:
            at = self.read[b]
            found = _scored(next(replies))
            ended = len(found) < batch
            if at is not None:
                ties = sorted(_scored(next(replies)), reverse=self.newest)
                found = [p for p in ties if _beyond(p, at, self.newest)] + found
            read[b] = found
            if ended:
                del self.read[b]  # its index ends here
            elif found:
                self.read[b] = found[-1]
        if self.filtered:
            checked = [b for b in buckets if read[b]]
            verdicts = self.ledger._run_scripts(self.ledger._listing, [
                self.ledger._check(self.query, b, [key for _, key in read[b]]) for b in checked])
            for b, flags in zip(checked, verdicts, strict=True):
                read[b] = [p for p, flag in zip(read[b], str(flags), strict=True) if flag == "1"]
        for b, found in read.items():
            self.pending[b] += found


def _scored(reply: list[Any]) -> list[tuple[float, str]]:
    """A ZRANGE ... WITHSCORES reply as (score, member) pairs: flat as Redis sends it, or in pairs as redis-py
    may hand it over."""
    if reply and isinstance(reply[0], (list, tuple)):
        return [(float(score), str(member)) for member, score in reply]
    return [(float(reply[i + 1]), str(reply[i])) for i in range(0, len(reply), 2)]


def _beyond(p: tuple[float, str], bound: tuple[float, str], newest_first: bool) -> bool:
    """Does ``p`` come after ``bound`` in the order?"""
    return p < bound if newest_first else p > bound


def _whole(text: str | None) -> tuple[Any, ...]:
    """``text`` as script arguments in the chunks' shape, in one piece: ``(1, text)``, or ``(0,)`` for none."""
    return (0,) if text is None else (1, text)


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
