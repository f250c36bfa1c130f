"""The chain protocol: what one message of an intent tells the next one, and the headers it travels under.

:class:`ChainState` is what a message's sealed headers say (read once, :meth:`ChainState.from_headers`; written
back by :func:`next_headers`); :class:`Carry` is what the handler hands the next delivery (``Step.carry``);
:class:`Verdict` a decision waiting to be recorded. Every header name is spelled here only: the handler works on
these values, and only the adapters (``task.py``, ``bulk.py``) turn them into headers and back.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

# -- message headers: what travels with a message between the caller, the broker and workers --

#: The intent key (a keyed hash), set by ``apply_async`` before anything is enqueued.
KEY_HEADER = "idempotency_key"
#: The seal of :data:`SEALED_HEADERS` (``IntentKeyBuilder.seal``); without a valid one the key is a caller's own.
KEY_MARK_HEADER = "idemmail_key_mark"
#: During a key-secret rotation: the keys the same call had under the older secrets.
OLDER_KEYS_HEADER = "idemmail_older_keys"
#: The tenant that namespaces the key, when the caller named one.
TENANT_HEADER = "idempotency_tenant"
#: When the intent was first enqueued (caller's clock, epoch seconds).
ENQUEUED_HEADER = "idemmail_enqueued"
#: When a countdown or ETA first lets the message run, if later than its enqueue: the retention rule and the
#: retry deadline count from it (the ledger-loss rule from the enqueue: a copy due at once may have been sent).
DUE_HEADER = "idemmail_due"
#: When the outbox relay published the row this message stands for: the retry deadline counts from it if later.
RELAYED_HEADER = "idemmail_relayed"
#: How many times this chain was rescheduled because another holder's claim was live.
INFLIGHT_HEADER = "idemmail_inflight"
#: How many times this chain was rescheduled because the ledger (or the provider's set-up) was unavailable.
OUTAGE_HEADER = "idemmail_outage"
#: The owners this chain may still hold its claim under, newest first (a list; see ``Delivery.resume_owners``).
OWNER_HEADER = "idemmail_owner"
#: A verdict this chain reached but could not record (the ledger was down): recorded by the next delivery.
VERDICT_HEADER = "idemmail_verdict"
#: The id of this published reschedule: two copies of one broker message share it (see ``Ledger.mark_hop``).
HOP_HEADER = "idemmail_hop"
#: Where a campaign's next pass starts, and what the passes before it came to (see ``bulk.py``).
CAMPAIGN_HEADER = "idemmail_campaign"
#: Epoch seconds before which this message only waits (a long countdown split into hops the broker keeps).
NOT_BEFORE_HEADER = "idemmail_not_before"
#: The version of the header format a message was written in (:data:`HEADER_FORMAT`), sealed with the rest.
FORMAT_HEADER = "idemmail_format"
#: The header format this release writes, and the ones it reads (none: "1"); any other is requeued as it came
#: for a worker that reads it (docs/upgrading.md).
HEADER_FORMAT = "1"
READ_FORMATS = ("1",)
#: The time a beat entry was due (ISO 8601, the app's timezone): the slot a digest is keyed by.
SLOT_HEADER = "idemmail_slot"
#: When a message sealed under a key secret its worker lacks first waited; not sealed (it only sets the log level).
SECRET_WAIT_HEADER = "idemmail_secret_wait"

#: Headers the worker acts on only under a valid seal (:data:`KEY_MARK_HEADER`); not the tenant, which only
#: namespaces a key the worker hashes or derives itself.
SEALED_HEADERS = (KEY_HEADER, OLDER_KEYS_HEADER, ENQUEUED_HEADER, DUE_HEADER, RELAYED_HEADER, INFLIGHT_HEADER,
                  OUTAGE_HEADER, OWNER_HEADER, VERDICT_HEADER, HOP_HEADER, CAMPAIGN_HEADER, NOT_BEFORE_HEADER,
                  FORMAT_HEADER)
#: Headers that belong to one reschedule chain: a ``retry()`` starts a new chain without them.
CHAIN_HEADERS = (INFLIGHT_HEADER, OUTAGE_HEADER, OWNER_HEADER, VERDICT_HEADER, HOP_HEADER, NOT_BEFORE_HEADER)
#: The chain headers that hold for one message only: a reschedule keeps the budgets and drops these.
ONE_SHOT_HEADERS = (OWNER_HEADER, VERDICT_HEADER, HOP_HEADER, NOT_BEFORE_HEADER)

#: The name of the intent key in a provider's message metadata, which delivery webhooks read it back from.
KEY_TAG = "idemmail_key"
#: A wait for an unknown key secret longer than this is logged at ERROR (the secret was removed too early).
SECRET_WAIT_ERROR_SECONDS = 600.0
#: The most older keys a message may name (one per older key secret still being rotated out).
MAX_OLDER_KEYS = 8
#: How many of a chain's owners travel (one more each time a claim's reply is lost in a row).
MAX_OWNERS = 16

VerdictState = Literal["sent", "failed", "review"]
_VERDICT_STATES: tuple[VerdictState, ...] = ("sent", "failed", "review")


@dataclass(frozen=True)
class Verdict:
    """A decision a delivery reached and could not record (the ledger was down): the next delivery of its
    chain takes the claim back and records it, and runs nothing."""

    state: VerdictState
    #: ``sent``: what to record as the result (``{"message_id": ..., "value": ...}``).
    result: dict[str, Any] | None = None
    #: ``failed``/``review``: the error record to store.
    error: dict[str, Any] | None = None

    def to_header(self) -> dict[str, Any]:
        out = {"state": self.state, "result": self.result, "error": self.error}
        return {name: value for name, value in out.items() if value is not None}

    @classmethod
    def from_header(cls, header: Any) -> Verdict | None:
        """A verdict header as the broker returns it (a dict, or JSON text); None when absent or malformed."""
        if isinstance(header, str):
            try:
                header = json.loads(header)
            except ValueError:
                return None
        if not isinstance(header, dict):
            return None
        state = header.get("state")
        if state not in _VERDICT_STATES:
            return None
        result, error = header.get("result"), header.get("error")
        return cls(state=state, result=result if isinstance(result, dict) else None,
                   error=error if isinstance(error, dict) else None)


@dataclass(frozen=True)
class Carry:
    """What a step hands to the next delivery of its chain (``Step.carry``, for RETRY and RESCHEDULE): a
    reschedule keeps the chain's budgets unless set here, a retry starts a new chain; the one-shot parts
    (owners, verdict, hop) go unless carried again (:func:`next_headers`)."""

    #: The owners that may hold this chain's claim, newest first: the next delivery takes it back.
    owners: tuple[str, ...] = ()
    #: A decision to record, never run again.
    verdict: Verdict | None = None
    #: The chain's reschedule counts (RESCHEDULE; a RETRY starts a new chain).
    inflight: int | None = None
    outage: int | None = None
    #: The hop the reschedule goes out as (a copy that comes back as the same hop); None: a new one.
    hop: str | None = None
    #: A first date for an undated message (a retry on the time budget counts from its first sight).
    enqueued_at: float | None = None

    def to_headers(self) -> dict[str, Any]:
        out = {OWNER_HEADER: list(self.owners) or None, VERDICT_HEADER: self.verdict and self.verdict.to_header(),
               INFLIGHT_HEADER: self.inflight, OUTAGE_HEADER: self.outage, HOP_HEADER: self.hop,
               ENQUEUED_HEADER: None if self.enqueued_at is None else f"{self.enqueued_at:.3f}"}
        return {name: value for name, value in out.items() if value is not None}


@dataclass(frozen=True)
class ChainState:
    """What the headers of one message say about its intent and its chain, read once (``from_headers``), only
    from headers under a valid seal; a malformed value reads as absent: a message is never lost to its headers."""

    key: str = ""
    #: The older keys the caller sent (a rotation); None: it sent none, the worker works them out.
    older_keys: tuple[str, ...] | None = None
    tenant: str | None = None
    enqueued_at: float | None = None
    due_at: float | None = None
    relayed_at: float | None = None
    inflight: int = 0
    outage: int = 0
    owners: tuple[str, ...] = ()
    verdict: Verdict | None = None
    hop: str = ""
    not_before: float | None = None
    #: A campaign pass's place, as ``bulk.py`` wrote it (it reads it back itself).
    campaign: Any = None
    #: Is the message sealed by the library (its key claimed as it is)?
    sealed: bool = False
    #: The header format it was written in (:data:`FORMAT_HEADER`).
    format: str = HEADER_FORMAT

    @classmethod
    def from_headers(cls, headers: Mapping[str, Any]) -> ChainState:
        older = headers.get(OLDER_KEYS_HEADER)
        tenant = headers.get(TENANT_HEADER)
        return cls(
            key=str(headers.get(KEY_HEADER) or ""),
            older_keys=tuple(str(k) for k in older[:MAX_OLDER_KEYS]) if isinstance(older, list) else None,
            tenant=None if tenant is None else str(tenant),
            enqueued_at=number(headers.get(ENQUEUED_HEADER)), due_at=number(headers.get(DUE_HEADER)),
            relayed_at=number(headers.get(RELAYED_HEADER)),
            inflight=count(headers.get(INFLIGHT_HEADER)), outage=count(headers.get(OUTAGE_HEADER)),
            owners=owners_of(headers.get(OWNER_HEADER)), verdict=Verdict.from_header(headers.get(VERDICT_HEADER)),
            hop=str(headers.get(HOP_HEADER) or ""), not_before=number(headers.get(NOT_BEFORE_HEADER)),
            campaign=headers.get(CAMPAIGN_HEADER), sealed=KEY_MARK_HEADER in headers,
            format=str(headers.get(FORMAT_HEADER) or HEADER_FORMAT),
        )

    @property
    def readable(self) -> bool:
        """Is the message in a header format this release reads (:data:`READ_FORMATS`)?"""
        return self.format in READ_FORMATS

    @property
    def rescheduled(self) -> bool:
        """Has this chain been rescheduled before (busy or unavailable)?"""
        return bool(self.inflight or self.outage)

    @property
    def retry_from(self) -> float | None:
        """When the retry deadline counts from: the latest of the enqueue, the due time and an outbox relay's
        publish (a row relayed hours after it was written still has its whole budget); None: undated."""
        if self.enqueued_at is None:
            return None
        return max(self.enqueued_at, self.due_at or 0.0, self.relayed_at or 0.0)


def intent_headers(key: str, older: Iterable[str], *, enqueued_at: float, due_at: float | None = None,
                   tenant: Any = None) -> dict[str, Any]:
    """The headers of a new intent (unsealed): its key, older keys, enqueue time, due time when later, tenant."""
    headers = key_headers(key, older)
    headers[ENQUEUED_HEADER] = f"{enqueued_at:.3f}"
    if due_at is not None and due_at > enqueued_at:
        headers[DUE_HEADER] = f"{due_at:.3f}"
    if tenant is not None:
        headers[TENANT_HEADER] = str(tenant)
    return headers


def key_headers(key: str, older: Iterable[str] = ()) -> dict[str, Any]:
    """The headers that put a key (and its forms under older key secrets) on a message, unsealed."""
    headers: dict[str, Any] = {KEY_HEADER: key, FORMAT_HEADER: HEADER_FORMAT}
    older = list(older)
    if older:
        headers[OLDER_KEYS_HEADER] = older
    return headers


def next_headers(headers: Mapping[str, Any], carry: Carry | Mapping[str, Any], *, keep: bool) -> dict[str, Any]:
    """The headers of a chain's next message: ``headers`` less this one's chain state (all of it for a new
    chain, ``keep=False``; the one-shot parts for a reschedule), plus ``carry``. Every adapter writes chain
    state through here."""
    drop = set(ONE_SHOT_HEADERS if keep else CHAIN_HEADERS)
    out = {k: v for k, v in headers.items() if k not in drop}
    out.update(carry.to_headers() if isinstance(carry, Carry) else carry)
    return out


def with_hop(headers: dict[str, Any], hop: str, not_before: float | None) -> None:
    """Name the hop a message goes out as, and (a wait longer than the broker keeps a countdown) the time
    before which it only waits; in place."""
    headers[HOP_HEADER] = hop
    if not_before is None:
        headers.pop(NOT_BEFORE_HEADER, None)
    else:
        headers[NOT_BEFORE_HEADER] = f"{not_before:.3f}"


def held_by(owner: str | None, owners: Iterable[str]) -> tuple[str, ...]:
    """The owners that may hold a chain's claim after a claim as ``owner`` whose reply did not come back:
    ``owner`` (it landed) or any of ``owners`` (it did not), newest first, each once."""
    return tuple(dict.fromkeys(o for o in (owner, *owners) if o))[:MAX_OWNERS]


def owners_of(header: Any) -> tuple[str, ...]:
    """An owner header as the broker returns it (a list, newest first); () when absent or malformed."""
    if isinstance(header, (list, tuple)):
        return tuple(str(o) for o in header if isinstance(o, str) and o)[:MAX_OWNERS]
    return ()


def number(value: Any) -> float | None:
    """A time header as a float; None when absent or not a number."""
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def count(value: Any) -> int:
    """A budget header as a count; 0 when absent or malformed."""
    try:
        return max(int(value or 0), 0)
    except (TypeError, ValueError):
        return 0


def campaign_pass_headers(headers: Mapping[str, Any], owners: Iterable[str], verdicts: Mapping[str, Any],
                          resume: Any = None) -> dict[str, Any]:
    """The headers of a campaign's next pass (``bulk.py``): ``headers`` with the claim owners it may hold, its
    unrecorded verdicts (by claim key, each a :meth:`Verdict.to_header` with its ``owner`` list) and where it
    starts (none: the whole list) in place of the ones this pass came with. Unsealed."""
    out = {k: v for k, v in headers.items() if k not in (OWNER_HEADER, VERDICT_HEADER, CAMPAIGN_HEADER)}
    out[OWNER_HEADER] = list(owners)
    if verdicts:
        out[VERDICT_HEADER] = dict(verdicts)
    if resume is not None:
        out[CAMPAIGN_HEADER] = resume
    return out


def campaign_verdicts(headers: Mapping[str, Any]) -> dict[str, Any]:
    """A campaign pass's unrecorded verdicts as its headers carry them (by claim key); {} when none or malformed."""
    carried = headers.get(VERDICT_HEADER)
    return carried if isinstance(carried, dict) else {}
