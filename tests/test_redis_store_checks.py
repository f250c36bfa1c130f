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
