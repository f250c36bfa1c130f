"""Every Redis refusal is a ledger error: "unavailable" (fail closed, the message comes back) for the
passing ones, produced for real on private servers: NOREPLICAS, MISCONF, BUSY, MASTERDOWN, LOADING.

Each test holds claims, makes the server refuse, then walks every ledger operation: each must raise
:class:`LedgerUnavailableError` naming the refusal, never a raw redis-py error (which would fail the
task and ack its message). Once the refusal is lifted, nothing it refused has been written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from idemmail_celery.errors import LedgerError, LedgerUnavailableError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, State, from_url
from idemmail_celery.ledger.redis import RedisLedger

from .conftest import wait_for
from .test_redis_store_checks import free_port, redis_server

HELD = ("c", "f", "p", "r", "n", "w", "e")  # complete, fail, park, release, renew, withdraw, erase


def req(key: str) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="t.send", payload='{"args":[1]}', fingerprint="f" * 64)


def open_ledger(url: str, **options: Any) -> RedisLedger:
    # No client-side retries: a refusal comes back at once (the classification is what is tested).
    led = from_url(url, retry=Retry(NoBackoff(), 0), **options)
    assert isinstance(led, RedisLedger)
    return led


def hold(led: RedisLedger) -> dict[str, int]:
    """Claims to settle while the store refuses; their tokens."""
    return {k: led.claim(req(k)).token for k in HELD}


def writes(led: RedisLedger, tokens: dict[str, int]) -> dict[str, Callable[[], object]]:
    """Every operation that writes, on a fresh key or a held claim."""
    return {
        "claim": lambda: led.claim(req("new")),
        "claim_many": lambda: led.claim_many([req("new1"), req("new2")]),
        "complete": lambda: led.complete("c", tokens["c"], {"message_id": "m"}),
        "fail": lambda: led.fail("f", tokens["f"], {"reason": "x"}),
        "park": lambda: led.park("p", tokens["p"], {"reason": "x"}),
        "release": lambda: led.release("r", tokens["r"]),
        "renew": lambda: led.renew("n", tokens["n"], 30),
        "withdraw": lambda: led.withdraw("w", tokens["w"]),
        "mark_hop": lambda: led.mark_hop("c", "task:1", 60),
        "_erase": lambda: led._erase("e", tokens["e"], State.CLAIMED, None, None, None),
    }


def every_op(led: RedisLedger, tokens: dict[str, int]) -> dict[str, Callable[[], object]]:
    return {**writes(led, tokens), "get": lambda: led.get("c"), "claim_busy": lambda: led.claim(req("c")),
            "hop_marked": lambda: led.hop_marked("c", "task:1")}


def assert_all_unavailable(ops: dict[str, Callable[[], object]], *codes: str) -> None:
    """Each op raises LedgerUnavailableError naming one of ``codes`` (the reply's code word)."""
    outcomes: dict[str, str] = {}
    for name, op in ops.items():
        try:
            op()
            outcomes[name] = "no error"
        except LedgerUnavailableError as exc:
            named = any(code in str(exc) for code in codes)
            outcomes[name] = "ok" if named else f"unavailable without {'/'.join(codes)}: {exc}"
        except Exception as exc:  # what the test exists to catch: a raw redis-py error
            outcomes[name] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    assert outcomes == {name: "ok" for name in ops}


def assert_nothing_written(led: RedisLedger, tokens: dict[str, int]) -> None:
    for key, token in tokens.items():
        record = led.get(key)
        assert record is not None and (record.state, record.token) == (State.CLAIMED, token), key
        assert record.payload == '{"args":[1]}', key  # _erase refused too
    assert [led.get(k) for k in ("new", "new1", "new2")] == [None, None, None]
    assert led.mark_hop("c", "task:1", 60) is True  # the refused mark was never set


def test_noreplicas_fails_closed_at_every_write(tmp_path: Path) -> None:
    with redis_server(tmp_path) as url:
        led = open_ledger(url)
        tokens = hold(led)
        admin = redis.Redis.from_url(url)
        admin.config_set("min-replicas-to-write", 1)  # no replica: every write is refused
        assert_all_unavailable(writes(led, tokens), "NOREPLICAS")
        assert led.claim(req("c")).status is ClaimStatus.BUSY  # reads still answer
        admin.config_set("min-replicas-to-write", 0)
        assert_nothing_written(led, tokens)


def test_misconf_after_a_failed_save_fails_closed_at_every_write(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with redis_server(tmp_path, "--dir", str(data), "--save", "3600 1", "--stop-writes-on-bgsave-error", "yes") as url:
        led = open_ledger(url)
        tokens = hold(led)
        admin = redis.Redis.from_url(url, decode_responses=True)
        shutil.rmtree(data)  # the snapshot cannot be written: its directory is gone (root ignores modes)
        admin.bgsave()
        wait_for(lambda: admin.info("persistence")["rdb_last_bgsave_status"] == "err"
                 and not admin.info("persistence")["rdb_bgsave_in_progress"])
        assert_all_unavailable(writes(led, tokens), "MISCONF")
        admin.config_set("stop-writes-on-bgsave-error", "no")
        assert_nothing_written(led, tokens)
        admin.config_set("save", "")  # or it would refuse to stop, unable to save on its way out


def test_busy_script_fails_closed_at_every_operation(tmp_path: Path) -> None:
    with redis_server(tmp_path, "--busy-reply-threshold", "50") as url:
        led = open_ledger(url)
        tokens = hold(led)
        blocker = redis.Redis.from_url(url, socket_timeout=None)
        spin = threading.Thread(target=lambda: _swallow(lambda: blocker.eval("while true do end", 0)))
        spin.start()
        probe = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0))
        try:
            wait_for(lambda: _replies_busy(probe))
            assert_all_unavailable(every_op(led, tokens), "BUSY")
        finally:
            wait_for(lambda: _swallow(probe.script_kill) or True)
            spin.join(timeout=30)
        assert not spin.is_alive()
        assert_nothing_written(led, tokens)


