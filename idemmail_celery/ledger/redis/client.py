"""The Redis client (:func:`connect`), hot-path connections (:class:`HotLine`), and errors (:func:`ledger_error`)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlsplit

import redis as redis_lib
from redis.cluster import ClusterNode, RedisCluster
from redis.sentinel import Sentinel

try:  # the ``redis`` extra brings it; without it, redis-py packs commands in Python
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover - the test extras install hiredis
    _pack_command = None  # type: ignore[assignment]

from ...errors import ConfigurationError, LedgerError, LedgerUnavailableError

#: Error replies meaning "not now", each refused before the script wrote anything.
_UNAVAILABLE_REPLIES = frozenset(
    {"OOM", "READONLY", "NOREPLICAS", "MISCONF", "BUSY", "MASTERDOWN", "LOADING", "TRYAGAIN", "CLUSTERDOWN"})
# ... as redis-py raises those it knows (without their code), and the unreachable.
_UNAVAILABLE_TYPES = (redis_lib.ConnectionError, redis_lib.TimeoutError, redis_lib.exceptions.OutOfMemoryError,
                      redis_lib.exceptions.ReadOnlyError, redis_lib.exceptions.TryAgainError,
                      redis_lib.exceptions.ClusterError, redis_lib.exceptions.ClusterDownError)
# The code of an error reply: its first word, or (a Redis 6 script error) the word after a '-'.
_REPLY_CODE = re.compile(r"^([A-Z]+)\b|\s-([A-Z]+)\s")


def connect(url: str | None, client: Any, master_name: str | None, options: dict[str, Any]) -> tuple[Any, bool]:
    """The caller's ``client`` (no options), else one from ``url`` (timeouts 5 s); and whether the ledger built it."""
    if client is not None:
        if options or master_name:
            named = ", ".join(options) or "master_name"
            raise ConfigurationError(f"a Redis ledger given a client takes no client options ({named}): "
                                     "set them on the client")
        _check_client(client)
        return client, False
    if url is None:
        raise ConfigurationError("a Redis ledger needs a URL or a client")
    return _from_url(url, master_name, {"socket_timeout": 5.0, "socket_connect_timeout": 5.0, **options}), True


def _from_url(url: str, master_name: str | None, options: dict[str, Any]) -> Any:
    """A client for one of the URL forms; all decode responses to str."""
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("redis+cluster", "rediss+cluster"):
        nodes, user, password, _ = _hosts(url, 6379)
        startup = [ClusterNode(h, p) for h, p in nodes]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=startup, decode_responses=True,
                            ssl=scheme.startswith("rediss"), username=user, password=password, **options)
    if scheme == "sentinel":
        if not master_name:
            raise ConfigurationError("a sentinel:// ledger needs the master_name option (as Celery's)")
        nodes, user, password, db = _hosts(url, 26379)
        # Sentinels take their own options (Celery's ``sentinel_kwargs``), else the timeouts.
        sentinel_options = options.pop("sentinel_kwargs", None) or {
            k: v for k, v in options.items() if k.startswith("socket_")}
        sentinel = Sentinel(nodes, sentinel_kwargs=sentinel_options, **options)  # type: ignore[no-untyped-call]
        return sentinel.master_for(  # type: ignore[no-untyped-call]
            master_name, decode_responses=True, db=db, username=user, password=password)
    return redis_lib.Redis.from_url(url, decode_responses=True, **options)


def _check_client(client: Any) -> None:
    """A caller's client must be a redis-py client that decodes replies to str."""
    encoder = getattr(client, "get_encoder", None)
    if encoder is None or not callable(getattr(client, "register_script", None)):
        raise ConfigurationError(f"a Redis ledger's client must be a redis-py client, not {type(client).__name__}")
    if not encoder().decode_responses:
        raise ConfigurationError("a Redis ledger's client must decode replies: build it with decode_responses=True")


