"""Redis ledger: ``redis://`` and ``rediss://``.

Each record is a hash; every transition is one Lua script (loaded once, called
with EVALSHA), so a claim, a completion or a replay is one atomic round trip.
Lease times come from the Redis server's clock (``TIME``), so worker clocks do
not have to agree.

The store must not evict keys: an evicted ``sent`` record reopens its key and
the next duplicate sends again. At first use the ledger reads
``maxmemory-policy`` and refuses anything but ``noeviction`` unless built with
``allow_eviction=True``. Run Redis with AOF persistence for the same reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import redis as redis_lib

from ..errors import LedgerUnavailableError, RecordNotFoundError, StaleTokenError, UnsafeLedgerError
from .base import (
    DEFAULT_RETENTION_SECONDS,
    Claim,
    ClaimRequest,
    ClaimStatus,
    Ledger,
    Record,
    State,
    _check_unique,
    dumps_json,
    loads_json,
)

log = logging.getLogger(__name__)

# KEYS: record, then the index sorted set of each state in State order.
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
"""

# ARGV: id, task, owner, payload, fingerprint, lease_seconds
_CLAIM = _PRELUDE + """
local rec, id = KEYS[1], ARGV[1]
local n = now()
local lease = n + tonumber(ARGV[6])
local state = redis.call('HGET', rec, 'state')
if not state then
  redis.call('HSET', rec, 'task', ARGV[2], 'state', 'claimed', 'token', 1, 'owner', ARGV[3],
             'lease', lease, 'attempts', 1, 'reclaims', 0, 'payload', ARGV[4], 'fp', ARGV[5],
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
  redis.call('HSET', rec, 'state', 'claimed', 'owner', ARGV[3], 'lease', lease, 'updated', n)
  move(id, state, 'claimed', n)
  return {status, redis.call('HGETALL', rec)}
end
return {'done', redis.call('HGETALL', rec)}
"""

# ARGV: id, token, target, result, error, retention_seconds, drop_payload ('1' erases it on sent)
_FINISH = _PRELUDE + """
local rec, id, token, target = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3]
local state = redis.call('HGET', rec, 'state')
if not state then return {'missing'} end
local held = tonumber(redis.call('HGET', rec, 'token'))
local mine = state == 'claimed' and held == token
local late_truth = target == 'sent' and token < held and
  (state == 'review' or state == 'released' or state == 'claimed')
if not (mine or late_truth) then return {'stale', state, tostring(held)} end
local n = now()
redis.call('HSET', rec, 'state', target, 'updated', n)
redis.call('HDEL', rec, 'lease')
if ARGV[4] ~= '' then redis.call('HSET', rec, 'result', ARGV[4]) end
if ARGV[5] ~= '' then redis.call('HSET', rec, 'error', ARGV[5]) end
if target == 'sent' and ARGV[7] == '1' then redis.call('HDEL', rec, 'payload') end
if target == 'sent' or target == 'failed' then
  local ttl = tonumber(ARGV[6])
  redis.call('HSET', rec, 'expires', n + ttl)
  redis.call('PEXPIRE', rec, math.floor(ttl * 1000))
  move(id, state, target, n + ttl)
else
  redis.call('PERSIST', rec)
  move(id, state, target, n)
end
return {'ok'}
"""

# ARGV: token, lease_seconds
_RENEW = _PRELUDE + """
local rec = KEYS[1]
if redis.call('HGET', rec, 'state') ~= 'claimed' or
   tonumber(redis.call('HGET', rec, 'token')) ~= tonumber(ARGV[1]) then
  return 0
end
redis.call('HSET', rec, 'lease', now() + tonumber(ARGV[2]))
return 1
"""

_STATES = (State.CLAIMED, State.RELEASED, State.SENT, State.FAILED, State.REVIEW)


def _num(value: Any, default: float | None = None) -> float | None:
    return default if value is None or value == "" else float(value)


