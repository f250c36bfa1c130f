"""The Redis ledger refuses a store that could evict its records."""

from __future__ import annotations

import contextlib
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from idemmail_celery.errors import UnsafeLedgerError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, from_url

from .conftest import free_port, wait_for


@contextlib.contextmanager
def redis_server(directory: Path, *args: str, port: int = 0, ready: bool = True) -> Iterator[str]:
    """A private redis-server on loopback (a free port unless given), stopped on exit; yields its URL.

    ``args`` are redis-server options after the defaults (no persistence, 64 MB, noeviction), so they
    override them. ``ready``: wait until it answers PING (False: until it answers anything, e.g. LOADING).
    """
    port = port or free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(directory), "--maxmemory", "64mb", "--maxmemory-policy", "noeviction", *args],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        probe = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0))
        wait_for(lambda: _pings(probe) if ready else _answers(probe), timeout=10)
        probe.close()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _redis_server(tmp_path: Path, policy: str) -> Iterator[str]:
    with redis_server(tmp_path, "--maxmemory-policy", policy) as url:
        yield url


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


def _answers(client: object) -> bool:
    """The server is up and replies, if only with an error (LOADING, MASTERDOWN)."""
    import redis

    try:
        client.ping()  # type: ignore[attr-defined]
    except (redis.ResponseError, redis.exceptions.BusyLoadingError):
        return True
    except redis.RedisError:
        return False
    return True


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
    # Another caller's requests (an owner of their own; the same request again would be resumed).
    others = [ClaimRequest(key=r.key, task_name="t", payload="{}", fingerprint="f") for r in reqs]
    assert [c.status for c in ledger.claim_many(others)] == [ClaimStatus.BUSY] * 5


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


def test_a_server_without_persistence_gets_a_warning_at_worker_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "aof").mkdir()
    with redis_server(tmp_path) as bare, redis_server(tmp_path / "aof", "--appendonly", "yes") as durable:
        with caplog.at_level(logging.WARNING, logger="idemmail_celery.ledger.redis"):
            from_url(bare).prepare()
        assert [r for r in caplog.records if "no copy on disk" in r.getMessage()]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="idemmail_celery.ledger.redis"):
            from_url(durable).prepare()
            from_url(bare, passive=True).prepare()  # an operator's look: no warning
        assert not [r for r in caplog.records if "no copy on disk" in r.getMessage()]


def test_an_evicting_policy_set_at_runtime_is_refused_until_set_back(private_redis: str) -> None:
    ledger = from_url(private_redis, policy_recheck_seconds=0)  # read again on every claim
    held = ledger.claim(ClaimRequest(key="held", task_name="t", payload="{}", fingerprint="f"))
    admin = redis.Redis.from_url(private_redis)
    admin.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with pytest.raises(UnsafeLedgerError, match="allkeys-lru"):
            ledger.claim(ClaimRequest(key="new", task_name="t", payload="{}", fingerprint="f"))
        with pytest.raises(UnsafeLedgerError, match="allkeys-lru"):
            ledger.claim_many([ClaimRequest(key="new2", task_name="t", payload="{}", fingerprint="f")])
        ledger.complete("held", held.token, {"message_id": "m"})  # what was sent is still recorded
    finally:
        admin.config_set("maxmemory-policy", "noeviction")
    assert ledger.get("new") is None and ledger.get("new2") is None
    assert ledger.claim(ClaimRequest(key="new", task_name="t", payload="{}", fingerprint="f")).status \
        is ClaimStatus.ACQUIRED


def test_between_rechecks_the_claim_path_refuses_from_what_it_read(private_redis: str) -> None:
    ledger = from_url(private_redis, policy_recheck_seconds=3600)
    ledger.prepare()
    ledger.policy_recheck_seconds = 0
    admin = redis.Redis.from_url(private_redis)
    admin.config_set("maxmemory-policy", "volatile-lru")
    try:
        ledger._policy_due = 0  # due now: this claim reads it and refuses
        with pytest.raises(UnsafeLedgerError, match="volatile-lru"):
            ledger.claim(ClaimRequest(key="a", task_name="t", payload="{}", fingerprint="f"))
        ledger.policy_recheck_seconds = 3600
        ledger._policy_due = float("inf")  # not due: refused from what it knows
        admin.config_set("maxmemory-policy", "noeviction")
        with pytest.raises(UnsafeLedgerError, match="volatile-lru"):
            ledger.claim(ClaimRequest(key="a", task_name="t", payload="{}", fingerprint="f"))
    finally:
        admin.config_set("maxmemory-policy", "noeviction")


def test_config_disabled_on_a_managed_redis_is_warned_about_and_claims_go_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with redis_server(tmp_path, "--rename-command", "CONFIG", "") as url:
        ledger = from_url(url, policy_recheck_seconds=0)
        with caplog.at_level(logging.WARNING, logger="idemmail_celery.ledger.redis"):
            ledger.prepare()
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "cannot read Redis maxmemory-policy" in said and "persistence settings" in said
        for key in ("a", "b"):  # each claim due for a recheck: still no error
            assert ledger.claim(ClaimRequest(key=key, task_name="t", payload="{}", fingerprint="f")).status \
                is ClaimStatus.ACQUIRED