def _hosts(url: str, default_port: int) -> tuple[list[tuple[str, int]], str | None, str | None, int]:
    """``scheme://[user:pass@]h1:p1[,h2:p2][/db]``, or Celery's ``sentinel://h1:p1;sentinel://h2:p2``."""
    nodes: list[tuple[str, int]] = []
    user = password = None
    db = 0
    for part in url.replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if "://" not in part:
            part = "x://" + part
        u = urlsplit(part)
        nodes.append((u.hostname or "127.0.0.1", u.port or default_port))
        user = unquote(u.username) if u.username else user
        password = unquote(u.password) if u.password else password
        if u.path.strip("/"):
            db = int(u.path.strip("/"))
    return nodes, user, password, db


def config_get(client: Any, name: str) -> list[str]:
    """A setting on every server holding ledger keys (every primary of a cluster)."""
    if isinstance(client, RedisCluster):
        out = client.config_get(name, target_nodes=RedisCluster.PRIMARIES)
        values = out.values() if isinstance(out, dict) and name not in out else [out]
        return [str(v.get(name)) for v in values if isinstance(v, dict) and v.get(name)]
    value = client.config_get(name).get(name)
    return [value] if value else []


class HotLine:
    """EVALSHA on the ledger's own connections, one call each at a time, past redis-py's command layer (as costly as the
    round trip), for a plain single-server client the ledger built (else :meth:`of` says None); NOSCRIPT and broken
    connections go redis-py's way, which loads the script or reconnects."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.spare: list[Any] = []

    @classmethod
    def of(cls, client: Any, owned: bool) -> HotLine | None:
        pool = getattr(client, "connection_pool", None)
        return cls(pool) if owned and type(pool) is redis_lib.ConnectionPool else None

    def call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        try:
            conn = self.spare.pop()
        except IndexError:
            conn = self.pool.make_connection()
        try:
            if _pack_command is not None:  # hiredis: one C call (redis-py's packer adds a Python pass per argument)
                conn.send_packed_command((_pack_command(("EVALSHA", script.sha, len(keys), *keys, *args)),))
            else:
                conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)
            out = conn.read_response()
        except redis_lib.exceptions.NoScriptError:
            self.spare.append(conn)
            return script(keys=keys, args=args)
        except (redis_lib.ConnectionError, redis_lib.TimeoutError):
            conn.disconnect()
            return script(keys=keys, args=args)
        except redis_lib.ResponseError:
            self.spare.append(conn)  # an error reply (out of memory, read-only): the connection is fine
            raise
        except BaseException:
            conn.disconnect()  # interrupted mid-reply (a soft time limit): its stream is unusable
            raise
        self.spare.append(conn)
        return out

    def close(self) -> None:
        spare, self.spare = self.spare, []
        for conn in spare:
            conn.disconnect()

    def after_fork(self) -> None:
        """In a forked child the spare connections are the parent's sockets: dropped, never closed."""
        self.spare = []


def raw(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a redis-py error raised as :func:`ledger_error` makes it."""
    try:
        return fn(*args, **kwargs)
    except redis_lib.RedisError as exc:  # a raw error would fail the task and ack the message
        raise ledger_error(exc) from exc


def ledger_error(exc: Exception) -> LedgerError:
    """A redis-py error as :class:`LedgerUnavailableError` (tasks fail closed and retry) when the store is
    unreachable or refused for a passing reason, else :class:`LedgerError`; the message names the reply's code."""
    if isinstance(exc, LedgerError):
        return exc
    code = getattr(exc, "status_code", None) or ""
    if not code and isinstance(exc, redis_lib.ResponseError):
        # A pipeline's error says "Command # 1 (HGETALL ...) of pipeline caused error: <reply>".
        found = _REPLY_CODE.search(str(exc).rsplit("caused error: ", 1)[-1])
        code = (found[1] or found[2]) if found else ""
    said = f"{code} {exc}" if code and not str(exc).startswith(code) else str(exc)
    error: LedgerError
    if isinstance(exc, (redis_lib.ConnectionError, redis_lib.TimeoutError)) and not code:
        error = LedgerUnavailableError(f"Redis ledger unreachable: {said}")
    elif isinstance(exc, _UNAVAILABLE_TYPES) or code in _UNAVAILABLE_REPLIES:
        error = LedgerUnavailableError(f"Redis ledger unavailable: {said}")
    else:
        error = LedgerError(f"Redis ledger error: {type(exc).__name__}: {said}")
    error.__cause__ = exc
    return error
