"""The Redis ledger refuses a store that could evict its records."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from idemmail_celery.errors import UnsafeLedgerError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, from_url

from .conftest import wait_for


def _redis_server(tmp_path: Path, policy: str) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path), "--maxmemory", "64mb", "--maxmemory-policy", policy],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        import redis

        wait_for(lambda: _pings(redis.Redis.from_url(url)), timeout=10)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def evicting_redis(tmp_path: Path) -> Iterator[str]:
    yield from _redis_server(tmp_path, "allkeys-lru")


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    yield from _redis_server(tmp_path, "noeviction")


def _pings(client: object) -> bool:
    try:
        return bool(client.ping())  # type: ignore[attr-defined]
    except Exception:
        return False


def test_evicting_policy_is_refused(evicting_redis: str) -> None:
    ledger = from_url(evicting_redis)
    with pytest.raises(UnsafeLedgerError, match="allkeys-lru"):
        ledger.claim(ClaimRequest(key="k", task_name="t", payload="{}", fingerprint="f"))


def test_evicting_policy_accepted_when_told(evicting_redis: str) -> None:
    ledger = from_url(evicting_redis, allow_eviction=True)
    claim = ledger.claim(ClaimRequest(key="k", task_name="t", payload="{}", fingerprint="f"))
    assert claim.status is ClaimStatus.ACQUIRED


def test_batch_claims_survive_a_server_that_lost_its_scripts(private_redis: str) -> None:
    ledger = from_url(private_redis)  # a private server: flushing scripts must not disturb other tests
    reqs = [ClaimRequest(key=f"s{i}", task_name="t", payload="{}", fingerprint="f") for i in range(5)]
    assert all(c.status is ClaimStatus.ACQUIRED for c in ledger.claim_many(reqs[:2]))
    ledger.client.script_flush()  # as after a Redis restart
    assert all(c.status is ClaimStatus.ACQUIRED for c in ledger.claim_many(reqs[2:]))
    assert [c.status for c in ledger.claim_many(reqs)] == [ClaimStatus.BUSY] * 5


def test_a_full_store_fails_closed_and_writes_nothing(private_redis: str) -> None:
    """maxmemory reached (noeviction): Redis refuses the script; the task must retry, not fail and ack."""
    import redis

    from idemmail_celery.errors import LedgerUnavailableError

    ledger = from_url(private_redis)
    first = ledger.claim(ClaimRequest(key="k1", task_name="t", payload="{}", fingerprint="f"))
    assert first.status is ClaimStatus.ACQUIRED
    admin = redis.Redis.from_url(private_redis)
    admin.config_set("maxmemory", 1)
    try:
        with pytest.raises(LedgerUnavailableError, match="maxmemory"):
            ledger.claim(ClaimRequest(key="k2", task_name="t", payload="{}", fingerprint="f"))
        with pytest.raises(LedgerUnavailableError, match="maxmemory"):
            ledger.complete("k1", first.token, {"message_id": "m"})
    finally:
        admin.config_set("maxmemory", "64mb")
    assert ledger.get("k2") is None  # refused before it wrote anything
    ledger.complete("k1", first.token, {"message_id": "m"})  # room again: the outcome is recorded
    assert ledger.claim(ClaimRequest(key="k1", task_name="t", payload="{}", fingerprint="f")).status is ClaimStatus.DONE


def test_single_claims_survive_a_server_that_lost_its_scripts(private_redis: str) -> None:
    """The hot path calls EVALSHA on the ledger's own connections; NOSCRIPT goes the ordinary way, which loads."""
    ledger = from_url(private_redis)
    first = ledger.claim(ClaimRequest(key="a", task_name="t", payload="{}", fingerprint="f"))
    ledger.client.script_flush()  # as after a Redis restart
    second = ledger.claim(ClaimRequest(key="b", task_name="t", payload="{}", fingerprint="f"))
    assert (first.status, second.status) == (ClaimStatus.ACQUIRED, ClaimStatus.ACQUIRED)
    ledger.client.script_flush()
    ledger.complete("a", first.token, {"message_id": "m"})
    assert ledger.claim(ClaimRequest(key="a", task_name="t", payload="{}", fingerprint="f")).status is ClaimStatus.DONE


def test_hot_path_replaces_a_connection_the_server_closed(private_redis: str) -> None:
    import redis

    ledger = from_url(private_redis)
    first = ledger.claim(ClaimRequest(key="a", task_name="t", payload="{}", fingerprint="f"))
    killed = redis.Redis.from_url(private_redis).client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1  # the ledger's connections, as a server restart or an idle timeout closes them
    ledger.complete("a", first.token, {"message_id": "m"})
    again = ledger.claim(ClaimRequest(key="a", task_name="t", payload="{}", fingerprint="f"))
    assert again.status is ClaimStatus.DONE and (again.record.result or {}).get("message_id") == "m"


def test_a_forked_child_never_writes_on_its_parents_connections(private_redis: str) -> None:
    """A prefork pool child inherits the parent's ledger; on a shared socket each would read the other's replies."""
    import multiprocessing

    ledger = from_url(private_redis)
    done = [ClaimRequest(key=f"done{i}", task_name="t", payload="{}", fingerprint="f") for i in range(300)]
    for claim in ledger.claim_many(done):
        ledger.complete(claim.record.key, claim.token, {"message_id": claim.record.key})
    ledger.claim(ClaimRequest(key="warm", task_name="t", payload="{}", fingerprint="f"))  # the hot path's connection

    def child(out: multiprocessing.Queue[list[str]]) -> None:  # replays: each answer names its own key
        out.put([str((ledger.claim(r).record.result or {}).get("message_id")) for r in done])

    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[list[str]] = ctx.Queue()
    proc = ctx.Process(target=child, args=(out,))
    proc.start()
    parent = [ledger.claim(ClaimRequest(key=f"new{i}", task_name="t", payload="{}", fingerprint="f")).status
              for i in range(300)]
    replies = out.get(timeout=60)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    assert replies == [r.key for r in done]
    assert parent == [ClaimStatus.ACQUIRED] * 300
