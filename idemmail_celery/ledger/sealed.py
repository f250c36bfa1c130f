"""Payloads at rest (docs/payloads.md): ``from_url(url, payload_keys=[...])`` wraps the backend in a
:class:`SealedLedger`, sealing the first payload as ``"fernet:" + token`` and the result, error and resolution as
``{"$fernet": token}``; what the ledger decides on stays plain. The first key seals, every key opens; a record sealed
with a key no longer configured raises :class:`PayloadKeyError`, and a claim that finds one parks it for review."""

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
    """Park a held claim whose payload this process cannot open (``payload_key_unknown``, written plain to the backend
    ``ledger``) and return it ``done``, never run; ``busy`` if the ledger refuses (its lease runs out)."""
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
    """Seals and opens ledger fields (first payloads, results, errors) with a ``Keyring``."""

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
        return replace(record, payload=self.open_payload(record.payload), result=self.open_dict(record.result),
                       error=self.open_dict(record.error), resolution=self.open_dict(record.resolution))

    def open_readable(self, record: Record) -> tuple[Record, bool]:
        """``record`` with the fields a configured key opens opened, the others None; and whether all opened."""
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
    """Seals payloads, results and errors before they reach ``inner``: ``from_url(url, payload_keys=[...])``."""

    def __init__(self, inner: Ledger, codec: PayloadCodec) -> None:
        super().__init__(inner)
        self.codec = codec

    # -- in: seal --

    def _seal_request(self, request: ClaimRequest) -> ClaimRequest:
        return replace(request, payload=self.codec.seal_payload(request.payload))

    def claim(self, request: ClaimRequest) -> Claim:
        """As the backend's; PayloadKeyError for a record sealed with an unknown key (parked if taken), unless busy."""
        claim, ok = self._opened(request, self.inner.claim(self._seal_request(request)))
        if not ok and claim.status is not ClaimStatus.BUSY:  # busy: not parked yet, come back later
            parked = " (parked for review)" if claim.record.state is State.REVIEW else ""
            raise PayloadKeyError(f"ledger record {request.key} is sealed with a key that is not in "
                                  f"idemmail_payload_keys{parked}; put the old key back after the current one")
        return claim

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Claim]:
        """As the backend's; an unknown key never fails the batch: a taken record is parked, others' fields None."""
        claims = self.inner.claim_many([self._seal_request(r) for r in requests])
        return [self._opened(r, c)[0] for r, c in zip(requests, claims, strict=True)]

    def _finish(self, key: str, token: int, state: State, *, result: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None, mark: Mark | None = None) -> float | None:
        # The mark holds no free text: kept plain, for the store to read.
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
        # Held, and its first payload cannot be read: never run it; a person decides.
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
        """The backend's selection, opened; the reason and words (sealed in the store) are checked by the caller."""
        plain = query.without(reason=True, search=True)
        found = self.inner._listing_window(plain, position, want, skip if plain == query else 0)
        # A field sealed with a key not held is None.
        items = [(at, self.codec.open_readable(record)[0]) for at, record in found.items]
        return Selection(items, found.resume, found.skipped)

    def count(self, query: RecordQuery | None = None) -> Counts:
        """The backend's counts, its reasons unknown (it cannot read a sealed error)."""
        return replace(self.inner.count(query), reasons_known=False)

    def _readable(self, key: str) -> Record | None:
        """Erasing needs no key: what this process cannot open is erased whole."""
        record = self.inner.get(key)
        return None if record is None else self.codec.open_readable(record)[0]

    # -- the backend's own, but what it stores is sealed --

    def _erase(self, key: str, expected_token: int, expected_state: State, result: dict[str, Any] | None,
               error: dict[str, Any] | None, resolution: dict[str, Any] | None) -> bool:
        c = self.codec
        return self.inner._erase(key, expected_token, expected_state, c.seal_dict(result), c.seal_dict(error),
                                 c.seal_dict(resolution))