def test_replica_cut_from_its_primary_fails_closed_at_every_operation(tmp_path: Path) -> None:
    """A ledger pointed at a replica (a Sentinel view gone stale) whose primary went away."""
    (tmp_path / "p").mkdir()
    (tmp_path / "r").mkdir()
    primary_port = free_port()
    with redis_server(tmp_path / "p", "--repl-diskless-sync-delay", "0", port=primary_port) as primary_url:
        on_primary = open_ledger(primary_url)
        tokens = hold(on_primary)
        with redis_server(tmp_path / "r", "--replicaof", "127.0.0.1", str(primary_port),
                          "--replica-serve-stale-data", "no") as replica_url:
            replica = redis.Redis.from_url(replica_url, decode_responses=True)
            wait_for(lambda: replica.info("replication")["master_link_status"] == "up"
                     and replica.exists(on_primary.names.record("e")))
            led = open_ledger(replica_url)
            led.prepare()  # met the store while it answered: epoch read
            assert led.get("e") is not None
            subprocess.run(["redis-cli", "-p", str(primary_port), "shutdown", "nosave"], check=False,
                           capture_output=True)
            wait_for(lambda: replica.info("replication")["master_link_status"] == "down")
            # Every operation is a script or a read (mark_hop too, since it keeps a nonce): MASTERDOWN.
            assert_all_unavailable(every_op(led, tokens), "MASTERDOWN")


def test_loading_after_a_restart_fails_closed_at_every_operation(tmp_path: Path) -> None:
    port = free_port()
    with redis_server(tmp_path, "--save", "", port=port) as url:
        led = open_ledger(url)
        tokens = hold(led)
        admin = redis.Redis.from_url(url)
        pipe = admin.pipeline(transaction=False)
        for i in range(2000):  # random, so the snapshot cannot compress it: over 1 KB a key
            pipe.set(f"filler:{i}", os.urandom(550).hex())
        pipe.execute()
        admin.save()
        admin.shutdown(nosave=True)
    # The same server back with its snapshot, loading it slowly: 20 ms a key, answering clients
    # between keys (every 1 KB read), so loading lasts about 40 s, far longer than the test.
    with redis_server(tmp_path, "--key-load-delay", "20000", "--loading-process-events-interval-bytes", "1024",
                      port=port, ready=False):
        probe = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0))
        assert _swallow(probe.ping) == "BusyLoadingError"
        assert_all_unavailable(every_op(led, tokens), "LOADING")


