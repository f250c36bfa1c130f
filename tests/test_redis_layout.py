"""The Redis ledger's lean record (layout format version 1): ``sent`` records on shelves found by their key alone,
without an index, listed by SCAN, counted by counters; long results and errors in chunks. (A store whose markers
name another layout is refused: tests/test_ledger_loss.py.)"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import redis

from idemmail_celery.errors import StaleTokenError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, State
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


def shelf(led: RedisLedger, key: str) -> dict[str, int]:
    """``key``'s shelf if it exists: name -> its entries, live or dead (the sweep's own field left out)."""
    name = led.names.shelf(key)
    raw = redis.Redis.from_url(REDIS_URL)  # a shelf's fields are bytes: read without decoding
    return {name: sum(1 for f in raw.hkeys(name) if f)} if raw.exists(name) else {}


def test_a_sent_record_leaves_no_key_of_its_own_and_replays_from_its_shelf(led: RedisLedger) -> None:
    key = hexkey()
    claim = led.claim(req(key))  # a long payload: the claimed record is a hash, its payload a string
    assert led.client.exists(led.names.record(key), led.names.payload(key)) == 2
    message_id = "0100018c2b7f4a5e-3f2a1b4c-5d6e-4f70-8a9b-0c1d2e3f4a5b-000000"
    result = {"message_id": message_id, "value": {"message_id": message_id, "provider": "ses"}}
    led.complete(key, claim.token, result)
    assert led.client.exists(led.names.record(key), led.names.payload(key)) == 0  # no record, no payload: an entry
    [(name, entries)] = shelf(led, key).items()
    assert entries == 1 and name.startswith(led.names.stems[led.names.bucket(key)] + "d:")
    members = [m for b in range(led.buckets) for s in State for m in led.client.zrange(led.names.index(b, s), 0, -1)]
    assert key not in members  # no sent index
    record = led.get(key)
    assert record is not None and record.state is State.SENT and record.result == result and record.token == 1
    assert record.fingerprint == "ab" * 32 and record.payload is None
    assert record.expires_at is not None and abs(record.expires_at - record.updated_at - led.retention_seconds) < 0.01
    assert led.client.pexpiretime(name) == round(record.expires_at * 1000)  # the shelf lives as long as its entry
    dup = led.claim(req(key, payload="{}"))
    assert dup.status is ClaimStatus.DONE and dup.record == record  # what a duplicate is told
    assert led.client.exists(led.names.record(key)) == 0  # a duplicate writes nothing


@pytest.mark.parametrize("result", [
    {"message_id": "6f1c1a3e-3a8e-4d6c-9a2b-1c2d3e4f5a6b"},  # a UUID, packed
    {"message_id": "<20261125.abc@mail.example.com>", "value": {"message_id": "<20261125.abc@mail.example.com>",
                                                                 "accepted": ["ann@example.com"]}},
    {"message_id": "m 1", "provider": "smtp", "queued": True},
    {"message_id": 42},  # not a string: stored as it is
    {"value": {"id": "x"}},
    {"message_id": "m", "value": {"message_id": "other"}},  # a value naming another id
    {"message_id": "Grüße 🙂 ~ . R"},
])
def test_every_result_shape_reads_back_from_the_shelf(led: RedisLedger, result: dict[str, Any]) -> None:
    # A 64-hex key and fingerprint (packed), any other text, and a key whose field would be 32 bytes long.
    cases = {hexkey(): "ab" * 32, "plain key ~! Grüße": "not hex, Grüße", "x" * 31: ""}
    for key, fingerprint in cases.items():
        c = led.claim(ClaimRequest(key=key, task_name="t", payload="{}", fingerprint=fingerprint))
        led.complete(key, c.token, result)
        assert not led.client.exists(led.names.record(key))
        record = led.get(key)
        assert record is not None and (record.result, record.fingerprint) == (result, fingerprint)
        assert led.claim(req(key)).record.result == result
    listed = {r.key: (r.fingerprint, r.result) for r in led.iter_records(State.SENT)}
    assert listed == {key: (fingerprint, result) for key, fingerprint in cases.items()}


def test_a_finish_run_twice_after_its_reply_was_lost_is_ok_and_a_stale_one_is_refused(led: RedisLedger) -> None:
    key = hexkey()
    c = led.claim(req(key))
    led.complete(key, c.token, {"message_id": "m"})
    led.complete(key, c.token, {"message_id": "m"})  # the same call again: ok, nothing changes
    with pytest.raises(StaleTokenError, match="sent"):
        led.complete(key, c.token + 1, {"message_id": "other"})
    with pytest.raises(StaleTokenError):
        led.fail(key, c.token, {"reason": "late"})
    record = led.get(key)
    assert record is not None and record.result == {"message_id": "m"} and sum(shelf(led, key).values()) == 1


def test_an_operator_can_take_a_record_off_its_shelf_and_forget_one_on_it(led: RedisLedger) -> None:
    key = hexkey()
    c = led.claim(req(key))
    led.complete(key, c.token, {"message_id": "m", "to": "ann@example.com"})
    assert led.forget(key) is True  # erased on the shelf, in place
    forgotten = led.get(key)
    assert forgotten is not None and forgotten.result == {"message_id": "m", "forgotten": True}
    raw = redis.Redis.from_url(REDIS_URL)  # a shelf holds bytes: read without decoding
    assert b"ann@example.com" not in b"".join(raw.hgetall(next(iter(shelf(led, key)))).values())
    moved = replace(forgotten, state=State.REVIEW, token=forgotten.token + 1, expires_at=None,
                    error={"reason": "operator"}, updated_at=time.time())
    assert led._force(key, forgotten.token + 5, moved) is False  # a stale expectation changes nothing
    assert led._force(key, forgotten.token, moved) is True
    assert sum(shelf(led, key).values()) == 0  # off the shelf
    assert led.get(key) == moved and [r.key for r in led.iter_records(State.REVIEW)] == [key]
    assert led.claim(req(key)).status is ClaimStatus.DONE  # review replays its error
    released = led.resolve(key, "released", note="resend")
    again = led.claim(req(key))
    assert again.status is ClaimStatus.REOPENED and again.token == released.token + 1
    led.complete(key, again.token, {"message_id": "m2"})
    archived = led.get(key)  # an operator's decision has no room in an entry: a hash of its own, with its token
    assert sum(shelf(led, key).values()) == 0 and archived is not None and archived.token == again.token > 1
    assert archived.result == {"message_id": "m2"} and led.claim(req(key)).record.token == again.token
    assert archived.resolution is not None and archived.resolution["note"] == "resend"
    assert led.client.pttl(led.names.record(key)) > 0  # it expires, as a shelved one would
    other = hexkey()  # without a decision, a sent record goes on its shelf, its token (2) kept in the entry
    first = led.claim(replace(req(other), lease_seconds=0.2))
    time.sleep(0.35)
    taken = led.claim(req(other))
    led.complete(other, taken.token, {"message_id": "m3"})
    shelved = led.get(other)
    assert sum(shelf(led, other).values()) == 1 and shelved is not None and shelved.token == first.token + 1


def test_a_record_near_the_end_of_its_retention_replays_until_then_and_not_after(led: RedisLedger) -> None:
    led.retention_seconds = 2.0  # shorter than the ledger's (the markers' retention): the entry says so
    key = hexkey()
    c = led.claim(req(key))
    led.complete(key, c.token, {"message_id": "m"})
    completed = time.monotonic()
    assert sum(shelf(led, key).values()) == 1
    time.sleep(1.0)
    assert time.monotonic() - completed < 1.9, "the machine stalled: this look would be past the retention"
    assert led.claim(req(key)).status is ClaimStatus.DONE  # near the end: still done
    time.sleep(max(0.0, completed + 2.4 - time.monotonic()))  # (its expiry: tenths of a second, rounded up)
    assert led.get(key) is None and list(led.iter_records(State.SENT)) == []
    again = led.claim(req(key))  # past it: a new intent (the spent entry goes with the claim)
    assert again.status is ClaimStatus.ACQUIRED and sum(shelf(led, key).values()) == 0


def test_a_sent_record_kept_longer_than_the_ledger_retention_is_shelved_with_its_own(led: RedisLedger) -> None:
    led.retention_seconds = led._retention_ms / 1000 * 2  # longer than the ledger's: the entry carries its own
    key = hexkey()
    c = led.claim(req(key))
    led.complete(key, c.token, {"message_id": "m"})
    assert not led.client.exists(led.names.record(key)) and sum(shelf(led, key).values()) == 1
    record = led.get(key)
    assert record is not None and record.expires_at is not None
    assert abs(record.expires_at - record.updated_at - led.retention_seconds) < 0.01
    assert led.client.pexpiretime(led.names.shelf(key)) == round(record.expires_at * 1000)
    assert led.claim(req(key)).status is ClaimStatus.DONE
    assert [r.key for r in led.iter_records(State.SENT)] == [key]


def test_a_shelf_sweeps_its_dead_entries_when_written_past_its_sweep_time() -> None:
    """Entries are found by key alone, so nothing visits a dead one to delete it: a write to its shelf
    does, at most once per sweep step (retention / 8, at least 1 s), and the shelf expires with its last entry."""
    led = RedisLedger(REDIS_URL, prefix=unique("sweep"), buckets=1, shelves=1, retention_seconds=1.0)
    try:
        led.prepare()  # the markers say 1 s: a sweep is due 1 s after the shelf's first write
        keeper = hexkey()
        led.retention_seconds = 60.0  # one entry that outlives the others keeps the shelf
        led.complete(keeper, led.claim(req(keeper)).token, {"message_id": keeper})
        led.retention_seconds = 1.0
        old = [hexkey() for _ in range(5)]
        for k in old:
            led.complete(k, led.claim(req(k)).token, {"message_id": k})
        name = led.names.shelf(keeper)
        assert shelf(led, keeper) == {name: 6}
        time.sleep(2.2)  # past their expiry (1 s) and the first sweep's time (1 s after the first write)
        assert all(led.get(k) is None for k in old) and shelf(led, keeper) == {name: 6}  # dead, still there
        new = hexkey()
        led.complete(new, led.claim(req(new)).token, {"message_id": new})
        assert shelf(led, new) == {name: 2}  # the five dead entries went in the sweep
        led.retention_seconds = 1.0
        late = hexkey()
        led.complete(late, led.claim(req(late)).token, {"message_id": late})
        time.sleep(1.3)  # dead, and its shelf's next sweep not due: `purge --expired` sweeps it now
        assert shelf(led, late) == {name: 3} and led.purge_expired() >= 0
        assert shelf(led, late) == {name: 1}  # the keeper: the other two (1 s each) were dead too
        assert all(led.get(k) is None for k in old)
    finally:
        drop_ledger(led)


def test_sent_records_are_listed_by_scan_counted_and_purged(led: RedisLedger) -> None:
    # Every look below lands well within it, also on a loaded machine whose shared Redis holds other
    # runs' keys (each listing SCANs every bucket: about a second at 45,000 keys).
    led.retention_seconds = 6.0
    keys = [hexkey() for _ in range(30)] + ["plain-key", "glob*[key]?"]
    first = time.monotonic()
    for k in keys:
        led.complete(k, led.claim(req(k)).token, {"message_id": k})
    parked = led.claim(req("parked"))
    led.park("parked", parked.token, {"reason": "ambiguous"})
    assert sorted(r.key for r in led.iter_records(State.SENT)) == sorted(keys)
    assert sorted(r.key for r in led.iter_records()) == sorted([*keys, "parked"])
    assert [r.key for r in led.iter_records(State.REVIEW)] == ["parked"]
    assert {k: v for k, v in led.stats().items() if v} == {"sent": len(keys), "review": 1}
    assert time.monotonic() - first < 5.8, "the machine stalled: the looks above may have been past the retention"
    time.sleep(max(0.0, first + 6.4 - time.monotonic()))  # (expiries: tenths of a second, rounded up)
    assert list(led.iter_records(State.SENT)) == []
    assert {k: v for k, v in led.stats().items() if v} == {"review": 1}
    assert led.purge_expired() == len(keys)  # the counters' spent granules, and what they counted
    assert not any(led.client.hlen(led.names.counter(b)) for b in range(led.buckets))
    assert led.purge_expired() == 0


def test_long_and_non_ascii_results_and_errors_round_trip_in_chunks(led: RedisLedger) -> None:
    text = "Grüße, Ann — 你好 🙂 " * 20  # multi-byte characters across every 64-byte cut
    c = led.claim(req("chunks"))
    led.park("chunks", c.token, {"reason": "timeout", "message": text})
    record = led.get("chunks")
    assert record is not None and record.error == {"reason": "timeout", "message": text}
    resolved = led.resolve("chunks", "sent", result={"message_id": "m", "note": text[:200]}, note=text)
    assert led.get("chunks") == resolved
    assert led.client.object("encoding", led.names.record("chunks")) == "listpack"
    assert led.forget("chunks") is True
    forgotten = led.get("chunks")
    assert forgotten is not None and forgotten.result == {"message_id": "m", "forgotten": True}
    assert forgotten.error is not None and "message" not in forgotten.error
    assert forgotten.resolution["from"] == "review"  # read back whole: no stale chunk joined in
    assert led.client.pttl(led.names.record("chunks")) > 0  # forget left the TTL alone


def test_a_workers_long_owner_and_task_name_keep_the_record_compact(led: RedisLedger) -> None:
    """A worker's owner is host:pid:<task id>:<nonce>, 80 bytes and more: stored in chunks, so the
    hash stays listpack, and compared whole when its chain resumes it."""
    host_pid = "email-worker-7d9f8b6c5d-x2k4p.prod.svc.cluster.local:1234567"
    first = f"{host_pid}:0c2d9a8e-5b7f-4c1e-9a3d-6f8e2b1c4d5a:aaaaaaaa"
    task = "myproject.notifications.transactional.tasks.send_password_reset_email_v2"
    key = hexkey()
    claim = led.claim(ClaimRequest(key=key, task_name=task, payload=LONG_PAYLOAD, fingerprint="ab" * 32, owner=first))
    assert led.client.object("encoding", led.names.record(key)) == "listpack"
    again = f"{host_pid}:0c2d9a8e-5b7f-4c1e-9a3d-6f8e2b1c4d5a:bbbbbbbb"
    resumed = led.claim(ClaimRequest(key=key, task_name=task, payload="{}", fingerprint="ab" * 32, owner=again,
                                     resume_owner=first))
    assert resumed.status is ClaimStatus.RESUMED and resumed.record.owner == again
    assert resumed.record.task_name == task and resumed.token == claim.token + 1
    led.release(key, resumed.token)
    short = led.claim(ClaimRequest(key=key, task_name=task, payload="{}", fingerprint="ab" * 32, owner="o:1"))
    assert short.status is ClaimStatus.REOPENED and short.record.owner == "o:1"  # no chunk of the longer one left
    assert led.client.object("encoding", led.names.record(key)) == "listpack"
    record = led.get(key)
    assert record is not None and (record.owner, record.task_name) == ("o:1", task)
