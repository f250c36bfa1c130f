"""The Redis ledger's record moves (:class:`RedisLedger`), each one script run under this process's epoch."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..._common import logsafe
from ...errors import ConfigurationError, LedgerError, RecordNotFoundError, StaleTokenError
from ..base import (
    DEFAULT_RETENTION_SECONDS,
    Claim,
    ClaimRequest,
    ClaimStatus,
    Mark,
    Record,
    RosterEntry,
    State,
    _check_unique,
    check_roster_entry,
    dumps_json,
)
from .checks import StoreChecks
from .client import HotLine, connect, ledger_error
from .epochs import Epochs
from .layout import (
    _SWEEP_SPLIT,
    DEFAULT_BUCKETS,
    DEFAULT_SHELVES,
    Names,
    _body,
    _chunked,
    _counted,
    _counted_name,
    _field,
    _marked,
    _pack_fp,
    _seconds,
)
from .listing import Listing
from .plumbing import _live, log
from .scripts import register

#: A claim script's answer as its status (a dict: calling the Enum is slow).
_CLAIM_STATUS = {status.value: status for status in ClaimStatus}


class RedisLedger(Listing, Epochs, StoreChecks):
    """Ledger on Redis: one server (``redis://host:port/db``, ``rediss://``), a cluster
    (``redis+cluster://host:port[,host:port]``) or a Sentinel primary (``sentinel://h1:26379;sentinel://h2:26379``).

    Options: ``prefix`` ("idemmail"), ``buckets`` (16, fixed for the ledger's life), ``shelves`` (hashes per bucket
    holding ``sent`` records, 64; the markers' value wins once it exists), ``retention_seconds``, ``auto_init``
    (True: no markers and no records starts a new ledger; False: ``idemmail ledger init`` first), ``passive`` (never
    write markers: operator reads, metrics), ``allow_eviction`` (accept an evicting ``maxmemory-policy``; unsafe),
    ``policy_recheck_seconds`` (30: how often claims re-read the policy), ``keep_payload``, ``master_name``
    (Sentinel), any redis-py keyword (timeouts 5 s), or ``client``: your own redis-py client
    (``decode_responses=True``: your pool and instrumentation apply; never closed nor bypassed)."""

    marks_takeovers = True  # a reclaim from a holder without the write-ahead promise marks it 'unknown'

    def __init__(self, url: str | None = None, *, client: Any = None, prefix: str = "idemmail",
                 buckets: int = DEFAULT_BUCKETS, retention_seconds: float = DEFAULT_RETENTION_SECONDS,
                 shelves: int = DEFAULT_SHELVES, auto_init: bool = True, passive: bool = False,
                 allow_eviction: bool = False, policy_recheck_seconds: float = 30.0, keep_payload: bool = False,
                 master_name: str | None = None, **client_options: Any) -> None:
        super().__init__(retention_seconds=retention_seconds, keep_payload=keep_payload)
        self.names = Names(prefix, *_shape(prefix, buckets, shelves))
        self.prefix, self.buckets = prefix, self.names.buckets
        self.client, self._own_client = connect(url, client, master_name, client_options)
        self._line = HotLine.of(self.client, self._own_client)
        self.scripts = register(self.client)
        self.auto_init = bool(auto_init) if not isinstance(auto_init, str) else auto_init.lower() == "true"
        self.passive = bool(passive)
        self.allow_eviction = allow_eviction
        self.policy_recheck_seconds = float(policy_recheck_seconds)
        self._check_lock = threading.Lock()
        self._retention_ms = max(1, int(self.retention_seconds * 1000))
        _live.add(self)

    def _check_store(self) -> None:
        """Once, before the first command: the server's checks, then the markers, settling this process's epoch."""
        if self._checked:
            return
        with self._check_lock:
            if self._checked:
                return
            self._check_server()
            self._look(expected=None)
            self._checked = True

    def prepare(self) -> None:
        """Check the store (eviction policy, persistence, version, markers) and read the epoch this process holds."""
        self._check_store()

    def ping(self) -> None:
        self._call(self.client.ping)

    def _eval(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a record script under this process's epoch; on a ``lost`` answer, look at the markers."""
        self._check_store()
        out = self._script(script, keys, [self._epoch or "", *args])
        if out[0] == "lost":
            self._confirm_loss()  # raises unless an acknowledged epoch was adopted
            out = self._script(script, keys, [self._epoch, *args])
            if out[0] == "lost":
                raise self._lost_error()
        return out

    def _granule_ms(self) -> int:
        """Width of a counter granule (µs): a record counts until the end of its expiry's granule (<= 1% late)."""
        return max(1, min(60_000_000, int(self.retention_seconds * 10_000)))

    def _sweep_ms(self) -> int:
        """How often a shelf's dead entries are swept (ms): see :data:`~.layout._SWEEP_SPLIT`."""
        return max(1_000, self._retention_ms // _SWEEP_SPLIT)

    # -- the moves --

    def claim(self, request: ClaimRequest) -> Claim:
        if self._checked:
            self._watch_policy()
        return self._claim_result(request, self._eval(self.scripts["claim"], self._claim_keys(request.key),
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
            outs = self._run_scripts(self.scripts["claim"], calls, partial=True)
            failed = next((out for out in outs if isinstance(out, Exception)), None)
            if failed is not None:  # a cluster node failed mid-batch, after the others ran their claims
                try:
                    self._release_held(requests, outs, epoch, "batch_met_failed_node")
                except LedgerError as exc:  # their leases will run out
                    log.warning("idemmail: Redis ledger %s: could not hand back a failed batch's claims: %s",
                                self.prefix, logsafe(exc))
                raise ledger_error(failed)
            return outs, epoch

        outs, epoch = run()
        if any(out[0] == "lost" for out in outs):
            # Hand back what the other buckets gave before the loss is flagged and refuses that too.
            self._release_held(requests, outs, epoch, "batch_met_lost_ledger")
            self._confirm_loss()
            outs, epoch = run()
            if any(out[0] == "lost" for out in outs):
                self._release_held(requests, outs, epoch, "batch_met_lost_ledger")
                raise self._lost_error()
        return [self._claim_result(r, out) for r, out in zip(requests, outs, strict=True)]

    def _release_held(self, requests: Sequence[ClaimRequest], outs: list[Any], epoch: str, reason: str) -> None:
        """Hand back a failed batch's claims (nothing sent under them): ``acquired`` and ``reopened`` are released, a
        ``reclaimed`` one keeps its claim with the lease ended (reclaim rules decide), a ``resumed`` one its chain."""
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
            self._run_scripts(self.scripts["finish"], release)
        if expire:
            self._run_scripts(self.scripts["renew"], expire)

    def _claim_args(self, request: ClaimRequest) -> list[Any]:
        return [request.key, request.payload, _pack_fp(request.fingerprint), int(request.lease_seconds * 1000),
                request.resume_owner or "", *_counted_name(request.task_name), *_counted(request.owner),
                "1" if request.writes_ahead else "", _field(request.key)]

    def _claim_result(self, request: ClaimRequest, out: list[Any]) -> Claim:
        status = _CLAIM_STATUS[out[0]]
        if status is ClaimStatus.ACQUIRED:
            now, lease = int(out[1]) / 1_000_000, int(out[2]) / 1_000_000
            return Claim(status, Record(
                key=request.key, task_name=request.task_name, state=State.CLAIMED, token=1, owner=request.owner,
                lease_expires_at=lease, attempts=1, reclaims=0, payload=request.payload,
                fingerprint=request.fingerprint, created_at=now, updated_at=now, writes_ahead=request.writes_ahead))
        if status is ClaimStatus.DONE:
            if len(out) > 3:  # shelved
                return Claim(status, self._entry_record(request.key, out[3], out[2]))
            return Claim(status, self._record(request.key, out[1], out[2]))
        previous = str(out[3]) if len(out) > 3 and out[3] else None  # who held it before (taken over)
        return Claim(status, self._record(request.key, out[1], out[2]), previous_owner=previous,
                     previous_writes_ahead=previous is not None and len(out) > 4 and out[4] == "1")

    def _finish(self, key: str, token: int, state: State, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, mark: Mark | None = None) -> float | None:
        out = self._eval(self.scripts["finish"], self._keys(key),
                         self._finish_args(key, token, state, result, error, mark))
        if out[0] == "missing":
            raise RecordNotFoundError(f"no ledger record for key {key}")
        if out[0] == "stale":
            raise StaleTokenError(f"token {token} no longer holds {key}: it is {out[1]} with token {out[2]}")
        return _seconds(str(out[1])) if len(out) > 1 else None  # the time written, as a read gives it back

    def _finish_args(self, key: str, token: int, state: State, result: dict[str, Any] | None,
                     error: dict[str, Any] | None, mark: Mark | None = None) -> list[Any]:
        if state is State.SENT:
            # The script reads a sent record's result and error whole: one "chunk" each (every argument costs).
            texts = [*_whole(dumps_json(result)), *_whole(dumps_json(error)), 0]
        else:
            texts = [*_chunked(result), *_chunked(error), *_marked(mark)]
        return [key, token, state.value, int(self.retention_seconds * 1000), "0" if self.keep_payload else "1",
                self._granule_ms(), *texts, _field(key), self._retention_ms,
                self._sweep_ms(), _body(result, error) if state is State.SENT else ""]

    def renew(self, key: str, token: int, lease_seconds: float) -> bool:
        return bool(self._eval(self.scripts["renew"], self._keys(key), [token, int(lease_seconds * 1000)])[0] == "ok")

    def withdraw(self, key: str, token: int) -> bool:
        """One script: the record, its payload and its index entry go together (see :meth:`Ledger.withdraw`)."""
        return bool(self._eval(self.scripts["withdraw"], self._keys(key), [key, token])[0] == "ok")

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        """The lease's renewal with the mark written in the same script (see :meth:`Ledger.write_ahead`)."""
        args = [token, int(lease_seconds * 1000), *_marked(Mark(stage, time.time(), token, owner))]
        return bool(self._eval(self.scripts["renew"], self._keys(key), args)[0] == "ok")

    def get(self, key: str) -> Record | None:
        self._check_store()
        out = self._call(self.scripts["read"], keys=self._keys(key), args=[_field(key)])
        h = dict(zip(out[0][::2], out[0][1::2], strict=True))
        if h:
            return self._record(key, h, out[1])
        return self._entry_record(key, out[2], out[1]) if len(out) > 2 else None

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        ttl = "" if new.expires_at is None else int((new.expires_at - new.updated_at) * 1000)
        drop = new.payload is None or (new.state is State.SENT and not self.keep_payload)
        args = [key, expected_token, new.state.value, new.token, repr(float(new.updated_at)), ttl,
                "1" if drop else "0", self._granule_ms(), _field(key), "1" if new.writes_ahead else "",
                _pack_fp(new.fingerprint),
                repr(float(new.created_at)), new.attempts, new.reclaims, *_counted(new.owner), *_chunked(new.result),
                *_chunked(new.error), *_marked(new.mark), *_chunked(new.resolution), *_counted(new.task_name)]
        return bool(self._call(self.scripts["force"], keys=self._keys(key), args=args))

    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None, resolution: dict[str, Any] | None) -> bool:
        args = [expected_token, expected_state.value, *_chunked(result), *_chunked(error), *_chunked(resolution),
                _field(key), _body(result, error)]
        return bool(self._call(self.scripts["erase"], keys=self._keys(key), args=args))

    def mark_hop(self, key: str, hop: str, ttl_seconds: float) -> bool:
        """A mark set if absent holding this call's nonce: sent again after a lost reply, still True (unlike SET NX)."""
        nonce = secrets.token_hex(8)
        return bool(self._call(self.scripts["hop"], keys=[self._hop_name(key, hop)],
                               args=[nonce, max(1, int(ttl_seconds * 1000))]))

    def hop_marked(self, key: str, hop: str) -> bool:
        """One ``EXISTS`` of the mark (it expires by its TTL)."""
        return bool(self._call(self.client.exists, self._hop_name(key, hop)))

    def _hop_name(self, key: str, hop: str) -> str:
        return self.names.hop(key, hashlib.blake2b(f"{key}\0{hop}".encode(), digest_size=16).hexdigest())

    def announce(self, member: str, secret_ids: Sequence[str], ttl_seconds: float) -> None:
        """One script on the roster hash, expiring on the server's clock (hosts' clocks need not agree)."""
        ids = check_roster_entry(member, secret_ids)
        self._call(self.scripts["roster"], keys=[self.names.roster()], args=[member, ids, int(ttl_seconds * 1000)])

    def roster(self) -> list[RosterEntry]:
        out = self._call(self.scripts["roster"], keys=[self.names.roster()], args=["", "", 0])
        return [RosterEntry(str(out[i]), tuple(str(out[i + 2]).split(",")), int(out[i + 1]) / 1000)
                for i in range(0, len(out), 3)]

    def purge_expired(self, now: float | None = None) -> int:
        """Drop expired ``failed`` index entries and spent sent-counter granules (returns how many records they
        held), and sweep every shelf (records go by TTL or by the next completion's sweep)."""
        self._check_store()
        now_us = (time.time() if now is None else now) * 1_000_000
        gone = 0
        for b in range(self.buckets):
            index = self.names.index(b, State.FAILED)
            ids = self._call(self.client.zrangebyscore, index, "-inf", now_us)
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                calls = [([self.names.record(k), index, self.names.payload(k)], [k, State.FAILED.value]) for k in chunk]
                gone += sum(self._run_scripts(self.scripts["purge"], calls))
            counter = self.names.counter(b)
            spent = {k: int(v) for k, v in self._call(self.client.hgetall, counter).items() if int(k) <= now_us}
            if spent:
                self._call(self.client.hdel, counter, *spent)
                gone += sum(spent.values())
            shelves = self._call(self._scan, self.names.shelves_of(b))
            if shelves:  # counted above, by the counters
                self._run_scripts(self.scripts["sweep"], [([name], []) for name in shelves])
        return gone


def _shape(prefix: str, buckets: int, shelves: int) -> tuple[int, int]:
    """The bucket count and shelves per bucket, checked (and the prefix: no hash tag)."""
    if "{" in prefix or "}" in prefix:
        raise ConfigurationError(f"Redis ledger prefix {prefix!r} must not contain braces (hash tags)")
    buckets, shelves = int(buckets), int(shelves)
    if not 1 <= buckets <= 256:
        raise ConfigurationError(f"buckets must be between 1 and 256, not {buckets}")
    if not 1 <= shelves <= 65536:
        raise ConfigurationError(f"shelves must be between 1 and 65536, not {shelves}")
    return buckets, shelves


def _whole(text: str | None) -> tuple[Any, ...]:
    """``text`` as script arguments in one chunk: ``(1, text)``, or ``(0,)`` for none."""
    return (0,) if text is None else (1, text)
