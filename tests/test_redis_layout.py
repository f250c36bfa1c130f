"""The Redis ledger's lean record: compact ``sent`` records without an index, listed by SCAN, counted by
counters; long results and errors in chunks; a store of the previous layout refused, then migrated."""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

from idemmail_celery.errors import UnsafeLedgerError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, State, from_url
from idemmail_celery.ledger.redis import RedisLedger

from .conftest import REDIS_URL, drop_ledger, make_ledger, unique

LONG_PAYLOAD = json.dumps({"args": [], "kwargs": {"to": "ann@example.com", "html": "<p>" + "x" * 500}})


def hexkey() -> str:
    return os.urandom(32).hex()


def req(key: str, payload: str = LONG_PAYLOAD, fingerprint: str = "") -> ClaimRequest:
    return ClaimRequest(key=key, task_name="idemmail_celery.send_email", payload=payload,
                        fingerprint=fingerprint or "ab" * 32)


@pytest.fixture
def led(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisLedger]:
    ledger = make_ledger("redis", tmp_path_factory)
    assert isinstance(ledger, RedisLedger)
    yield ledger
    drop_ledger(ledger)


def test_a_sent_record_is_compact_and_in_no_index(led: RedisLedger) -> None:
    key = hexkey()
    claim = led.claim(req(key))  # a long payload: the claimed record is a hashtable
    message_id = "0100018c2b7f4a5e-3f2a1b4c-5d6e-4f70-8a9b-0c1d2e3f4a5b-000000"
    result = {"message_id": message_id, "value": {"message_id": message_id, "provider": "ses"}}
    led.complete(key, claim.token, result)
    name = led._rec(key)
    assert key not in name and len(name) == len(led.prefix) + 6 + 2 + 43  # the key packed, 43 characters
    assert led.client.object("encoding", name) == "listpack"  # rewritten: compact again
    assert int(led.client.memory_usage(name)) <= 512  # was 1,200 (hashtable, long field names, floats)
    assert 0 < led.client.pttl(name) <= led.retention_seconds * 1000
    members = [m for b in range(led.buckets) for s in State for m in led.client.zrange(led._index(b, s), 0, -1)]
    assert key not in members  # no sent index: it expires by TTL
    record = led.get(key)
    assert record is not None and record.state is State.SENT and record.result == result
    assert record.fingerprint == "ab" * 32 and record.payload is None and record.task_name.endswith("send_email")
    assert led.claim(req(key)).status is ClaimStatus.DONE


def test_sent_records_are_listed_by_scan_counted_and_purged(led: RedisLedger) -> None:
    led.retention_seconds = 0.5
    keys = [hexkey() for _ in range(30)] + ["plain-key", "glob*[key]?"]
    for k in keys:
        led.complete(k, led.claim(req(k)).token, {"message_id": k})
    parked = led.claim(req("parked"))
    led.park("parked", parked.token, {"reason": "ambiguous"})
    assert sorted(r.key for r in led.iter_records(State.SENT)) == sorted(keys)
    assert sorted(r.key for r in led.iter_records()) == sorted([*keys, "parked"])
    assert [r.key for r in led.iter_records(State.REVIEW)] == ["parked"]
    assert {k: v for k, v in led.stats().items() if v} == {"sent": len(keys), "review": 1}
    time.sleep(0.7)
    assert list(led.iter_records(State.SENT)) == []
    assert {k: v for k, v in led.stats().items() if v} == {"review": 1}
    assert led.purge_expired() == len(keys)  # the counters' spent granules, and what they counted
    assert not any(led.client.hlen(led._counter(b)) for b in range(led.buckets))
    assert led.purge_expired() == 0


def test_long_and_non_ascii_results_and_errors_round_trip_in_chunks(led: RedisLedger) -> None:
    text = "Grüße, Ann — 你好 🙂 " * 20  # multi-byte characters across every 64-byte cut
    c = led.claim(req("chunks"))
    led.park("chunks", c.token, {"reason": "timeout", "message": text})
    record = led.get("chunks")
    assert record is not None and record.error == {"reason": "timeout", "message": text}
    resolved = led.resolve("chunks", "sent", result={"message_id": "m", "note": text[:200]}, note=text)
    assert led.get("chunks") == resolved
    assert led.client.object("encoding", led._rec("chunks")) == "listpack"
    assert led.forget("chunks") is True
    forgotten = led.get("chunks")
    assert forgotten is not None and forgotten.result == {"message_id": "m", "forgotten": True}
    assert forgotten.error is not None and "message" not in forgotten.error
    assert forgotten.error["resolution"]["from"] == "review"  # read back whole: no stale chunk joined in
    assert led.client.pttl(led._rec("chunks")) > 0  # forget left the TTL alone


