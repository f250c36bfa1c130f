"""Payloads at rest: first payloads, results and errors sealed with Fernet, in any ledger.

``from_url(url, payload_keys=[...])`` (the ``idemmail_payload_keys`` setting) wraps the
backend in a :class:`SealedLedger`. The backend stores what it is given and never sees
plaintext; the wrapper seals on the way in and opens on the way out, so every backend,
present and future, gets encryption without a line of its own.

What is sealed, and how it looks in the store:

* the first payload (task arguments: addresses, names, bodies): ``"fernet:" + token``;
* the result and the error (return values and exception messages can hold personal
  data too, e.g. a provider's "550 <ann@example.com> unknown"): ``{"$fernet": token}``.

Left plain, because the ledger must read them to decide without any key: the intent key
and fingerprint (keyed hashes), task name, state, token, owner (``host:pid``), counters
and timestamps.

Keys are Fernet keys (AES-128-CBC with HMAC-SHA256, ``cryptography``). The first key
seals; every key opens, so rotation is: add the new key second, deploy, move it first,
deploy; drop the old key only when nothing sealed with it remains (see docs/payloads.md). A first
entry ``"plain"`` seals nothing and still opens: the step for turning encryption on or off.
A record sealed with a key no longer configured raises :class:`PayloadKeyError`; a
claim that finds one parks it for review instead of running garbage. So does a process
with no payload keys at all (:func:`park_unreadable`, used by the task and bulk sends on
a plain ledger). If parking fails, the claim is reported ``busy``: its lease runs out and
the next delivery meets the record again, so it is never left claimed by nobody. Plaintext
records written before encryption was turned on still read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from .._common import logsafe
from ..encoding import canonical_json
from ..errors import LedgerError, PayloadKeyError
from ..sealing import INSTALL_HINT, PLAIN, Keyring  # noqa: F401  # re-exported: part of this module's API
from .base import Claim, ClaimRequest, ClaimStatus, Ledger, Mark, Record, State, loads_json
from .listing import Counts, Position, RecordQuery, Selection
from .wrapper import LedgerWrapper

log = logging.getLogger("idemmail_celery")

SEALED_PREFIX = "fernet:"
SEALED_FIELD = "$fernet"
#: The review reason of a claim parked because its record could not be opened.
PAYLOAD_KEY_UNKNOWN = "payload_key_unknown"


def is_sealed(payload: str | None) -> bool:
    """Is this stored first payload sealed (as a ledger without payload keys returns it)?"""
    return payload is not None and payload.startswith(SEALED_PREFIX)


def park_unreadable(ledger: Ledger, claim: Claim) -> Claim:
    """Settle a held claim whose first payload this process cannot open: it is never run.

    Parks the record as ``review`` (reason ``payload_key_unknown``, the stored payload kept
    for whoever holds the key) and returns it as ``done``. If the ledger refuses, returns it
    as ``busy``: the claim's lease runs out and the next delivery meets the record again
    (callers reschedule), rather than failing with the record left claimed by nobody.
    ``ledger`` is the backend itself: the note is written plain, so any key holder reads it.
    """
    record = claim.record
    error = {"type": "SendNeedsReview", "reason": PAYLOAD_KEY_UNKNOWN, "at": time.time(),
             "message": "sealed with a key that is not in idemmail_payload_keys; put it back and resolve"}
    try:
        ledger._finish(record.key, claim.token, State.REVIEW, error=error)
    except LedgerError as exc:
        log.error("idemmail: could not park unreadable record %s (retried when its lease runs out): %s",
                  logsafe(record.key), logsafe(exc))
        return Claim(ClaimStatus.BUSY, record)
    parked = replace(record, state=State.REVIEW, lease_expires_at=None, payload=None, error=error)
    return Claim(ClaimStatus.DONE, parked)


class PayloadCodec(Keyring):
    """Seals and opens ledger fields (first payloads, results, errors) with a
    :class:`~idemmail_celery.sealing.Keyring`."""

    def seal_payload(self, payload: str) -> str:
        return SEALED_PREFIX + self.seal(payload) if self.sealing else payload

    def open_payload(self, payload: str | None) -> str | None:
        if payload is None or not payload.startswith(SEALED_PREFIX):
            return payload  # plaintext, written before encryption was turned on
        return self.open(payload[len(SEALED_PREFIX):])

    def seal_dict(self, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """``{"$fernet": token}`` of the value's canonical JSON (the ledger's own encoding)."""
        if value is None or not self.sealing:
            return value
        return {SEALED_FIELD: self.seal(canonical_json(value))}

    def open_dict(self, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None or len(value) != 1 or not isinstance(value.get(SEALED_FIELD), str):
            return value  # plaintext, or nothing
        return loads_json(self.open(value[SEALED_FIELD]))

    def open_record(self, record: Record) -> Record:
        return replace(
            record, payload=self.open_payload(record.payload),
            result=self.open_dict(record.result), error=self.open_dict(record.error),
            resolution=self.open_dict(record.resolution),
        )

    def open_readable(self, record: Record) -> tuple[Record, bool]:
        """``record`` with every field a configured key opens opened, the others set to None,
        and whether all of them opened."""
        fields: dict[str, Any] = {}
        ok = True
        for name, opener in (("payload", self.open_payload), ("result", self.open_dict), ("error", self.open_dict),
                             ("resolution", self.open_dict)):
            try:
                fields[name] = opener(getattr(record, name))
            except PayloadKeyError:
                fields[name], ok = None, False
        return replace(record, **fields), ok


class SealedLedger(LedgerWrapper):
    """A ledger whose payloads, results and errors are sealed before they reach ``inner``.

    Everything else (renew, forget, purge, stats, ping, and any attribute of the
    backend such as ``prefix`` or ``table``) is the backend's own. Build it with
    ``from_url(url, payload_keys=[...])``.
    """

    def __init__(self, inner: Ledger, codec: PayloadCodec) -> None:
        super().__init__(inner)
        self.codec = codec

    # -- in: seal --

    def _seal_request(self, request: ClaimRequest) -> ClaimRequest:
        return replace(request, payload=self.codec.seal_payload(request.payload))

    def claim(self, request: ClaimRequest) -> Claim:
        """As the backend's. A record sealed with an unknown key raises :class:`PayloadKeyError`,
        after parking it as ``review`` if this claim took it: it is never run. One under a live
        lease (another holder's, or this claim's when parking failed) comes back ``busy``."""
        claim, ok = self._opened(request, self.inner.claim(self._seal_request(request)))
        if not ok and claim.status is not ClaimStatus.BUSY:  # busy: not parked yet, come back later
            raise PayloadKeyError(
                f"ledger record {request.key} is sealed with a key that is not in idemmail_payload_keys"
                + (" (parked for review)" if claim.record.state is State.REVIEW else "")
                + "; put the old key back after the current one"
            )
        return claim

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """As the backend's; one record sealed with an unknown key never fails the batch: a taken
        one is parked and comes back ``done`` (``review``), a done or busy one with the fields
        that cannot be opened set to None."""
        claims = self.inner.claim_many([self._seal_request(r) for r in requests])
        return [self._opened(r, c)[0] for r, c in zip(requests, claims, strict=True)]

    def _finish(
        self,
        key: str,
        token: int,
        state: State,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        mark: Mark | None = None,
    ) -> float | None:
        # The mark holds no free text (a stage, a time, a token, an owner): kept plain, for the store to read.
        return self.inner._finish(key, token, state, result=self.codec.seal_dict(result),
                                  error=self.codec.seal_dict(error), mark=mark)

    def _force(self, key: str, expected_token: int, new: Record) -> bool:
        c = self.codec
        payload = None if new.payload is None else c.seal_payload(new.payload)
        sealed = replace(new, payload=payload, result=c.seal_dict(new.result),
                         error=c.seal_dict(new.error), resolution=c.seal_dict(new.resolution))
        return self.inner._force(key, expected_token, sealed)

    # -- out: open --

    def _opened(self, request: ClaimRequest, claim: Claim) -> tuple[Claim, bool]:
        if claim.status is ClaimStatus.ACQUIRED:  # a fresh record: its payload is the one we sent
            return replace(claim, record=replace(claim.record, payload=request.payload)), True
        record, ok = self.codec.open_readable(claim.record)
        if ok or not claim.status.holds:
            return replace(claim, record=record), ok
        # Held, and its first payload cannot be read: never run it; a person decides. The note holds
        # no personal data and is left plain (inner): whoever has the right key must read it.
        # Parked: done; not parked: busy, and the next claimer after the lease meets the same record.
        return park_unreadable(self.inner, replace(claim, record=record)), False

    def get(self, key: str) -> Record | None:
        record = self.inner.get(key)
        return None if record is None else self.codec.open_record(record)

    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        """Opened records; one sealed with an unknown key is listed as stored (sealed), with a warning."""
        for record in self.inner.iter_records(state):
            try:
                yield self.codec.open_record(record)
            except PayloadKeyError:
                log.warning("idemmail: record %s is sealed with a key not in idemmail_payload_keys",
                            logsafe(record.key))
                yield record

    def _listing_window(self, query: RecordQuery, position: Position | None, want: int, skip: int) -> Selection:
        """The backend's selection, opened. The backend cannot read a sealed error or payload: it is asked
        without the query's reason and words (and to skip nothing then), which are checked here."""
        plain = query.without(reason=True, search=True)
        found = self.inner._listing_window(plain, position, want, skip if plain == query else 0)
        items = []
        for at, record in found.items:
            opened, _ = self.codec.open_readable(record)  # a field sealed with a key not held: None
            items.append((at, opened))
        return Selection(items, found.resume, found.skipped)

    def count(self, query: RecordQuery | None = None) -> Counts:
        """The backend's counts, its reasons unknown: it cannot read a sealed error (a summary then has no
        reasons, and no counts for a query that names one)."""
        return replace(self.inner.count(query), reasons_known=False)

    def _readable(self, key: str) -> Record | None:
        """Erasing needs no key: what this process cannot open is erased whole (a result without
        its message id, an error without its reason) rather than kept."""
        record = self.inner.get(key)
        return None if record is None else self.codec.open_readable(record)[0]

    # -- the backend's own, but what it stores is sealed --

    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None, resolution: dict[str, Any] | None) -> bool:
        c = self.codec
        return self.inner._erase(key, expected_token, expected_state, c.seal_dict(result), c.seal_dict(error),
                                 c.seal_dict(resolution))
