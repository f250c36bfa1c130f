"""Redis ledger: ``redis://``, ``rediss://``, ``redis+cluster://`` and ``sentinel://``.

Each record is a hash; every transition is one Lua script (loaded once, called
with EVALSHA), so a claim, a completion or a replay is one atomic round trip.
Lease times come from the Redis server's clock (``TIME``), so worker clocks do
not have to agree.

**Buckets.** Keys are spread over ``buckets`` hash-tagged buckets (16 by default)
so that every script touches keys of one hash slot, as Redis Cluster requires::

    <prefix>:{<bb>}:r:<key>        the record (a hash)
    <prefix>:{<bb>}:i:<state>      the bucket's index of records in that state (a sorted set)
    <prefix>:{<bb>}:epoch          the bucket's epoch marker (a hash)

``bb`` is the bucket number in two hex digits, chosen by CRC32 of the intent key.
On one Redis the buckets cost nothing on the hot path; listing, stats and purge
visit every bucket.

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
the README ("Ledger loss").

Operator tools and the metrics scrape build the ledger ``passive``: they read the
markers and never write them (no ``auto_init``, no lost flags); only
:meth:`~RedisLedger.init_store` and :meth:`~RedisLedger.acknowledge_loss` do.

**Old layout.** Versions before the buckets kept ``<prefix>:r:<key>`` and
``<prefix>:i:<state>``. This version would not see those records, so at first use
it looks for the old index keys and refuses (:class:`UnsafeLedgerError`) if any exist.

The store must not evict keys: an evicted ``sent`` record reopens its key and
the next duplicate sends again. At first use the ledger reads
``maxmemory-policy`` and refuses anything but ``noeviction`` unless built with
``allow_eviction=True``. Run Redis with AOF persistence for the same reason.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import redis as redis_lib
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

from ..errors import (
    ConfigurationError,
    IllegalTransitionError,
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
_CANNOT_WRITE_NOW = (
    redis_lib.ConnectionError, redis_lib.TimeoutError,
    redis_lib.exceptions.OutOfMemoryError, redis_lib.exceptions.ReadOnlyError,
)

# KEYS: record, the bucket's index of each state in State order, the bucket's epoch marker.
# ARGV[1] is always the epoch the caller expects.
_PRELUDE = """
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local IDX = {claimed=KEYS[2], released=KEYS[3], sent=KEYS[4], failed=KEYS[5], review=KEYS[6]}
local function move(id, from, to, score)
  if from then redis.call('ZREM', IDX[from], id) end
  redis.call('ZADD', IDX[to], score, id)
end
local function lost()
  local m = redis.call('HMGET', KEYS[7], 'epoch', 'lost')
  return m[1] ~= ARGV[1] or m[2] ~= false
end
"""

# ARGV: epoch, id, task, owner, payload, fingerprint, lease_seconds
_CLAIM = _PRELUDE + """
if lost() then return {'lost'} end
local rec, id = KEYS[1], ARGV[2]
local n = now()
local lease = n + tonumber(ARGV[7])
local state = redis.call('HGET', rec, 'state')
if not state then
  redis.call('HSET', rec, 'task', ARGV[3], 'state', 'claimed', 'token', 1, 'owner', ARGV[4],
             'lease', lease, 'attempts', 1, 'reclaims', 0, 'payload', ARGV[5], 'fp', ARGV[6],
             'created', n, 'updated', n)
  move(id, nil, 'claimed', n)
  return {'acquired', tostring(n), tostring(lease)}
end
if state == 'claimed' and tonumber(redis.call('HGET', rec, 'lease')) > n then
  return {'busy', redis.call('HGETALL', rec)}
end
if state == 'claimed' or state == 'released' then
  local status = 'reopened'
  if state == 'claimed' then
    status = 'reclaimed'
    redis.call('HINCRBY', rec, 'reclaims', 1)
  end
  redis.call('HINCRBY', rec, 'token', 1)
  redis.call('HINCRBY', rec, 'attempts', 1)
  redis.call('HSET', rec, 'state', 'claimed', 'owner', ARGV[4], 'lease', lease, 'updated', n)
  move(id, state, 'claimed', n)
  return {status, redis.call('HGETALL', rec)}
