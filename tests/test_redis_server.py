"""The test helper :class:`~idemmail_celery.testing.redis_server.RedisServer`: a server of a test's (or chaos run's)
own, Redis or Valkey, stopped and started again with its data."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from idemmail_celery.testing.redis_server import RedisServer, server_binary


def test_an_unknown_server_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'redis' or 'valkey'"):
        server_binary("memcached")


@pytest.mark.valkey
def test_a_valkey_server_of_its_own_keeps_its_data_across_a_restart(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "valkey", server="valkey").start()
    try:
        client = redis.Redis.from_url(server.url)
        assert str(client.info("server").get("valkey_version", "")).startswith("9.")
        client.set("k", "v")
        server.stop()
        assert not server.answers()
        server.start()
        assert redis.Redis.from_url(server.url).get("k") == b"v"
    finally:
        server.stop()
