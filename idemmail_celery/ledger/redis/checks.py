"""The Redis ledger's server checks: eviction policy (``noeviction`` only), persistence (warned), version (7.0+)."""

from __future__ import annotations

import time

import redis as redis_lib

from ..._common import logsafe
from ...errors import LedgerError, LedgerUnavailableError, UnsafeLedgerError
from .client import config_get, ledger_error, raw
from .layout import LAYOUT
from .plumbing import RedisBase, log


class StoreChecks(RedisBase):
    """The server checks, a mixin of ``RedisLedger``."""

    #: Accept an evicting ``maxmemory-policy`` (unsafe: an evicted ``sent`` record reopens its key).
    allow_eviction: bool
    #: How often (seconds) the claim path reads ``maxmemory-policy`` again.
    policy_recheck_seconds: float
    _policy_due = 0.0
    _policy_refusal = ""

    def _check_server(self) -> None:
        """At first use: the eviction policy; for a worker (not ``passive``), persistence and version too."""
        self._check_policy(warn=True)
        if not self.passive:  # a worker, not an operator's look or a metrics scrape
            self._check_persistence()
            self._check_version()

    def _settings(self, name: str, *, warn: bool) -> list[str] | None:
        """A setting on every primary, or None (warned if ``warn``) when CONFIG is disabled or renamed."""
        try:
            return config_get(self.client, name)
        except redis_lib.RedisError as exc:
            error = ledger_error(exc)
            if isinstance(error, LedgerUnavailableError):
                raise error from exc
            if warn:
                log.warning("idemmail: cannot read Redis %s (%s); check it by hand (see the Redis ledger's docs)",
                            name, logsafe(exc))
            return None

    def _check_policy(self, *, warn: bool = False) -> None:
        """Refuse an evicting ``maxmemory-policy``."""
        self._policy_due = time.monotonic() + self.policy_recheck_seconds
        bad = sorted({p for p in self._settings("maxmemory-policy", warn=warn) or [] if p != "noeviction"})
        if bad and not self.allow_eviction:
            self._policy_refusal = (f"Redis maxmemory-policy is {bad[0]!r}: evicted ledger records would reopen their "
                                    "keys and re-send. Set it to 'noeviction' (or pass allow_eviction=True).")
            if self._checked:  # it changed at runtime
                log.error("idemmail: Redis ledger %s refuses new claims: %s", self.prefix, self._policy_refusal)
            raise UnsafeLedgerError(self._policy_refusal)
        self._policy_refusal = ""

    def _watch_policy(self) -> None:
        """On the claim path: refuse while the policy is known bad; read it again when due."""
        if time.monotonic() >= self._policy_due:
            try:
                self._check_policy()
            except LedgerUnavailableError:
                return  # the claim meets the outage itself
        elif self._policy_refusal:
            raise UnsafeLedgerError(self._policy_refusal)

    def _check_persistence(self) -> None:
        """Warn (not refuse) when a server keeps no copy on disk: no AOF and no RDB save point."""
        aof = self._settings("appendonly", warn=False)
        saves = self._settings("save", warn=False)
        if aof is None or saves is None:
            log.warning("idemmail: cannot read the Redis persistence settings; make sure AOF is on (appendonly yes)")
            return
        if "yes" not in aof and not any(v.strip() for v in saves):
            log.warning(
                "idemmail: Redis ledger %s: the server keeps no copy on disk (appendonly no, no save points): a "
                "restart empties the ledger, and every intent recorded before it is forgotten (the loss is "
                "detected and claims stop until `idemmail ledger ack-loss`). Turn on AOF: appendonly yes.",
                self.prefix)

    def _check_version(self) -> None:
        """Refuse a server older than Redis 7.0 (no ``PEXPIREAT ... GT``); without INFO, warn."""
        try:
            info = raw(self.client.info, "server")
        except LedgerUnavailableError:
            raise
        except LedgerError as exc:
            log.warning("idemmail: cannot read the Redis version (%s); this ledger needs Redis 7.0 or later",
                        logsafe(exc))
            return
        found = [info] if "redis_version" in info else [v for v in info.values() if isinstance(v, dict)]
        for node in found:
            version = str(node.get("redis_version", ""))
            parts = version.split(".")
            if len(parts) >= 2 and parts[0].isdigit() and int(parts[0]) < 7:
                raise UnsafeLedgerError(f"Redis {version}: this ledger (record layout {LAYOUT}) needs Redis 7.0 or "
                                        "later (PEXPIREAT ... GT on its shelves of sent records)")