end
return {'done', redis.call('HGETALL', rec)}
"""

# ARGV: epoch, id, token, target, result, error, retention_seconds, drop_payload ('1' erases it on sent)
# One HMGET, one HSET, one HDEL: every redis.call costs the server about a microsecond, per completion.
_FINISH = _PRELUDE + """
if lost() then return {'lost'} end
local rec, id, token, target = KEYS[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local cur = redis.call('HMGET', rec, 'state', 'token')
local state = cur[1]
if not state then return {'missing'} end
local held = tonumber(cur[2])
local mine = state == 'claimed' and held == token
local late_truth = target == 'sent' and token < held and
  (state == 'review' or state == 'released' or state == 'claimed')
if not (mine or late_truth) then return {'stale', state, tostring(held)} end
local n = now()
local final = target == 'sent' or target == 'failed'
local ttl = tonumber(ARGV[7])
local fields = {'state', target, 'updated', n}
if ARGV[5] ~= '' then table.insert(fields, 'result'); table.insert(fields, ARGV[5]) end
if ARGV[6] ~= '' then table.insert(fields, 'error'); table.insert(fields, ARGV[6]) end
if final then table.insert(fields, 'expires'); table.insert(fields, n + ttl) end
redis.call('HSET', rec, unpack(fields))
if target == 'sent' and ARGV[8] == '1' then
  redis.call('HDEL', rec, 'lease', 'payload')
else
  redis.call('HDEL', rec, 'lease')
end
if final then
  redis.call('PEXPIRE', rec, math.floor(ttl * 1000))
  move(id, state, target, n + ttl)
else
  redis.call('PERSIST', rec)
  move(id, state, target, n)
end
return {'ok'}
"""

# ARGV: epoch, token, lease_seconds
_RENEW = _PRELUDE + """
if lost() then return {'lost'} end
local rec = KEYS[1]
if redis.call('HGET', rec, 'state') ~= 'claimed' or
   tonumber(redis.call('HGET', rec, 'token')) ~= tonumber(ARGV[2]) then
  return {'no'}
end
redis.call('HSET', rec, 'lease', now() + tonumber(ARGV[3]))
return {'ok'}
"""

# An operator's change: replace the record if its token is still the expected one; never creates one.
# ARGV: id, expected_token, state, token, owner, result, error, updated, expires ('' = never), drop_payload
_FORCE = _PRELUDE + """
local rec, id = KEYS[1], ARGV[1]
local old = redis.call('HGET', rec, 'state')
if not old or tonumber(redis.call('HGET', rec, 'token')) ~= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', rec, 'state', ARGV[3], 'token', ARGV[4], 'owner', ARGV[5], 'result', ARGV[6],
           'error', ARGV[7], 'updated', ARGV[8], 'expires', ARGV[9])
redis.call('HDEL', rec, 'lease')
if ARGV[10] == '1' then redis.call('HDEL', rec, 'payload') end
if ARGV[9] ~= '' then
  move(id, old, ARGV[3], tonumber(ARGV[9]))
  redis.call('PEXPIRE', rec, math.max(1, math.floor((tonumber(ARGV[9]) - tonumber(ARGV[8])) * 1000)))
else
  move(id, old, ARGV[3], tonumber(ARGV[8]))
  redis.call('PERSIST', rec)
end
return 1
"""

# KEYS: record, the index it was found in. ARGV: id, state of that index, now.
_PURGE = """
local st = redis.call('HGET', KEYS[1], 'state')
if st == ARGV[2] then
  if tonumber(redis.call('HGET', KEYS[1], 'expires') or '0') > tonumber(ARGV[3]) then return 0 end
  redis.call('DEL', KEYS[1])