def test_an_unexpected_error_reply_is_a_ledger_error(tmp_path: Path) -> None:
    """Not a passing refusal (a string where a record should be): a LedgerError, not a raw redis error."""
    with redis_server(tmp_path) as url:
        led = open_ledger(url)
        led.prepare()
        led.client.set(led.names.record("k"), "not a hash")
        for op in (lambda: led.claim(req("k")), lambda: led.get("k"), lambda: led.complete("k", 1, {})):
            with pytest.raises(LedgerError, match="WRONGTYPE") as caught:
                op()
            assert not isinstance(caught.value, LedgerUnavailableError)


def _replies_busy(client: redis.Redis) -> bool:
    return _swallow(client.get, "x") == "BUSY"


def _swallow(fn: Callable[..., object], *args: object) -> str | None:
    """Run ``fn``; the error's code word or class name if it raised, else None."""
    try:
        fn(*args)
    except redis.ResponseError as exc:
        return str(exc).split(" ", 1)[0] if type(exc) is redis.ResponseError else type(exc).__name__
    except redis.RedisError as exc:
        return type(exc).__name__
    return None


@pytest.fixture(autouse=True)
def _needs_redis_server() -> Iterator[None]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: these tests start private servers")
    yield


def _stall(url: str, seconds: float) -> threading.Thread:
    """Block the whole server for ``seconds`` (DEBUG SLEEP on another connection): a command sent meanwhile
    runs after it, and its reply comes too late for a short socket timeout."""
    blocker = redis.Redis.from_url(url)
    thread = threading.Thread(target=lambda: blocker.execute_command("DEBUG", "SLEEP", seconds), daemon=True)
    thread.start()
    wait_for(lambda: _swallow(lambda: redis.Redis.from_url(url, socket_timeout=0.05,
                                                           retry=Retry(NoBackoff(), 0)).ping()) is not None,
             timeout=5, interval=0.01)
    return thread


def test_a_claim_or_completion_whose_reply_was_lost_is_not_mistaken_for_another_holder(tmp_path: Path) -> None:
    """The store runs the script; its reply misses the client's timeout; the client runs it again (as the
    ledger's fallback, or a client with retries, does). The second run finds the caller's own work."""
    with redis_server(tmp_path, "--enable-debug-command", "yes") as url:
        led = from_url(url, socket_timeout=0.3)
        assert isinstance(led, RedisLedger)
        led.claim(req("warm"))  # scripts loaded, the store checked
        stalled = _stall(url, 0.6)
        try:
            claim = led.claim(req("lost-claim"))
        except LedgerUnavailableError:
            claim = None  # given up: the next delivery presents its owner (covered by the handler's tests)
        stalled.join()
        if claim is not None:
            assert claim.status.holds, claim.status  # its own claim, not "busy" with itself
        record = led.get("lost-claim")
        assert record is not None and record.state is State.CLAIMED
        token = record.token
        stalled = _stall(url, 0.6)
        with contextlib.suppress(LedgerUnavailableError):  # given up is fine; StaleTokenError for its own move is not
            led.complete("lost-claim", token, {"message_id": "m-1"})
        stalled.join()
        done = led.get("lost-claim")
        assert done is not None and done.state is State.SENT and done.result == {"message_id": "m-1"}
        led.close()


def test_a_reschedule_mark_whose_reply_was_lost_is_still_this_copys(tmp_path: Path) -> None:
    """The store sets the mark; the reply misses the client's timeout; a client with retries (one a user
    hands the ledger) sends it again. The copy that set it must hear True (it is the one that publishes
    the reschedule), not drop itself as a second copy."""
    with redis_server(tmp_path, "--enable-debug-command", "yes") as url:
        led = from_url(url, socket_timeout=0.3, retry=Retry(NoBackoff(), 3))
        assert isinstance(led, RedisLedger)
        led.claim(req("warm"))  # scripts loaded, the store checked
        assert led.mark_hop("k-hop", "hop-0", 60) is True
        stalled = _stall(url, 0.6)
        marked = led.mark_hop("k-hop", "hop-1", 60)  # sent, stalled past the timeout, sent again
        stalled.join()
        assert marked is True
        assert led.mark_hop("k-hop", "hop-1", 60) is False  # another copy of the same hop
        led.close()
