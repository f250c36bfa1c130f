"""The Redis ledger's epoch markers: ledger-loss detection, and the record layout's version.

Every script gets the epoch this process read and refuses, writing nothing, when its bucket's marker
(``<prefix>:{bb}:epoch``) is missing, different or flagged lost; the process then adopts an acknowledged epoch or
raises :class:`LedgerLostError` and flags every marker (docs/operations.md, "Ledger loss"). The markers also fix the
bucket count, shelves, retention and layout (:data:`~.layout.LAYOUT`): :class:`UnsafeLedgerError` otherwise."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from typing import Any

from ..._common import logsafe
from ...errors import IllegalTransitionError, LedgerLostError, UnsafeLedgerError
from ..base import default_owner
from .client import raw
from .layout import LAYOUT
from .plumbing import RedisBase, log

#: Marker fields a status reports as they are.
_REPORTED = ("created_at", "created_by", "acked_at", "acked_by", "note", "shelves", "retention_ms")


class Epochs(RedisBase):
    """The epoch markers (see the module docstring), a mixin of ``RedisLedger``."""

    #: A process that finds no markers and no records starts a new ledger (False: ``ledger init`` first).
    auto_init: bool
    #: The epoch this process holds; None before the check or while lost.
    _epoch: str | None = None
    #: Once this process has seen the ledger lost: the epoch it held then ("" if none).
    _dead_epoch: str | None = None
    _lost_reason = ""

    def loss_status(self) -> dict[str, Any]:
        """The markers, read fresh: ``state`` ``ok`` (one epoch everywhere), ``new`` (no marker, no record) or ``lost``,
        with ``epoch``, ``reason``, ``buckets``, any acknowledgement; UnsafeLedgerError for another shape or layout."""
        return self._status(None)

    def init_store(self, *, actor: str = "") -> dict[str, Any]:
        """Create the epoch markers of a new (empty) ledger; :class:`IllegalTransitionError` on a lost one."""
        status = self.loss_status()
        if status["state"] == "lost":
            raise IllegalTransitionError(f"the ledger is lost ({status['reason']}): acknowledge it with ack-loss")
        if status["state"] == "new":
            status = self._create_markers(actor or default_owner(), "init")
        return status

    def acknowledge_loss(self, *, note: str, actor: str = "") -> dict[str, Any]:
        """An operator accepts the loss: every bucket gets a fresh acknowledged epoch, adopted by workers at their next
        claim (intents recorded before are forgotten: ``recovered_at``). IllegalTransitionError without a loss."""
        before = self._status(None)
        if before["state"] != "lost":
            raise IllegalTransitionError(f"the ledger is not lost (state {before['state']}): nothing to acknowledge")
        now = time.time()
        fields = {"epoch": secrets.token_hex(8), "buckets": self.buckets, "layout": LAYOUT, "created_at": now,
                  "created_by": actor or default_owner(), "acked_at": now, "acked_by": actor or default_owner(),
                  "note": note, "previous": before.get("epoch") or "", "loss": before["reason"],
                  **self._store_settings(before)}
        self._write_markers(fields, replace=True)
        with self._check_lock:
            self._epoch, self._lost_reason, self._dead_epoch = str(fields["epoch"]), "", None
            self.recovered_at = now
        return self._judge(self._markers(), None, True)

    # -- reading the markers --

    def _markers(self) -> list[dict[str, str]]:
        return self._pipeline([("hgetall", (self.names.marker(b),)) for b in range(self.buckets)])

    def _has_records(self) -> bool:
        """Any index or sent counter in any bucket (one pipeline)."""
        checks = [("exists", (name,)) for b in range(self.buckets) for name in self.names.written(b)]
        return any(self._pipeline(checks))

    def _status(self, expected: str | None) -> dict[str, Any]:
        markers = self._markers()
        if all(markers):
            return self._judge(markers, expected, True)
        # A marker is missing: with records, read again (a new ledger's markers are all written before its
        # first record, so another process's half-written markers are not mistaken for a loss).
        has_records = self._has_records()
        if has_records:
            markers = self._markers()
        return self._judge(markers, expected, has_records)

    def _judge(self, markers: list[dict[str, str]], expected: str | None, has_records: bool) -> dict[str, Any]:
        """The status ``markers`` show to a process holding the epoch ``expected`` (None: none yet)."""
        self._refuse_foreign(markers)
        first = next((m for m in markers if m), {})
        out: dict[str, Any] = {"state": "ok", "buckets": self.buckets, "epoch": first.get("epoch"), "reason": "",
                               **{name: first[name] for name in _REPORTED if first.get(name)}}
        state, reason = _verdict(markers, first, expected, has_records)
        return {**out, "state": state, "reason": reason}

    def _refuse_foreign(self, markers: list[dict[str, str]]) -> None:
        """Refuse markers of another bucket count or record layout (every intent there would look new)."""
        counts = {m["buckets"] for m in markers if m.get("buckets")}
        if counts and counts != {str(self.buckets)}:
            raise UnsafeLedgerError(
                f"this Redis ledger was created with {'/'.join(sorted(counts))} buckets; this process is "
                f"configured with {self.buckets}: records would be looked for in the wrong buckets. Use the same "
                "`buckets`.")
        layouts = {m.get("layout") or "unknown" for m in markers if m.get("epoch")} - {LAYOUT}
        if layouts:
            raise UnsafeLedgerError(
                f"Redis ledger prefix {self.prefix!r} was written in record layout {'/'.join(sorted(layouts))}; this "
                f"version reads layout {LAYOUT} only and would not find its records, so every intent recorded there "
                "would look new and send again. Run the version that wrote it, or give this one another `prefix`.")

    # -- settling this process's epoch --

    def _look(self, expected: str | None) -> None:
        """Read the markers and settle this process's epoch (or lost reason), with the lock held."""
        dead = self._dead_epoch
        held = expected if expected is not None else dead or None
        status = self._status(held)
        if status["state"] == "new" and held is None and dead is None and self.auto_init and not self.passive:
            status = self._create_markers(default_owner(), "auto_init")
        settings = self._store_settings(status)
        self.shelves, self._retention_ms = settings["shelves"], settings["retention_ms"]
        status = _remembered(status, dead)
        if status["state"] == "ok":
            self._adopt(status, held)
        else:
            self._stop(status, held)

    def _adopt(self, status: dict[str, Any], held: str | None) -> None:
        """Hold the markers' epoch (an operator's acknowledged one, when it is not the one held before)."""
        if held is not None and status["epoch"] != held:
            log.warning("idemmail: Redis ledger %s: adopting epoch %s acknowledged by %s (%s)",
                        self.prefix, logsafe(status["epoch"]), logsafe(status.get("acked_by")),
                        logsafe(status.get("note")))
        self._epoch, self._lost_reason, self._dead_epoch = status["epoch"], "", None
        self.recovered_at = float(status["acked_at"]) if status.get("acked_at") else None

    def _stop(self, status: dict[str, Any], held: str | None) -> None:
        """Hold no epoch: the ledger is lost (every marker flagged, unless passive) or not initialised."""
        if status["state"] == "new":  # auto_init=False (or passive), and no loss seen by this process
            reason = (f"the ledger is not initialised ({'passive' if self.passive else 'auto_init=False'}): "
                      "run `idemmail ledger init`")
        else:
            reason = status["reason"]
            self._dead_epoch = held or ""
            if not self.passive:
                self._flag_lost(self._dead_epoch, reason)
        if reason != self._lost_reason:
            if not self.passive:
                log.critical(
                    "idemmail: Redis ledger %s is LOST: %s. Nothing is claimed or sent until an operator "
                    "decides: check the store, then run `celery -A proj idemmail ledger ack-loss --note ...` "
                    "(intents recorded before the loss are then forgotten).", self.prefix, logsafe(reason))
            elif status["state"] == "lost":
                log.warning("idemmail: Redis ledger %s is LOST: %s", self.prefix, logsafe(reason))
        self._epoch, self._lost_reason = None, reason

    def _confirm_loss(self) -> None:
        """A script said ``lost``: read the markers again; raise unless an acknowledged epoch was adopted."""
        with self._check_lock:
            self._look(expected=self._epoch)
        if self._epoch is None:
            raise self._lost_error()

    def _lost_error(self) -> LedgerLostError:
        why = self._lost_reason or "its epoch marker changed"
        return LedgerLostError(f"Redis ledger {self.prefix!r} is lost: {why}. Nothing is claimed until an operator "
                               "runs `idemmail ledger ack-loss --note ...`.")

    # -- writing the markers --

    def _flag_lost(self, dead_epoch: str, reason: str) -> None:
        """Mark every bucket lost, so that processes starting later stop too."""
        args = [dead_epoch, reason, default_owner(), time.time()]
        self._run_scripts(self.scripts["flag"], [([self.names.marker(b)], args) for b in range(self.buckets)])

    def _create_markers(self, actor: str, note: str) -> dict[str, Any]:
        """A new ledger's markers. Concurrent creators converge on the epoch bucket 0 got first."""
        fields = {"epoch": secrets.token_hex(8), "buckets": self.buckets, "layout": LAYOUT, "created_at": time.time(),
                  "created_by": actor, "note": note, **self._store_settings({})}
        self._write_markers(fields, replace=False, buckets=[0])
        # Bucket 0's epoch and shelf settings (a concurrent creator's may differ from ours).
        fields["epoch"], fields["shelves"], fields["retention_ms"] = raw(
            self.client.hmget, self.names.marker(0), "epoch", "shelves", "retention_ms")
        self._write_markers(fields, replace=False)
        return self._judge(self._markers(), None, True)

    def _write_markers(self, fields: dict[str, Any], *, replace: bool, buckets: Iterable[int] | None = None) -> None:
        """Write ``fields`` into every bucket's marker (or ``buckets``'): over it if ``replace``, else where none."""
        flat = ["1" if replace else "0", *(x for kv in fields.items() for x in kv)]
        chosen = range(self.buckets) if buckets is None else buckets
        self._run_scripts(self.scripts["mark"], [([self.names.marker(b)], flat) for b in chosen])

    def _store_settings(self, marker: dict[str, Any]) -> dict[str, int]:
        """The shelf fields (shelves, retention in ms): ``marker``'s when it has them, else this process's."""
        if marker.get("shelves") and marker.get("retention_ms"):
            return {"shelves": int(marker["shelves"]), "retention_ms": int(marker["retention_ms"])}
        return {"shelves": self.shelves, "retention_ms": max(1, int(self.retention_seconds * 1000))}