end
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: record. Erase the payload of an existing record; never creates one.
_FORGET = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[1], 'payload')
return 1
"""

# KEYS: a bucket's marker. ARGV: '1' to replace it ('0': only where there is none), then field, value, ...
_MARK = """
if ARGV[1] == '1' or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], unpack(ARGV, 2))
end
return 1
"""

# KEYS: a bucket's marker. Flag it lost unless an operator acknowledged a newer epoch there.
# ARGV: the epoch the flagging process knows to be dead ('' if none), reason, by, at
_FLAG = """
local m = redis.call('HMGET', KEYS[1], 'epoch', 'acked_at', 'lost')
if m[3] then return 0 end
if m[2] and m[1] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lost', ARGV[2], 'lost_by', ARGV[3], 'lost_at', ARGV[4])
return 1
"""

_STATES = (State.CLAIMED, State.RELEASED, State.SENT, State.FAILED, State.REVIEW)


def _num(value: Any, default: float | None = None) -> float | None:
    return default if value is None or value == "" else float(value)


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
    ``maxmemory-policy``; unsafe), ``keep_payload`` (keep the first payload after
    ``sent``, for audit), ``master_name`` (Sentinel), and any redis-py client keyword
    (timeouts default to 5 s).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "idemmail",
        buckets: int = DEFAULT_BUCKETS,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        auto_init: bool = True,
        passive: bool = False,
        allow_eviction: bool = False,
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
        client_options.setdefault("socket_timeout", 5.0)
        client_options.setdefault("socket_connect_timeout", 5.0)
        self.client: Any = _connect(url, master_name, client_options)
        self.prefix = prefix
        self.buckets = buckets
        self.auto_init = bool(auto_init) if not isinstance(auto_init, str) else auto_init.lower() == "true"
        self.passive = bool(passive)
        self.allow_eviction = allow_eviction
        self._checked = False
        self._check_lock = threading.Lock()
        self._epoch: str | None = None  # the epoch this process holds; None before the check or while lost
        # Once this process has seen the ledger lost: the epoch it held then ("" if none). From then on
        # only an epoch an operator acknowledged is accepted, whatever the markers say (emptied again,
        # flags and all, looks "new"). Cleared when an acknowledged epoch is adopted.
        self._dead_epoch: str | None = None
        self._lost_reason = ""
        # Hot-path connections of our own (see _direct); plain single-server clients only.
        self._direct_ok = type(getattr(self.client, "connection_pool", None)) is redis_lib.ConnectionPool
        self._spare: list[Any] = []
        self._spare_pid = os.getpid()
        self._claim = self.client.register_script(_CLAIM)
        self._finish_script = self.client.register_script(_FINISH)
        self._renew = self.client.register_script(_RENEW)
        self._force_script = self.client.register_script(_FORCE)
        self._purge = self.client.register_script(_PURGE)
        self._forget = self.client.register_script(_FORGET)
        self._flag = self.client.register_script(_FLAG)
        self._mark = self.client.register_script(_MARK)
        # Per bucket, built once: the record key's stem and the bucket's other keys (indexes, marker).
        self._stems = [f"{prefix}:{{{b:02x}}}:" for b in range(buckets)]
        self._tails = [[*(f"{stem}i:{s.value}" for s in _STATES), f"{stem}epoch"] for stem in self._stems]

    # -- keys --

    def _bucket(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.buckets

    def _rec(self, key: str) -> str:
        return f"{self._stems[self._bucket(key)]}r:{key}"

    def _keys(self, key: str) -> list[str]:
        b = zlib.crc32(key.encode()) % self.buckets
        return [f"{self._stems[b]}r:{key}", *self._tails[b]]

    def _index(self, bucket: int, state: State) -> str:
        return self._tails[bucket][_STATES.index(state)]

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
        if self._spare_pid != os.getpid():  # forked: never write on the parent's sockets
            self._spare, self._spare_pid = [], os.getpid()
        try:
            conn = self._spare.pop()
        except IndexError:
            conn = self.client.connection_pool.make_connection()
        try:
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
            try:
                policies = self._config_get("maxmemory-policy")
            except (redis_lib.ConnectionError, redis_lib.TimeoutError) as exc:
                raise LedgerUnavailableError(f"Redis ledger unreachable: {exc}") from exc
            except redis_lib.ResponseError as exc:  # CONFIG disabled (managed Redis)
                log.warning("idemmail: cannot read Redis maxmemory-policy (%s); make sure it is noeviction", exc)
                policies = []
            bad = sorted({p for p in policies if p != "noeviction"})
            if bad and not self.allow_eviction:
                raise UnsafeLedgerError(
                    f"Redis maxmemory-policy is {bad[0]!r}: evicted ledger records would reopen "
                    "their keys and re-send. Set it to 'noeviction' (or pass allow_eviction=True)."
                )
            self._check_layout()
            self._look(expected=None)
            self._checked = True

    def _check_layout(self) -> None:
        """Refuse a store that still holds the pre-bucket key layout (one pipeline, at first use)."""
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
        except _CANNOT_WRITE_NOW as exc:
            # Unreachable, out of memory (maxmemory with noeviction), or a replica after a
            # failover: Redis refused before the script wrote anything. Fail closed and retry,
            # like an outage; a raw error would fail the task and ack the message.
            raise LedgerUnavailableError(f"Redis ledger unavailable: {exc}") from exc

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

    def _record(self, key: str, flat: list[str] | dict[str, str]) -> Record:
        h = flat if isinstance(flat, dict) else dict(zip(flat[::2], flat[1::2], strict=True))
        return Record(
            key=key,
            task_name=h.get("task", ""),
            state=State(h["state"]),
            token=int(h["token"]),
            owner=h.get("owner", ""),
            lease_expires_at=_num(h.get("lease")),
            attempts=int(h.get("attempts", 0)),
            reclaims=int(h.get("reclaims", 0)),
            payload=h.get("payload"),
            fingerprint=h.get("fp", ""),
            result=loads_json(h.get("result")),
            error=loads_json(h.get("error")),
            created_at=_num(h.get("created"), 0.0) or 0.0,
            updated_at=_num(h.get("updated"), 0.0) or 0.0,
            expires_at=_num(h.get("expires")),
        )

    # -- epoch markers: loss detection --

    def _markers(self) -> list[dict[str, str]]:
        return self._pipeline([("hgetall", (self._marker(b),)) for b in range(self.buckets)])

    def _has_records(self) -> bool:
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
        for name in ("created_at", "created_by", "acked_at", "acked_by", "note"):
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
        fields = {"epoch": secrets.token_hex(8), "buckets": self.buckets, "created_at": time.time(),
                  "created_by": actor, "note": note}
        marker0 = self._marker(0)
        self._run_scripts(self._mark, [([marker0], ["0", *(x for kv in fields.items() for x in kv)])])
        fields["epoch"] = self._raw(self.client.hget, marker0, "epoch")
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
        fields = {"epoch": secrets.token_hex(8), "buckets": self.buckets, "created_at": now,
                  "created_by": actor or default_owner(), "acked_at": now, "acked_by": actor or default_owner(),
                  "note": note, "previous": before.get("epoch") or "", "loss": before["reason"]}
        self._write_markers(fields, replace=True)
        with self._check_lock:
            self._epoch, self._lost_reason, self._dead_epoch = str(fields["epoch"]), "", None
            self.recovered_at = now
        return self._judge(self._markers(), None, True)

    # -- contract --

    def claim(self, request: ClaimRequest) -> Claim:
        out = self._eval(self._claim, self._keys(request.key), self._claim_args(request))
        return self._claim_result(request, out)

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """The batch's claim scripts in one pipeline (one per node on a cluster)."""
        _check_unique(requests)
        if not requests:
            return []
        if not self._checked:
            self._check_store()

        def run() -> tuple[list[Any], str]:
            epoch = self._epoch or ""
            calls = [(self._keys(r.key), [epoch, *self._claim_args(r)]) for r in requests]
            outs = self._run_scripts(self._claim, calls, partial=True)
            failed = next((out for out in outs if isinstance(out, Exception)), None)
            if failed is not None:
                # A node failed (a cluster node down mid-batch) after the others ran their claims.
                try:
                    self._release_held(requests, outs, epoch, "batch_met_failed_node")
                except (redis_lib.RedisError, LedgerUnavailableError) as exc:  # their leases will run out
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
        return [self._claim_result(r, out) for r, out in zip(requests, outs, strict=True)]

    def _release_held(self, requests: Sequence[ClaimRequest], outs: list[Any], epoch: str, reason: str) -> None:
        """Hand back the claims a batch took before it gave up; nothing was sent under them.

        ``acquired`` and ``reopened`` claims are released: nothing had been sent for them. A
        ``reclaimed`` claim took over an expired lease whose holder may have sent: it stays
        claimed with its lease ended, so that the next claim reclaims it and the reclaim rules
        decide, as they would have here (released, the next claim would reopen it and send).
        """
        error = dumps_json({"reason": reason, "at": time.time()})
        release: list[tuple[list[str], list[Any]]] = []
        expire: list[tuple[list[str], list[Any]]] = []
        for r, out in zip(requests, outs, strict=True):
            if isinstance(out, Exception) or out[0] == "lost" or not ClaimStatus(out[0]).holds:
                continue
            token = self._claim_result(r, out).token
            if ClaimStatus(out[0]) is ClaimStatus.RECLAIMED:
                expire.append((self._keys(r.key), [epoch, token, 0]))
            else:
                release.append((self._keys(r.key), [epoch, r.key, token, State.RELEASED.value, "", error,
                                                    self.retention_seconds, "0"]))
        if release:
            self._run_scripts(self._finish_script, release)
        if expire:
            self._run_scripts(self._renew, expire)

    @staticmethod
    def _claim_args(request: ClaimRequest) -> list[Any]:
        return [request.key, request.task_name, request.owner, request.payload, request.fingerprint,
                request.lease_seconds]

    def _claim_result(self, request: ClaimRequest, out: list[Any]) -> Claim:
        status = ClaimStatus(out[0])
        if status is ClaimStatus.ACQUIRED:
            now, lease = float(out[1]), float(out[2])
            record = Record(
                key=request.key, task_name=request.task_name, state=State.CLAIMED, token=1,
                owner=request.owner, lease_expires_at=lease, attempts=1, reclaims=0,
                payload=request.payload, fingerprint=request.fingerprint,
                created_at=now, updated_at=now,
            )
            return Claim(status, record)
        return Claim(status, self._record(request.key, out[1]))

    def _finish(
        self,
        key: str,
        token: int,
        state: State,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        out = self._eval(
            self._finish_script, self._keys(key),
            [key, token, state.value, dumps_json(result) or "", dumps_json(error) or "",
             self.retention_seconds, "0" if self.keep_payload else "1"],
        )
        if out[0] == "missing":
            raise RecordNotFoundError(f"no ledger record for key {key}")
        if out[0] == "stale":
            raise StaleTokenError(
                f"token {token} no longer holds {key}: it is {out[1]} with token {out[2]}"
            )

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        return bool(self._eval(self._renew, self._keys(key), [token, lease_seconds])[0] == "ok")

    def get(self, key: str) -> Record | None:
        h = self._call(self.client.hgetall, self._rec(key))
        return self._record(key, h) if h else None

    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        if not self._checked:
            self._check_store()
        for b in range(self.buckets):
            for s in [state] if state else list(_STATES):
                ids = self._call(self.client.zrange, self._index(b, s), 0, -1)
                for i in range(0, len(ids), 500):
                    chunk = ids[i:i + 500]
                    for key, h in zip(chunk, self._pipeline([("hgetall", (self._rec(k),)) for k in chunk]),
                                      strict=True):
                        if h and h.get("state") == s.value:
                            yield self._record(key, h)

    def stats(self) -> dict[str, int]:
        """Records per state, from the indexes (one pipeline); expired ``sent``/``failed`` excluded."""
        if not self._checked:
            self._check_store()
        now = time.time()
        commands: list[tuple[str, tuple[Any, ...]]] = [
            ("zcount", (self._index(b, s), now if s.expires else "-inf", "+inf"))
            for b in range(self.buckets) for s in _STATES
        ]
        counts = {s.value: 0 for s in State}
        for (_, (name, *_)), n in zip(commands, self._pipeline(commands), strict=True):
            counts[name.rsplit(":", 1)[1]] += int(n)
        return counts

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        args = [key, expected_token, new.state.value, new.token, new.owner, dumps_json(new.result) or "",
                dumps_json(new.error) or "", new.updated_at, "" if new.expires_at is None else new.expires_at,
                "1" if new.payload is None or (new.state is State.SENT and not self.keep_payload) else "0"]
        return bool(self._call(self._force_script, keys=self._keys(key), args=args))

    def forget(self, key: str) -> bool:
        return bool(self._call(self._forget, keys=[self._rec(key)]))

    def purge_expired(self, now: float | None = None) -> int:
        if not self._checked:
            self._check_store()
        if now is None:
            now = time.time()
        gone = 0
        for b in range(self.buckets):
            for s in (State.SENT, State.FAILED):
                index = self._index(b, s)
                ids = self._call(self.client.zrangebyscore, index, "-inf", now)
                for i in range(0, len(ids), 500):
                    chunk = ids[i:i + 500]
                    gone += sum(self._run_scripts(self._purge, [([self._rec(k), index], [k, s.value, now])
                                                                for k in chunk]))
        return gone

    def ping(self) -> None:
        self._call(self.client.ping)

    def prepare(self) -> None:
        """Check the store (eviction policy, layout) and read the epoch this process holds."""
        if not self._checked:
            self._check_store()

    def close(self) -> None:
        spare, self._spare = self._spare, []
        if self._spare_pid == os.getpid():
            for conn in spare:
                conn.disconnect()
        self.client.close()


def _ledger_error(exc: Exception) -> Exception:
    """A connection or timeout error as :class:`LedgerUnavailableError` (tasks fail closed); others as they are."""
    if isinstance(exc, (redis_lib.ConnectionError, redis_lib.TimeoutError)):
        unavailable = LedgerUnavailableError(f"Redis ledger unreachable: {exc}")
        unavailable.__cause__ = exc
        return unavailable
    return exc


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
