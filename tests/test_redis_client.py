"""The Redis ledger's scripts come from its .lua files; a client of the user's own is used as given."""

from __future__ import annotations

import hashlib
import threading
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import redis

from idemmail_celery.errors import ConfigurationError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, from_url
from idemmail_celery.ledger.redis import RedisLedger, _lua

from .conftest import REDIS_URL, drop_ledger, unique
from .test_redis_store_checks import redis_server


def req(key: str) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="t.send", payload="{}", fingerprint="f")


class CountingRedis(redis.Redis):
    """What an instrumentation (OpenTelemetry's wraps ``execute_command``) sees of a client."""

    commands: list[str]

    def execute_command(self, *args: Any, **options: Any) -> Any:
        self.commands.append(str(args[0]).upper())
        return super().execute_command(*args, **options)


def users_client(url: str = REDIS_URL, **kwargs: Any) -> CountingRedis:
    pool = redis.BlockingConnectionPool.from_url(url, decode_responses=True, max_connections=2, timeout=30)
    client = CountingRedis(connection_pool=pool, **kwargs)
    client.commands = []
    return client


def test_every_script_file_is_packaged_and_loads_on_a_real_server() -> None:
    lua = resources.files("idemmail_celery.ledger.redis")  # the scripts beside the store
    names = sorted(p.name[:-4] for p in lua.iterdir() if p.name.endswith(".lua"))
    assert {"prelude", "claim", "finish", "renew", "force", "purge", "erase", "flag", "mark"} <= set(names)
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    for name in names:
        text = _lua(name)
        assert client.script_load(text) == hashlib.sha1(text.encode()).hexdigest(), name  # compiles
    led = from_url(REDIS_URL, prefix=unique("lua"))
    assert isinstance(led, RedisLedger)
    assert led.scripts["claim"].script == _lua("claim")
    # A record script carries the prelude's parts its first line names (the claim: not the shelving
    # ones), or (renew) all of it.
    assert "local function shelved(" in _lua("claim") and "local function shelve(" not in _lua("claim")
    assert "local function shelve(" in _lua("finish") and _lua("renew").startswith(_lua("prelude"))


def test_a_users_client_carries_every_command_within_its_pool_limit() -> None:
    client = users_client()
    led = from_url("redis://ignored.invalid:1/0", client=client, prefix=unique("own"))
    assert isinstance(led, RedisLedger) and led.client is client
    try:
        led.prepare()
        client.commands.clear()
        first = led.claim(req("a"))
        led.complete("a", first.token, {"message_id": "m"})
        assert led.claim(req("a")).status is ClaimStatus.DONE
        assert client.commands == ["EVALSHA"] * 3  # all seen by the user's client, one each

        statuses: list[ClaimStatus] = []
        barrier = threading.Barrier(8)

        def claimer(i: int) -> None:
            barrier.wait()
            statuses.append(led.claim(req(f"t{i}")).status)

        threads = [threading.Thread(target=claimer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert statuses == [ClaimStatus.ACQUIRED] * 8
        assert len(client.connection_pool._connections) <= 2  # its limit held: no connections of the ledger's
    finally:
        drop_ledger(led)
    assert client.ping() is True  # close() left the user's client open


def test_a_users_client_reloads_scripts_a_restarted_server_lost(tmp_path: Path) -> None:
    with redis_server(tmp_path) as url:
        client = users_client(url)
        led = from_url(url, client=client)
        first = led.claim(req("a"))
        client.script_flush()
        led.complete("a", first.token, {"message_id": "m"})
        assert led.claim(req("a")).status is ClaimStatus.DONE


def test_a_client_that_does_not_decode_or_comes_with_options_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="decode_responses=True"):
        RedisLedger(client=redis.Redis.from_url(REDIS_URL))
    with pytest.raises(ConfigurationError, match="socket_timeout"):
        RedisLedger(client=users_client(), socket_timeout=1)
    with pytest.raises(ConfigurationError, match="redis-py client"):
        RedisLedger(client=object())
    with pytest.raises(ConfigurationError, match="URL or a client"):
        RedisLedger()