def _verdict(markers: list[dict[str, str]], first: dict[str, str], expected: str | None,
             has_records: bool) -> tuple[str, str]:
    """The state and reason ``markers`` show (see :meth:`Epochs.loss_status`); ``first``: the first that exists."""
    flagged = next((m for m in markers if m.get("lost")), None)
    if flagged is not None:
        return "lost", f"{flagged['lost']} (flagged by {flagged.get('lost_by')})"
    missing = [b for b, m in enumerate(markers) if not m.get("epoch")]
    epochs = {m["epoch"] for m in markers if m.get("epoch")}
    if not missing and len(epochs) == 1:  # ok, unless not the epoch held and nobody acknowledged it
        if expected is not None and first["epoch"] != expected and not first.get("acked_at"):
            return "lost", (f"the epoch changed from {expected} to {first['epoch']} without an acknowledgement: "
                            "the store was emptied and a process that never saw it started afresh")
        return "ok", ""
    if len(missing) == len(markers):  # no bucket has an epoch marker
        if expected is not None:
            return "lost", f"every epoch marker is gone (this process held {expected})"
        if has_records:
            return "lost", "records exist but no bucket has an epoch marker"
        return "new", "no marker and no record"
    if _being_created(markers, expected, has_records):
        return "new", "a new ledger's markers are being written"
    if missing:
        return "lost", f"buckets {_ranges(missing)} lost their epoch marker"
    return "lost", f"buckets disagree on the epoch ({', '.join(sorted(epochs))})"


def _being_created(markers: list[dict[str, str]], expected: str | None, has_records: bool) -> bool:
    """Another process is writing a new ledger's markers (bucket 0 first, then the others): join it."""
    first = markers[0]
    if expected is not None or has_records or not first.get("epoch") or first.get("acked_at"):
        return False
    others = {m["epoch"] for m in markers if m.get("epoch")}
    missing = any(not m.get("epoch") for m in markers)
    return missing and others == {first["epoch"]} and time.time() - float(first.get("created_at") or 0) < 30


def _remembered(status: dict[str, Any], dead: str | None) -> dict[str, Any]:
    """``status`` for a process that saw the ledger lost holding ``dead`` ("": none; None: never saw it): only an
    epoch acknowledged since is accepted, even if the flags went with the data."""
    if dead is None or status["state"] == "lost" or (status.get("acked_at") and status["epoch"] != dead):
        return status
    said = status["reason"] or f"epoch {status['epoch']}, not acknowledged since"
    return {**status, "state": "lost", "reason": (
        f"this process saw the ledger lost{f' (it held epoch {dead})' if dead else ''} and the markers "
        f"show no acknowledgement since ({said}): the store was emptied again, or restored from an old copy")}


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(out)