def _layout1(prefix: str, buckets: int = 16) -> Any:
    """Write what the previous version wrote: markers without a layout, long field names, seconds,
    an index for every state (sent included). Returns the client and the records written."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    now = time.time()
    for b in range(buckets):
        client.hset(f"{prefix}:{{{b:02x}}}:epoch", mapping={"epoch": "e1", "buckets": buckets, "created_at": now,
                                                           "created_by": "old", "note": "auto_init"})
    fp = "cd" * 32
    records = {
        "claimed": {"state": "claimed", "token": 3, "owner": "old:1:aa", "lease": now + 600, "payload": LONG_PAYLOAD},
        "released": {"state": "released", "token": 2, "owner": "old:1:bb", "payload": LONG_PAYLOAD,
                     "error": json.dumps({"reason": "connect_error"})},
        "review": {"state": "review", "token": 1, "owner": "old:1:cc", "payload": LONG_PAYLOAD,
                   "error": json.dumps({"reason": "timeout", "message": "x" * 150})},
        "sent": {"state": "sent", "token": 1, "owner": "old:1:dd", "result": json.dumps({"message_id": "m-old"}),
                 "expires": now + 3600},
        "failed": {"state": "failed", "token": 1, "owner": "old:1:ee", "payload": LONG_PAYLOAD,
                   "error": json.dumps({"reason": "bounced"}), "expires": now + 3600},
    }
    keys = {}
    for state, fields in records.items():
        key = hexkey() if state != "review" else "review-key"
        keys[state] = key
        stem = f"{prefix}:{{{zlib.crc32(key.encode()) % buckets:02x}}}:"
        client.hset(f"{stem}r:{key}", mapping={"task": "idemmail_celery.send_email", "attempts": 1, "reclaims": 0,
                                               "fp": fp, "created": now - 10, "updated": now - 5, **fields})
        if state in ("sent", "failed"):
            client.pexpire(f"{stem}r:{key}", 3_600_000)
        client.zadd(f"{stem}i:{state}", {key: float(str(fields.get("expires", now - 5)))})
    return client, keys, fp


def test_a_store_of_the_previous_layout_is_refused_then_migrated_and_settles() -> None:
    prefix = unique("v1")
    client, keys, fp = _layout1(prefix)
    try:
        led = from_url(REDIS_URL, prefix=prefix)
        assert isinstance(led, RedisLedger)
        with pytest.raises(UnsafeLedgerError, match="migrate_layout"):
            led.claim(req(hexkey()))
        assert RedisLedger(REDIS_URL, prefix=prefix).migrate_layout() == {
            "claimed": 1, "released": 1, "sent": 1, "failed": 1, "review": 1, "left": 0}
        assert not [n for n in client.scan_iter(f"{prefix}:*i:sent")]  # the sent index is gone
        assert RedisLedger(REDIS_URL, prefix=prefix).migrate_layout()["left"] == 0  # idempotent

        led = from_url(REDIS_URL, prefix=prefix)  # what a new worker builds
        assert {k: v for k, v in led.stats().items() if v} == {
            "claimed": 1, "released": 1, "sent": 1, "failed": 1, "review": 1}
        sent = led.claim(req(keys["sent"], fingerprint=fp))
        assert sent.status is ClaimStatus.DONE and sent.record.result == {"message_id": "m-old"}
        assert sent.record.fingerprint == fp and sent.record.token == 1
        assert 0 < client.pttl(led._rec(keys["sent"])) <= 3_600_000  # its TTL kept
        assert led.claim(req(keys["claimed"])).status is ClaimStatus.BUSY  # its lease kept
        led.complete(keys["claimed"], 3, {"message_id": "m-late"})  # the old holder's token still settles it
        reopened = led.claim(req(keys["released"], payload="{}"))
        assert reopened.status is ClaimStatus.REOPENED and reopened.record.payload == LONG_PAYLOAD
        assert reopened.record.token == 3 and reopened.record.attempts == 2
        review = led.get("review-key")
        assert review is not None and review.error == {"reason": "timeout", "message": "x" * 150}
        led.resolve("review-key", "failed", note="checked")
        failed = led.claim(req(keys["failed"]))
        assert failed.status is ClaimStatus.DONE and failed.record.error == {"reason": "bounced"}
        assert sorted(r.key for r in led.iter_records(State.SENT)) == sorted([keys["claimed"], keys["sent"]])
    finally:
        for name in client.scan_iter(f"{prefix}:*"):
            client.delete(name)


def test_a_workers_long_owner_and_task_name_keep_the_record_compact(led: RedisLedger) -> None:
    """A worker's owner is host:pid:<task id>:<nonce>, 80 bytes and more: stored in chunks, so the
    hash stays listpack, and compared whole when its chain resumes it."""
    host_pid = "email-worker-7d9f8b6c5d-x2k4p.prod.svc.cluster.local:1234567"
    first = f"{host_pid}:0c2d9a8e-5b7f-4c1e-9a3d-6f8e2b1c4d5a:aaaaaaaa"
    task = "myproject.notifications.transactional.tasks.send_password_reset_email_v2"
    key = hexkey()
    claim = led.claim(ClaimRequest(key=key, task_name=task, payload=LONG_PAYLOAD, fingerprint="ab" * 32, owner=first))
    assert led.client.object("encoding", led._rec(key)) == "listpack"
    again = f"{host_pid}:0c2d9a8e-5b7f-4c1e-9a3d-6f8e2b1c4d5a:bbbbbbbb"
    resumed = led.claim(ClaimRequest(key=key, task_name=task, payload="{}", fingerprint="ab" * 32, owner=again,
                                     resume_owner=first))
    assert resumed.status is ClaimStatus.RESUMED and resumed.record.owner == again
    assert resumed.record.task_name == task and resumed.token == claim.token + 1
    led.release(key, resumed.token)
    short = led.claim(ClaimRequest(key=key, task_name=task, payload="{}", fingerprint="ab" * 32, owner="o:1"))
    assert short.status is ClaimStatus.REOPENED and short.record.owner == "o:1"  # no chunk of the longer one left
    led.complete(key, short.token, {"message_id": "m"})
    assert led.client.object("encoding", led._rec(key)) == "listpack"
    record = led.get(key)
    assert record is not None and (record.owner, record.task_name) == ("o:1", task)
