"""What the Redis ledger's mixins share (:class:`RedisBase`): the client, its calls, key names, scripts, reads."""

from __future__ import annotations

import logging
import threading
import weakref
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import redis as redis_lib

from ..._common import after_fork
from ..base import Ledger, Record
from .client import HotLine, ledger_error, raw
from .layout import Names, _read_entry, _read_record

log = logging.getLogger("idemmail_celery.ledger.redis")  # the package's name, whichever module logs


class RedisBase(Ledger):
    """The Redis ledger's shared state and calls; set up by ``RedisLedger``."""

    client: Any
    prefix: str
    buckets: int
    #: Never writes epoch markers (see ``epochs.py``).
    passive: bool
    names: Names
    scripts: dict[str, Any]
    #: The ledger's retention (ms): this process's until the markers say.
    _retention_ms: int
    #: Whether the ledger built its client (then it closes it).
    _own_client: bool
    _line: HotLine | None
    #: Held while the store is checked and the markers are read.
    _check_lock: threading.Lock
    _checked = False

    @abstractmethod
    def _check_store(self) -> None:
        """Check the store and settle this process's epoch, once (before the first command)."""

    @property
    def shelves(self) -> int:
        """Shelves per bucket: the markers' once the ledger exists."""
        return self.names.shelves

    @shelves.setter
    def shelves(self, value: int) -> None:
        self.names.shelves = value

    def _keys(self, key: str) -> list[str]:
        """A record script's KEYS (the store checked first: its shelves are the markers')."""
        self._check_store()
        return self.names.script_keys(key)

    def _claim_keys(self, key: str) -> list[str]:
        """The claim script's KEYS (the store checked first, as for :meth:`_keys`)."""
        self._check_store()
        return self.names.claim_keys(key)

    def _record(self, key: str, fields: list[str] | dict[str, str], payload: str | None) -> Record:
        return _read_record(key, fields, payload, self.retention_seconds)

    def _entry_record(self, key: str, value: str, payload: str | None) -> Record:
        return _read_entry(key, value, payload, self._retention_ms)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One command (``fn``, a client method or script), the store checked first."""
        self._check_store()
        return raw(fn, *args, **kwargs)

    def _script(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """One script call, on the hot line where there is one."""
        if self._line is not None:
            return raw(self._line.call, script, keys, args)
        return raw(script, keys=keys, args=args)

    def _pipeline(self, commands: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Run (method, args) pairs in one non-transactional pipeline (split per node on a cluster)."""
        pipe = self.client.pipeline(transaction=False)
        for name, args in commands:
            getattr(pipe, name)(*args)
        return list(raw(pipe.execute))

    def _run_scripts(self, script: Any, calls: Sequence[tuple[list[str], list[Any]]], *,
                     partial: bool = False) -> list[Any]:
        """EVALSHA every call in one pipeline, again by EVAL on NOSCRIPT (SCRIPT LOAD fails on a cluster with a node
        down); raises the first error, unless ``partial``: then errors are returned in place."""
        def run(batch: Sequence[tuple[list[str], list[Any]]], command: str, body: str) -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for keys, args in batch:  # by name: a cluster pipeline refuses .evalsha(), not the command
                pipe.execute_command(command, body, len(keys), *keys, *args)
            return list(raw(pipe.execute, raise_on_error=False))

        outs = run(calls, "EVALSHA", script.sha)
        again = [i for i, out in enumerate(outs) if isinstance(out, redis_lib.exceptions.NoScriptError)]
        if again:
            for i, out in zip(again, run([calls[i] for i in again], "EVAL", script.script), strict=True):
                outs[i] = out
        if not partial:
            for out in outs:
                if isinstance(out, Exception):
                    raise ledger_error(out)
        return outs

    def _scan(self, pattern: str) -> list[str]:
        return list(self.client.scan_iter(match=pattern, count=1000))

    def close(self) -> None:
        if self._line is not None:
            self._line.close()
        if self._own_client:
            self.client.close()

    def _after_fork(self) -> None:
        """In a forked child: drop the parent's hot-line sockets and a lock one of its threads may hold."""
        if self._line is not None:
            self._line.after_fork()
        self._check_lock = threading.Lock()


_live: weakref.WeakSet[RedisBase] = weakref.WeakSet()


@after_fork
def _reset_after_fork() -> None:
    for ledger in list(_live):
        ledger._after_fork()