class RedisLedger(Ledger):
    """Ledger on one Redis server (``redis://host:port/db``, ``rediss://`` for TLS).

    Options: ``prefix`` (key prefix, default ``"idemmail"``), ``retention_seconds``,
    ``allow_eviction`` (accept an evicting ``maxmemory-policy``; unsafe), ``keep_payload``
    (keep the first payload after ``sent``, for audit), and any
    ``redis.Redis.from_url`` keyword (timeouts default to 5 s).
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "idemmail",
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        allow_eviction: bool = False,
        keep_payload: bool = False,
        **client_options: Any,
    ) -> None:
        super().__init__(retention_seconds=retention_seconds, keep_payload=keep_payload)
        client_options.setdefault("socket_timeout", 5.0)
        client_options.setdefault("socket_connect_timeout", 5.0)
        self.client: redis_lib.Redis = redis_lib.Redis.from_url(url, decode_responses=True, **client_options)
        self.prefix = prefix
        self.allow_eviction = allow_eviction
        self._checked = False
        self._check_lock = threading.Lock()
        self._claim = self.client.register_script(_CLAIM)
        self._finish_script = self.client.register_script(_FINISH)
        self._renew = self.client.register_script(_RENEW)

    # -- keys --

    def _rec(self, key: str) -> str:
        return f"{self.prefix}:r:{key}"

    def _keys(self, key: str) -> list[str]:
        return [self._rec(key), *(f"{self.prefix}:i:{s.value}" for s in _STATES)]

    def _index(self, state: State) -> str:
        return f"{self.prefix}:i:{state.value}"

    # -- plumbing --

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._checked:
            self._check_store()
        try:
            return fn(*args, **kwargs)
        except (redis_lib.ConnectionError, redis_lib.TimeoutError) as exc:
            raise LedgerUnavailableError(f"Redis ledger unreachable: {exc}") from exc

    def _check_store(self) -> None:
        with self._check_lock:
            if self._checked:
                return
            try:
                policy = self.client.config_get("maxmemory-policy").get("maxmemory-policy")
            except (redis_lib.ConnectionError, redis_lib.TimeoutError) as exc:
                raise LedgerUnavailableError(f"Redis ledger unreachable: {exc}") from exc
            except redis_lib.ResponseError as exc:  # CONFIG disabled (managed Redis)
                log.warning("idemmail: cannot read Redis maxmemory-policy (%s); make sure it is noeviction", exc)
                policy = None
            if policy and policy != "noeviction" and not self.allow_eviction:
                raise UnsafeLedgerError(
                    f"Redis maxmemory-policy is {policy!r}: evicted ledger records would reopen "
                    "their keys and re-send. Set it to 'noeviction' (or pass allow_eviction=True)."
                )
            self._checked = True

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

    # -- contract --

    def claim(self, request: ClaimRequest) -> Claim:
        return self._claim_result(request, self._call(self._claim, **self._claim_call(request)))

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """The batch's claim scripts in one pipeline (plus a SCRIPT EXISTS check by redis-py)."""
        _check_unique(requests)
        if not requests:
            return []
        def run() -> list[Any]:
            # EVALSHA directly: a Script object in a pipeline costs an extra SCRIPT EXISTS each time.
            pipe = self.client.pipeline(transaction=False)
            for r in requests:
                call = self._claim_call(r)
                pipe.evalsha(self._claim.sha, len(call["keys"]), *call["keys"], *call["args"])
            return list(self._call(pipe.execute))

        try:
            outs = run()
        except redis_lib.exceptions.NoScriptError:  # the server lost its scripts (restart): nothing ran
            self._claim.sha = self._call(self.client.script_load, _CLAIM)
            outs = run()
        return [self._claim_result(r, out) for r, out in zip(requests, outs, strict=True)]

    def _claim_call(self, request: ClaimRequest) -> dict[str, Any]:
        return {
            "keys": self._keys(request.key),
            "args": [request.key, request.task_name, request.owner, request.payload,
                     request.fingerprint, request.lease_seconds],
        }

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
        out = self._call(
            self._finish_script,
            keys=self._keys(key),
            args=[key, token, state.value, dumps_json(result) or "", dumps_json(error) or "",
                  self.retention_seconds, "0" if self.keep_payload else "1"],
        )
        if out[0] == "missing":
            raise RecordNotFoundError(f"no ledger record for key {key}")
        if out[0] == "stale":
            raise StaleTokenError(
                f"token {token} no longer holds {key}: it is {out[1]} with token {out[2]}"
            )

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        return bool(self._call(self._renew, keys=self._keys(key), args=[token, lease_seconds]))

    def get(self, key: str) -> Record | None:
        h = self._call(self.client.hgetall, self._rec(key))
        return self._record(key, h) if h else None

    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        for s in [state] if state else list(_STATES):
            for key in self._call(self.client.zrange, self._index(s), 0, -1):
                record = self.get(key)
                if record is not None and record.state is s:
                    yield record

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        rec = self._rec(key)

        def change(pipe: Any) -> bool:
            h = pipe.hgetall(rec)
            if not h or int(h["token"]) != expected_token:
                return False
            old_state = h["state"]
            mapping = {
                "state": new.state.value, "token": new.token, "owner": new.owner,
                "result": dumps_json(new.result) or "", "error": dumps_json(new.error) or "",
                "updated": new.updated_at, "expires": "" if new.expires_at is None else new.expires_at,
            }
            pipe.multi()
            pipe.hset(rec, mapping=mapping)
            pipe.hdel(rec, "lease")
            pipe.zrem(f"{self.prefix}:i:{old_state}", key)
            pipe.zadd(self._index(new.state), {key: new.expires_at or new.updated_at})
            if new.expires_at is not None:
                pipe.pexpire(rec, max(1, int((new.expires_at - new.updated_at) * 1000)))
            else:
                pipe.persist(rec)
            return True

        try:
            return bool(self._call(self.client.transaction, change, rec, value_from_callable=True))
        except redis_lib.WatchError:
            return False

    def forget(self, key: str) -> bool:
        rec = self._rec(key)
        pipe = self.client.pipeline(transaction=True)
        pipe.exists(rec)
        pipe.hdel(rec, "payload")
        exists, _ = self._call(pipe.execute)
        return bool(exists)

    def purge_expired(self, now: float | None = None) -> int:
        if now is None:
            sec, usec = self._call(self.client.time)
            now = sec + usec / 1e6
        gone = 0
        for s in (State.SENT, State.FAILED):
            for key in self._call(self.client.zrangebyscore, self._index(s), "-inf", now):
                record = self.get(key)
                if record is None or record.state is not s or (record.expires_at or 0) <= now:
                    pipe = self.client.pipeline()
                    if record is not None and record.state is s:
                        pipe.delete(self._rec(key))
                    pipe.zrem(self._index(s), key)
                    self._call(pipe.execute)
                    gone += 1
        return gone

    def ping(self) -> None:
        self._call(self.client.ping)

    def close(self) -> None:
        self.client.close()
