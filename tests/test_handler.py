"""The state machine without Celery: every decision of the handler, on every real backend.

A :class:`Mailbox` stands in for the side effect (it counts what it was asked to send and can
be told to fail); the ledgers are real (Redis, PostgreSQL, MariaDB, SQLite). Where a ledger
must fail at one move, a :class:`LedgerWrapper` refuses that move, as a store that just went
away would, and passes everything else to the real backend.
"""

from __future__ import annotations

import datetime as dt
import inspect
import time
from typing import Any

import pytest

from idemmail_celery.chain import Verdict
from idemmail_celery.errors import (
    AmbiguousSendError,
    ConfigurationError,
    IdempotencyInFlightError,
    InvalidEmail,
    LedgerUnavailableError,
    PermanentSendError,
    SendNeedsReview,
    TransientSendError,
)
from idemmail_celery.handler import Action, Delivery, Handler, Outcome, Policy, Step
from idemmail_celery.keys import IntentKeyBuilder, Payload
from idemmail_celery.ledger import ClaimRequest, Ledger, State
from idemmail_celery.ledger.base import new_owner
from idemmail_celery.ledger.wrapper import LedgerWrapper
from idemmail_celery.providers.base import about_to_send


class Mailbox:
    """The side effect: records each send; ``fail_with`` makes the next sends raise."""

    def __init__(self, *, carries_key: bool = False, ahead: bool = False) -> None:
        self.ahead = ahead  # marks the ledger (about_to_send) before each send, as SMTP does
        self.sent: list[tuple[str, Any]] = []
        self.fail_with: BaseException | None = None
        self.invalid: BaseException | None = None
        self.keyed = carries_key
        self.found: Any = None
        self.reports: list[tuple[Outcome, dict[str, Any]]] = []

    def check(self, payload: Payload) -> None:
        if self.invalid is not None:
            raise self.invalid

    def perform(self, payload: Payload, key: str) -> Any:
        if self.ahead:
            about_to_send("message")
        if self.fail_with is not None:
            raise self.fail_with
        self.sent.append((key, payload.kwargs.get("body")))
        return {"message_id": f"m-{len(self.sent)}"}

    def carries_key(self) -> bool:
        return self.keyed

    def writes_ahead(self) -> bool:
        return self.ahead

    def reconcile(self, key: str, payload: Payload) -> Any:
        return self.found

    def report(self, outcome: Outcome, key: str, **fields: Any) -> None:
        self.reports.append((outcome, fields))


class Refusing(LedgerWrapper):
    """A real ledger that refuses the named moves while ``down`` holds them (the store went away)."""

    def __init__(self, inner: Ledger) -> None:
        super().__init__(inner)
        self.down: set[str] = set()

    def claim(self, request: ClaimRequest) -> Any:
        if "claim" in self.down:
            raise LedgerUnavailableError("store went away (claim)")
        if "claim_lost_reply" in self.down:  # the store runs it; its reply never comes back
            self.inner.claim(request)
            raise LedgerUnavailableError("reply lost")
        return self.inner.claim(request)

    def _finish(self, key: str, token: int, state: State, **kw: Any) -> None:
        if state.value in self.down:
            raise LedgerUnavailableError(f"store went away ({state.value})")
        self.inner._finish(key, token, state, **kw)

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        if "write_ahead" in self.down:
            raise LedgerUnavailableError("store went away (write_ahead)")
        return self.inner.write_ahead(key, token, lease_seconds, stage, owner=owner)


def build(ledger: Ledger, mailbox: Mailbox | None = None, **policy: Any) -> tuple[Handler, Mailbox]:
    builder = IntentKeyBuilder(task_name="tests.mail", signature=inspect.signature(lambda to, body="": None))
    box = mailbox or Mailbox()
    policy.setdefault("lease_seconds", 30.0)
    return Handler(ledger, builder, Policy(**policy), box), box


def delivery(key: str, body: str = "first", **kw: Any) -> Delivery:
    kw.setdefault("max_retries", 3)
    return Delivery(key=key, task_name="tests.mail", payload=Payload([], {"to": "ann@example.com", "body": body}),
                    attempt_id="task-1", **kw)


def next_of(d: Delivery, step: Step, **kw: Any) -> Delivery:
    """The next delivery of a chain, as the adapter would make it from ``step.carry``."""
    carry = step.carry
    return delivery(d.key, d.payload.kwargs["body"], inflight=carry.inflight or 0,
                    outage=carry.outage or 0, resume_owners=carry.owners,
                    verdict=carry.verdict, **kw)


def test_first_delivery_sends_and_duplicates_replay_it(ledger: Ledger) -> None:
    handler, box = build(ledger)
    first = handler.handle(delivery("h1"))
    assert (first.outcome, first.action) == (Outcome.SENT, Action.RETURN)
    assert first.value["status"] == "sent" and first.value["message_id"] == "m-1"
    again = handler.handle(delivery("h1", "rewritten"))
    assert (again.outcome, again.action) == (Outcome.DUPLICATE, Action.RETURN)
    assert again.value["message_id"] == "m-1" and box.sent == [("h1", "first")]


def test_every_duplicate_replays_the_sent_result_field_by_field(ledger: Ledger) -> None:
    """The time included: the sent result carries the time as the ledger keeps it (Redis: milliseconds
    in an archived record), not the worker's clock to the microsecond, which no replay could repeat."""
    handler, _ = build(ledger)
    first = handler.handle(delivery("h-same")).value
    assert first["status"] == "sent" and first["sent_at"] is not None
    for body in ("first", "rewritten"):
        again = handler.handle(delivery("h-same", body)).value
        assert {**again, "status": "sent"} == first
    record = ledger.get("h-same")
    assert record is not None and first["sent_at"] == dt.datetime.fromtimestamp(record.updated_at, dt.timezone.utc
                                                                               ).isoformat()


def test_transient_failure_releases_and_the_retry_sends_the_first_payload(ledger: Ledger) -> None:
    handler, box = build(ledger)
    box.fail_with = TransientSendError("connect refused", reason="connect")
    step = handler.handle(delivery("h2"))
    assert (step.outcome, step.action) == (Outcome.RETRY, Action.RETRY) and step.countdown > 0
    record = ledger.get("h2")
    assert record is not None and record.state is State.RELEASED
    box.fail_with = None
    done = handler.handle(delivery("h2", "regenerated", retries=1, resume_owners=step.carry.owners))
    assert done.outcome is Outcome.SENT and box.sent == [("h2", "first")]


def test_transient_failures_past_the_budget_end_failed(ledger: Ledger) -> None:
    handler, box = build(ledger)
    box.fail_with = TransientSendError("still down", reason="connect")
    step = handler.handle(delivery("h3", retries=3, max_retries=3))
    assert (step.outcome, step.action) == (Outcome.FAILED, Action.RAISE)
    assert isinstance(step.error, PermanentSendError) and step.error.reason == "retries_exhausted"
    record = ledger.get("h3")
    assert record is not None and record.state is State.FAILED


def test_transient_failures_retry_until_the_deadline_whatever_max_retries(ledger: Ledger) -> None:
    handler, box = build(ledger, retry_deadline_seconds=3600.0, retry_backoff=2.0, retry_backoff_max=300.0)
    box.fail_with = TransientSendError("connection refused", reason="connect")
    step = handler.handle(delivery("h3d", retries=12, max_retries=3, retry_from=time.time() - 60))
    assert (step.outcome, step.action, step.counted) == (Outcome.RETRY, Action.RETRY, False)
    assert 150.0 <= step.countdown <= 300.0  # the backoff's cap, not Celery's count, paces it
    record = ledger.get("h3d")
    assert record is not None and record.state is State.RELEASED


def test_the_last_retry_comes_at_the_deadline_and_then_the_intent_fails_naming_it(ledger: Ledger) -> None:
    handler, box = build(ledger, retry_deadline_seconds=100.0, retry_backoff=60.0, retry_backoff_max=300.0)
    box.fail_with = TransientSendError("connection refused", reason="connect")
    began = time.time() - 98.0
    step = handler.handle(delivery("h3e", retries=5, retry_from=began))
    assert step.action is Action.RETRY and 0.0 < step.countdown <= 2.0
    step = handler.handle(delivery("h3e", retries=6, retry_from=began - 5.0,
                                   resume_owners=step.carry.owners))
    assert (step.outcome, step.action) == (Outcome.FAILED, Action.RAISE)
    assert isinstance(step.error, PermanentSendError) and step.error.reason == "retry_deadline"
    assert "retry deadline" in str(step.error) and "connection refused" in str(step.error)
    record = ledger.get("h3e")
    assert record is not None and record.state is State.FAILED and record.error["reason"] == "retry_deadline"
    assert box.sent == [] and (Outcome.FAILED, {"reason": "retry_deadline"}) in box.reports


def test_an_undated_delivery_carries_when_its_deadline_began(ledger: Ledger) -> None:
    handler, box = build(ledger)
    box.fail_with = TransientSendError("connection refused", reason="connect")
    began = time.time() - 5.0
    undated = handler.handle(delivery("h3f", retry_from=began))
    assert f"{undated.carry.enqueued_at:.3f}" == f"{began:.3f}"  # its next delivery is dated: the deadline stays put
    dated = handler.handle(delivery("h3g", retry_from=began, enqueued_at=began))
    assert dated.carry.enqueued_at is None


def test_a_send_that_may_have_happened_is_never_retried_on_the_deadline(ledger: Ledger) -> None:
    handler, box = build(ledger)
    box.fail_with = AmbiguousSendError("read timeout", reason="timeout")
    step = handler.handle(delivery("h3h", retry_from=time.time()))
    assert step.outcome is Outcome.REVIEW and ledger.get("h3h").state is State.REVIEW  # type: ignore[union-attr]
    keyed, keyed_box = build(ledger, Mailbox(carries_key=True))
    keyed_box.fail_with = AmbiguousSendError("read timeout", reason="timeout")
    again = keyed.handle(delivery("h3i", retry_from=time.time()))
    assert (again.action, again.counted) == (Action.RETRY, True)  # with the key downstream: on the count, as before
    spent = keyed.handle(delivery("h3i", retries=3, max_retries=3, retry_from=time.time(),
                                  resume_owners=again.carry.owners))
    assert spent.outcome is Outcome.REVIEW and isinstance(spent.error, SendNeedsReview)


def test_permanent_failure_is_recorded_and_replayed(ledger: Ledger) -> None:
    handler, box = build(ledger)
    box.fail_with = PermanentSendError("mailbox unavailable", reason="rejected")
    step = handler.handle(delivery("h4"))
    assert (step.outcome, step.action) == (Outcome.FAILED, Action.RAISE)
    box.fail_with = None
    dup = handler.handle(delivery("h4"))
    assert dup.outcome is Outcome.DUPLICATE and isinstance(dup.error, PermanentSendError)
    assert dup.error.reason == "rejected" and box.sent == []


@pytest.mark.parametrize("carries_key", [False, True])
def test_a_maybe_sent_failure_is_parked_unless_the_key_travels(ledger: Ledger, carries_key: bool) -> None:
    handler, box = build(ledger, Mailbox(carries_key=carries_key))
    box.fail_with = AmbiguousSendError("read timeout", reason="timeout")
    step = handler.handle(delivery("h5"))
    record = ledger.get("h5")
    assert record is not None
    if carries_key:
        assert step.action is Action.RETRY and record.state is State.RELEASED
    else:
        assert (step.outcome, step.action) == (Outcome.REVIEW, Action.RAISE) and record.state is State.REVIEW
        assert isinstance(step.error, SendNeedsReview)


def test_a_maybe_sent_failure_the_provider_confirms_is_recorded_sent(ledger: Ledger) -> None:
    handler, box = build(ledger)
    box.fail_with = AmbiguousSendError("read timeout", reason="timeout")
    box.found = {"message_id": "m-found"}
    step = handler.handle(delivery("h6"))
    assert step.outcome is Outcome.SENT and step.value["message_id"] == "m-found"
    record = ledger.get("h6")
    assert record is not None and record.state is State.SENT


def test_invalid_input_ends_failed_and_stores_nothing(ledger: Ledger) -> None:
    handler, box = build(ledger)
    box.invalid = InvalidEmail("header injection in subject", field="subject")
    step = handler.handle(delivery("h7"))
    assert (step.outcome, step.action) == (Outcome.FAILED, Action.RAISE)
    assert isinstance(step.error, PermanentSendError) and step.error.reason == "invalid_email"
    assert ledger.get("h7") is None and box.sent == []


def test_a_side_effect_that_cannot_be_set_up_waits_on_the_outage_budget_unclaimed(ledger: Ledger) -> None:
    handler, box = build(ledger, outage_max_retries=2)
    box.invalid = ConfigurationError("no API key")
    step = handler.handle(delivery("h8"))
    assert (step.outcome, step.action) == (Outcome.SETUP_ERROR, Action.RESCHEDULE)
    assert step.carry.outage == 1 and ledger.get("h8") is None
    last = handler.handle(delivery("h8", outage=2))
    assert (last.outcome, last.action) == (Outcome.LEDGER_GAVE_UP, Action.RAISE)
    assert isinstance(last.error, ConfigurationError) and ledger.get("h8") is None


class NoDriver(LedgerWrapper):
    """A ledger whose driver is not installed: its first use imports it, and fails."""

    def claim(self, request: ClaimRequest) -> Any:
        raise ModuleNotFoundError("No module named 'psycopg'", name="psycopg")


@pytest.mark.parametrize("where", ["check", "claim"])
def test_an_unexpected_error_before_the_claim_waits_on_the_outage_budget_and_says_the_fix(
    ledger: Ledger, where: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Case 4 of issue 23: a missing driver (or a broken import, a bug) before the claim used to end the
    # message FAILURE, acknowledged and gone. Nothing was sent: it waits, and one ERROR says what to do.
    handler, box = build(NoDriver(ledger) if where == "claim" else ledger, outage_max_retries=5)
    if where == "check":
        box.invalid = ModuleNotFoundError("No module named 'psycopg'", name="psycopg")
    monkeypatch.setattr("idemmail_celery.diagnostics._said_setup", set())  # one ERROR per process: this one's
    caplog.set_level("ERROR", logger="idemmail_celery")
    steps = [handler.handle(delivery(f"h-setup-{where}", outage=n)) for n in range(2)]
    assert [(s.outcome, s.action) for s in steps] == [(Outcome.SETUP_ERROR, Action.RESCHEDULE)] * 2
    assert steps[1].carry.outage == 2 and box.sent == [] and ledger.get(f"h-setup-{where}") is None
    fixes = [r for r in caplog.records if "pip install 'idemmail-celery[postgres]'" in r.getMessage()]
    assert len(fixes) == 1 and fixes[0].levelname == "ERROR"  # once, not per delivery


def test_a_live_claim_reschedules_within_the_holders_lease_and_gives_up_on_budget(ledger: Ledger) -> None:
    handler, box = build(ledger, inflight_backoff=50.0, inflight_backoff_max=60.0, inflight_max_retries=2)
    ledger.claim(ClaimRequest(key="h9", task_name="tests.mail", payload='{"args":[],"kwargs":{}}', fingerprint="",
                              owner="other:1", lease_seconds=5.0))
    step = handler.handle(delivery("h9", hop="msg-1"))
    assert (step.outcome, step.action) == (Outcome.IN_FLIGHT, Action.RESCHEDULE)
    assert step.countdown <= 5.5  # not past the holder's lease: then it can be taken over
    assert step.carry.inflight == 1
    gave_up = handler.handle(delivery("h9", inflight=2, hop="msg-3"))
    assert gave_up.outcome is Outcome.IN_FLIGHT_GAVE_UP and isinstance(gave_up.error, IdempotencyInFlightError)
    assert box.sent == []


def test_a_second_copy_of_one_reschedule_drops_once_the_first_published_it(ledger: Ledger) -> None:
    handler, _ = build(ledger)
    ledger.claim(ClaimRequest(key="h10", task_name="tests.mail", payload='{"args":[],"kwargs":{}}',
                              fingerprint="", owner="other:1", lease_seconds=30.0))
    first = handler.handle(delivery("h10", hop="published-1"))
    assert first.action is Action.RESCHEDULE and first.confirms_hop == "published-1"
    assert first.carry.hop is None  # the reschedule goes out as a new hop
    handler.published(first)  # the adapter published it
    copy = handler.handle(delivery("h10", hop="published-1"))  # the broker handed the same message out twice
    assert (copy.outcome, copy.action) == (Outcome.COPY_DROPPED, Action.DROP)
    other = handler.handle(delivery("h10", hop="published-2"))
    assert other.action is Action.RESCHEDULE


def test_a_copy_of_a_reschedule_whose_first_copy_died_before_publishing_comes_back_as_the_same_hop(
        ledger: Ledger) -> None:
    """Found by the simulator (sim/traces/hop_marked_before_a_publish_that_never_happened_strands_the_claim.json):
    a copy marked its hop and died before publishing the reschedule; the next copy of the same message found
    the hop marked and dropped, and no message carried the intent any more."""
    handler, box = build(ledger)
    held = ledger.claim(ClaimRequest(key="h10b", task_name="tests.mail", payload='{"args":[],"kwargs":{}}',
                                     fingerprint="", owner="other:1", lease_seconds=30.0))
    handler.handle(delivery("h10b", hop="published-1"))  # marked; its worker dies before the publish
    copies = [handler.handle(delivery("h10b", hop="published-1")) for _ in range(2)]
    for copy in copies:  # neither is dropped, and neither is a new hop: copies never multiply
        assert (copy.outcome, copy.action) == (Outcome.IN_FLIGHT, Action.RESCHEDULE)
        assert copy.carry.hop == "published-1" and copy.confirms_hop == ""
    # The holder finishes (or its lease runs out): the copy that came back settles the intent.
    ledger.release("h10b", held.token)
    back = handler.handle(delivery("h10b", hop="published-1", inflight=1))
    assert (back.outcome, back.action) == (Outcome.SENT, Action.RETURN) and len(box.sent) == 1


def test_a_claim_whose_reply_was_lost_is_taken_back_by_the_next_delivery(ledger: Ledger) -> None:
    refusing = Refusing(ledger)
    handler, box = build(refusing)
    refusing.down.add("claim_lost_reply")
    d = delivery("h11")
    step = handler.handle(d)
    assert (step.outcome, step.action) == (Outcome.LEDGER_UNAVAILABLE, Action.RESCHEDULE)
    record = ledger.get("h11")
    assert record is not None and record.state is State.CLAIMED  # the store ran it
    refusing.down.clear()
    done = handler.handle(next_of(d, step))
    assert done.outcome is Outcome.SENT and box.sent == [("h11", "first")]  # not "in flight", not review


@pytest.mark.parametrize("taken", ["reclaimed", "resumed"])
def test_a_message_older_than_a_ledger_loss_meets_the_loss_rule_when_the_first_claim_since_never_decided(
    ledger: Ledger, taken: str
) -> None:
    """Found by the simulator (sim/traces/loss_rule_skipped_after_a_lost_claim_reply.json): after an
    acknowledged loss, the first claim of an intent sent before it lost its reply, so its holder never
    applied the loss rule; the copy that took the claim over (or the chain that took it back) sent the
    intent again, because the rule looked at ``acquired`` claims only."""
    refusing = Refusing(ledger)
    handler, box = build(refusing, Mailbox(ahead=True), lease_seconds=0.2)
    ledger.recovered_at = time.time()
    d = delivery("h-loss", enqueued_at=ledger.recovered_at - 60)  # enqueued before the loss
    refusing.down.add("claim_lost_reply")
    step = handler.handle(d)
    assert (step.outcome, step.action) == (Outcome.LEDGER_UNAVAILABLE, Action.RESCHEDULE)
    refusing.down.clear()
    if taken == "reclaimed":  # another copy of the message, after the claim's lease ran out
        time.sleep(0.35)
        again = handler.handle(delivery("h-loss", enqueued_at=d.enqueued_at))
    else:
        again = handler.handle(next_of(d, step, enqueued_at=d.enqueued_at))
    assert again.outcome is Outcome.REVIEW and box.sent == []
    record = ledger.get("h-loss")
    assert record is not None and record.state is State.REVIEW and record.error["reason"] == "ledger_lost"


def test_a_chain_takes_back_its_older_owners_expired_claim_and_does_not_park_it(ledger: Ledger) -> None:
    """Found by the simulator (sim/traces/older_owner_claim_expired_parked.json): a delivery marked,
    sent nothing (a transient error) and could not release; its retry met the ledger down at the claim,
    so the next delivery carried two owners. By then the first owner's lease had run out: the ledger
    reclaimed it rather than resuming it (it resumes the newest owner only), and the chain's own mark,
    void on a resumed claim, parked the intent for review although nothing had been sent."""
    refusing = Refusing(ledger)
    handler, box = build(refusing, Mailbox(ahead=True), lease_seconds=0.2)
    box.fail_with = TransientSendError("connect refused", reason="connect")
    refusing.down.add("released")
    d = delivery("h-own")
    first = handler.handle(d)
    assert first.action is Action.RETRY and ledger.get("h-own").mark is not None  # type: ignore[arg-type]
    box.fail_with = None
    refusing.down = {"claim"}
    time.sleep(0.35)  # the first owner's lease runs out
    second = handler.handle(next_of(d, first))
    assert second.action is Action.RESCHEDULE and len(second.carry.owners) == 2
    refusing.down.clear()
    third = handler.handle(next_of(d, second))
    assert third.outcome is Outcome.SENT and box.sent == [("h-own", "first")]
    record = ledger.get("h-own")
    assert record is not None and record.state is State.SENT


def test_a_release_that_failed_is_taken_back_by_the_retry(ledger: Ledger) -> None:
    refusing = Refusing(ledger)
    handler, box = build(refusing)
    refusing.down.add("released")
    box.fail_with = TransientSendError("connect refused", reason="connect")
    d = delivery("h12")
    step = handler.handle(d)
    assert step.action is Action.RETRY
    record = ledger.get("h12")
    assert record is not None and record.state is State.CLAIMED  # still held: the release did not land
    refusing.down.clear()
    box.fail_with = None
    done = handler.handle(next_of(d, step, retries=1))
    assert done.outcome is Outcome.SENT and box.sent == [("h12", "first")]


@pytest.mark.parametrize("carries_key", [False, True])
def test_a_retry_whose_release_failed_and_whose_claim_met_the_outage_takes_its_claim_back(
    ledger: Ledger, carries_key: bool
) -> None:
    # Case 1 of issue 23: the release meets a blip, and so does the retry's claim. The delivery after
    # must take back the claim its chain holds (not find it busy, wait out its lease, and then be
    # parked as lease_expired or resent although it never ran).
    refusing = Refusing(ledger)
    handler, box = build(refusing, Mailbox(carries_key=carries_key), inflight_max_retries=2)
    refusing.down.add("released")
    box.fail_with = TransientSendError("connect refused", reason="connect")
    d = delivery("h-rel-out")
    step = handler.handle(d)
    assert step.action is Action.RETRY
    refusing.down = {"claim"}
    box.fail_with = None
    retry = next_of(d, step, retries=1)
    second = handler.handle(retry)
    assert (second.outcome, second.action) == (Outcome.LEDGER_UNAVAILABLE, Action.RESCHEDULE)
    refusing.down = set()
    third = handler.handle(next_of(retry, second, retries=1))
    assert third.outcome is Outcome.SENT and box.sent == [("h-rel-out", "first")]
    record = ledger.get("h-rel-out")
    assert record is not None and record.state is State.SENT and record.reclaims == 0


@pytest.mark.parametrize("second_outage", ["claim", "claim_lost_reply"])
def test_a_lost_claim_reply_then_an_outage_at_the_next_claim_keeps_the_claim_in_the_chain(
    ledger: Ledger, second_outage: str
) -> None:
    # The first claim lands with its reply lost; the next delivery's claim meets the ledger down (or
    # lands too, its reply lost again). Whichever owner holds the claim, the chain takes it back.
    refusing = Refusing(ledger)
    handler, box = build(refusing, inflight_max_retries=1)
    refusing.down = {"claim_lost_reply"}
    d = delivery("h-lost-out")
    first = handler.handle(d)
    assert first.outcome is Outcome.LEDGER_UNAVAILABLE
    refusing.down = {second_outage}
    second_delivery = next_of(d, first)
    second = handler.handle(second_delivery)
    assert second.outcome is Outcome.LEDGER_UNAVAILABLE
    refusing.down = set()
    third = handler.handle(next_of(second_delivery, second))
    assert third.outcome is Outcome.SENT and box.sent == [("h-lost-out", "first")]
    record = ledger.get("h-lost-out")
    assert record is not None and record.state is State.SENT and record.reclaims == 0


def test_a_delivery_that_cannot_set_up_its_side_effect_hands_on_the_owner_holding_the_claim(ledger: Ledger) -> None:
    # A retry whose release failed lands on a worker without the provider's API key: it waits, and
    # the chain still holds its claim when the key is back.
    refusing = Refusing(ledger)
    handler, box = build(refusing, inflight_max_retries=1)
    refusing.down.add("released")
    box.fail_with = TransientSendError("connect refused", reason="connect")
    d = delivery("h-conf-owner")
    step = handler.handle(d)
    refusing.down = set()
    box.fail_with = None
    box.invalid = ConfigurationError("no API key")
    retry = next_of(d, step, retries=1)
    waiting = handler.handle(retry)
    assert waiting.action is Action.RESCHEDULE and waiting.carry.owners
    box.invalid = None
    done = handler.handle(next_of(retry, waiting, retries=1))
    assert done.outcome is Outcome.SENT and box.sent == [("h-conf-owner", "first")]


@pytest.mark.parametrize("state", ["review", "failed"])
def test_a_verdict_the_ledger_refused_is_recorded_by_the_next_delivery_without_running(
    ledger: Ledger, state: str
) -> None:
    refusing = Refusing(ledger)
    handler, box = build(refusing)
    refusing.down.add(state)
    box.fail_with = (AmbiguousSendError("read timeout", reason="timeout") if state == "review"
                     else PermanentSendError("rejected", reason="rejected"))
    d = delivery("h13")
    step = handler.handle(d)
    assert (step.outcome, step.action) == (Outcome.LEDGER_UNAVAILABLE, Action.RESCHEDULE)
    assert step.carry.verdict.state == state
    refusing.down.clear()
    box.fail_with = None
    settled = handler.handle(next_of(d, step))
    assert settled.action is Action.RAISE and box.sent == []
    record = ledger.get("h13")
    assert record is not None and record.state.value == state


def sent_not_recorded(ledger: Ledger, key: str,
                      monkeypatch: pytest.MonkeyPatch) -> tuple[Refusing, Handler, Mailbox, Delivery, Step]:
    """A first delivery of ``key`` that sends and cannot record it (the store refuses ``sent``)."""
    monkeypatch.setattr("idemmail_celery.handler.time.sleep", lambda s: None)
    refusing = Refusing(ledger)
    handler, box = build(refusing)
    refusing.down.add("sent")
    d = delivery(key)
    first = handler.handle(d)
    assert first.carry.verdict.state == "sent" and len(box.sent) == 1
    return refusing, handler, box, d, first


def test_a_sent_verdict_is_recorded_over_the_review_a_stale_copy_parked_it_in(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sent, not recorded; the ledger stays away past the lease, and a copy of the message from before the
    # verdict (redelivered: its worker was killed after publishing the retry) takes the claim over as a crash
    # and parks it (no key downstream). The delivery with the verdict knows it went out: recorded sent, not
    # left for an operator, and nothing sent again.
    refusing = Refusing(ledger)
    handler, box = build(refusing, lease_seconds=0.3)
    refusing.down.add("sent")
    d = delivery("h-stale")
    with monkeypatch.context() as m:
        m.setattr("idemmail_celery.handler.time.sleep", lambda s: None)  # its tries to record, at once
        first = handler.handle(d)
    assert first.carry.verdict.state == "sent"
    refusing.down = set()
    held = ledger.get("h-stale")
    assert held is not None and held.lease_expires_at is not None
    time.sleep(max(0.0, held.lease_expires_at - time.time()) + 0.05)  # the lease runs out, nobody renewing it
    stale = handler.handle(delivery("h-stale"))
    assert stale.outcome is Outcome.REVIEW and ledger.get("h-stale").state is State.REVIEW  # type: ignore[union-attr]
    step = handler.handle(next_of(d, first))
    assert (step.outcome, step.action) == (Outcome.SENT, Action.RETURN) and len(box.sent) == 1
    record = ledger.get("h-stale")
    assert record is not None and record.state is State.SENT
    assert record.result["message_id"] == first.carry.verdict.result["message_id"]  # type: ignore[union-attr,index]
    # A copy after that replays the send.
    assert handler.handle(delivery("h-stale")).outcome is Outcome.DUPLICATE and len(box.sent) == 1


@pytest.mark.parametrize("outage", ["claim", "claim_lost_reply"])
def test_a_verdict_survives_a_second_outage_at_the_next_claim(
    ledger: Ledger, outage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sent, not recorded (the store went away); the next delivery's claim meets the store away again
    # (refused, or run with its reply lost). The one after must still record the send, not find the
    # claim busy until its lease runs out and decide it again.
    refusing, handler, box, d, first = sent_not_recorded(ledger, "h-twice", monkeypatch)
    refusing.down = {outage}
    second_delivery = next_of(d, first)
    second = handler.handle(second_delivery)
    assert (second.outcome, second.action) == (Outcome.LEDGER_UNAVAILABLE, Action.RESCHEDULE)
    assert second.carry.verdict == first.carry.verdict
    refusing.down = set()
    third = handler.handle(next_of(second_delivery, second))
    assert third.outcome is Outcome.SENT and len(box.sent) == 1
    record = ledger.get("h-twice")
    assert record is not None and record.state is State.SENT


def test_a_verdict_is_recorded_by_a_worker_that_could_not_send(ledger: Ledger,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The next delivery lands on a worker whose provider cannot be built (no API key): it has nothing
    # to send, only the verdict to record.
    from idemmail_celery.errors import ConfigurationError

    refusing, handler, box, d, first = sent_not_recorded(ledger, "h-noconf", monkeypatch)
    refusing.down = set()

    def no_provider(payload: Payload) -> None:
        raise ConfigurationError("set idemmail_provider_api_key")

    monkeypatch.setattr(box, "check", no_provider)
    second = handler.handle(next_of(d, first))
    assert second.outcome is Outcome.SENT and len(box.sent) == 1
    record = ledger.get("h-noconf")
    assert record is not None and record.state is State.SENT


def test_a_send_the_ledger_could_not_record_is_recorded_by_the_next_delivery_once(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing = Refusing(ledger)
    handler, box = build(refusing)
    refusing.down.add("sent")
    monkeypatch.setattr("idemmail_celery.handler.time.sleep", lambda s: None)
    d = delivery("h14")
    step = handler.handle(d)
    assert (step.outcome, step.action) == (Outcome.LEDGER_UNAVAILABLE, Action.RESCHEDULE)
    assert step.carry.verdict.state == "sent" and len(box.sent) == 1
    # Meanwhile a duplicate finds the claim held: it waits, it does not send.
    assert handler.handle(delivery("h14", hop="dup-1")).outcome is Outcome.IN_FLIGHT
    refusing.down.clear()
    done = handler.handle(next_of(d, step))
    assert done.outcome is Outcome.SENT and done.value["message_id"] == "m-1"
    record = ledger.get("h14")
    assert record is not None and record.state is State.SENT and len(box.sent) == 1


@pytest.mark.parametrize("carries_key", [False, True])
def test_a_dead_holders_claim_is_resent_with_the_key_or_parked(ledger: Ledger, carries_key: bool) -> None:
    handler, box = build(ledger, Mailbox(carries_key=carries_key))
    ledger.claim(ClaimRequest(key="h15", task_name="tests.mail", payload=delivery("h15").payload.to_json(),
                              fingerprint="", owner="dead:1", lease_seconds=0.2))
    time.sleep(0.35)
    step = handler.handle(delivery("h15"))
    record = ledger.get("h15")
    assert record is not None
    if carries_key:
        assert step.outcome is Outcome.SENT and len(box.sent) == 1 and record.state is State.SENT
    else:
        assert step.outcome is Outcome.REVIEW and box.sent == [] and record.state is State.REVIEW
        assert record.error is not None and record.error["reason"] == "lease_expired"


def test_a_body_that_hands_back_control_releases_its_claim(ledger: Ledger) -> None:
    class Handback(Exception):
        pass

    builder = IntentKeyBuilder(task_name="tests.mail", signature=inspect.signature(lambda to, body="": None))
    box = Mailbox()
    handler = Handler(ledger, builder, Policy(), box, passthrough=(Handback,))
    box.fail_with = Handback()
    step = handler.handle(delivery("h16"))
    assert (step.outcome, step.action) == (Outcome.RETRY, Action.RAISE) and isinstance(step.error, Handback)
    record = ledger.get("h16")
    assert record is not None and record.state is State.RELEASED


def test_an_intent_recorded_under_an_older_secret_is_found_during_a_rotation(ledger: Ledger) -> None:
    handler, box = build(ledger)
    first = handler.handle(delivery("old-key"))  # sent before the rotation, under the old secret's key
    assert first.outcome is Outcome.SENT
    again = handler.handle(delivery("new-key", older_keys=("older-still", "old-key")))
    assert again.outcome is Outcome.DUPLICATE and again.key == "old-key" and len(box.sent) == 1
    fresh = handler.handle(delivery("new-key-2", older_keys=("never-used",)))
    assert fresh.outcome is Outcome.SENT and fresh.key == "new-key-2"
    assert ledger.get("never-used") is None


def test_a_carried_verdict_is_recorded_whatever_the_claim_finds_and_nothing_runs_again(ledger: Ledger) -> None:
    handler, box = build(ledger)
    sent = {"state": "sent", "result": {"value": {"message_id": "m-earlier"}, "message_id": "m-earlier"}}
    # The record went away meanwhile (an operator released it, or it was purged): still not sent again.
    step = handler.handle(delivery("h17", resume_owners=("gone:1",), verdict=Verdict.from_header(sent)))
    assert step.outcome is Outcome.SENT and box.sent == []
    record = ledger.get("h17")
    assert record is not None and record.state is State.SENT and record.result["message_id"] == "m-earlier"  # type: ignore[index]


class UnreadableOldKeys(LedgerWrapper):
    """A real ledger whose reads of ``old`` fail (the store blinked, or another node of a cluster is down)."""

    def __init__(self, inner: Ledger, old: str) -> None:
        super().__init__(inner)
        self.old = old

    def get(self, key: str) -> Any:
        if key == self.old:
            raise LedgerUnavailableError("connection reset")
        return self.inner.get(key)


def test_a_rotation_lookup_that_fails_claims_nothing_and_sends_nothing(ledger: Ledger) -> None:
    """The intent may be recorded under the older key: claiming under the new one on a failed read
    could send it twice. The delivery waits on the outage budget instead, with nothing claimed."""
    handler, box = build(ledger)
    first = handler.handle(delivery("rot-old"))  # sent under the old secret's key
    assert first.outcome is Outcome.SENT and len(box.sent) == 1
    handler.ledger = UnreadableOldKeys(ledger, "rot-old")
    step = handler.handle(delivery("rot-new", older_keys=("rot-old",)))
    assert (step.outcome, step.action) == (Outcome.LEDGER_UNAVAILABLE, Action.RESCHEDULE)
    assert ledger.get("rot-new") is None and len(box.sent) == 1
    handler.ledger = ledger  # the store answers again: the older key's record is replayed
    again = handler.handle(delivery("rot-new", older_keys=("rot-old",)))
    assert again.outcome is Outcome.DUPLICATE and len(box.sent) == 1


def dead_holder(ledger: Ledger, key: str, *, ahead: bool, marked: bool) -> None:
    """A holder that claimed ``key`` (promising write-ahead marks or not), maybe marked it, and died."""
    c = ledger.claim(ClaimRequest(key=key, task_name="tests.mail", payload=delivery(key).payload.to_json(),
                                  fingerprint="", owner=new_owner("dead"), writes_ahead=ahead, lease_seconds=0.2))
    if marked:
        assert ledger.write_ahead(key, c.token, 0.2, "message") is True
    time.sleep(0.35)


def test_a_dead_holder_that_had_not_reached_its_write_ahead_mark_is_sent_by_the_next_claimer(ledger: Ledger) -> None:
    handler, box = build(ledger, Mailbox(ahead=True))
    dead_holder(ledger, "wa-h1", ahead=True, marked=False)
    step = handler.handle(delivery("wa-h1"))
    assert step.outcome is Outcome.SENT and box.sent == [("wa-h1", "first")]
    record = ledger.get("wa-h1")
    assert record is not None and record.state is State.SENT and record.reclaims == 1


@pytest.mark.parametrize("promised", [True, False], ids=["marked", "holder-made-no-promise"])
def test_a_dead_holder_that_may_have_sent_is_parked_with_the_stage_it_reached(ledger: Ledger, promised: bool) -> None:
    handler, box = build(ledger, Mailbox(ahead=True))
    # Marked: it began the send. No promise (a worker of an earlier release): no mark proves nothing.
    dead_holder(ledger, "wa-h2", ahead=promised, marked=promised)
    step = handler.handle(delivery("wa-h2"))
    record = ledger.get("wa-h2")
    assert step.outcome is Outcome.REVIEW and box.sent == []
    assert record is not None and record.state is State.REVIEW and record.error is not None
    assert record.error["reason"] == "lease_expired"
    assert record.error.get("stage") == ("message" if promised else "unknown")


def test_each_send_is_marked_in_the_ledger_before_it_happens(ledger: Ledger) -> None:
    seen: list[Any] = []

    class Watching(Mailbox):
        def perform(self, payload: Payload, key: str) -> Any:
            before = ledger.get(key).mark  # type: ignore[union-attr]
            out = super().perform(payload, key)
            seen.extend([before, ledger.get(key).mark])  # type: ignore[arg-type]
            return out

    handler, _box = build(ledger, Watching(ahead=True))
    assert handler.handle(delivery("wa-h3")).outcome is Outcome.SENT
    assert seen[0] is None and seen[1] is not None and seen[1].stage == "message"
    record = ledger.get("wa-h3")
    assert record is not None and record.state is State.SENT and record.error is None  # sent replaces nothing


def test_a_send_whose_write_ahead_mark_fails_sends_nothing_and_retries(ledger: Ledger) -> None:
    refusing = Refusing(ledger)
    refusing.down.add("write_ahead")  # the store went away at that moment
    handler, box = build(refusing, Mailbox(ahead=True))
    d = delivery("wa-h4")
    step = handler.handle(d)
    assert step.action is Action.RETRY and box.sent == []
    assert isinstance(step.error, TransientSendError) and step.error.reason == "ahead_unrecorded"
    record = ledger.get("wa-h4")
    assert record is not None and record.state is State.RELEASED  # nothing went out: the next try sends
    handler2, box2 = build(ledger, Mailbox(ahead=True))
    assert handler2.handle(next_of(d, step, retries=1)).outcome is Outcome.SENT and len(box2.sent) == 1


def test_a_delivery_of_the_chain_that_marked_and_died_is_not_sent_again_by_its_redelivered_copy(
        ledger: Ledger) -> None:
    refusing = Refusing(ledger)
    handler, box = build(refusing, Mailbox(ahead=True), lease_seconds=0.3)
    d = delivery("wa-h5")
    refusing.down.add("claim_lost_reply")  # the first claim lands, its reply does not: the chain holds it
    step = handler.handle(d)
    assert step.action is Action.RESCHEDULE
    refusing.down.clear()

    class Killed(BaseException):  # the worker dies mid-send: nothing the handler could catch
        pass

    class DiesAfterTheMark(Mailbox):
        def perform(self, payload: Payload, key: str) -> Any:
            about_to_send("message")
            raise Killed

    handler.effect = DiesAfterTheMark(ahead=True)
    resumed = next_of(d, step)
    with pytest.raises(Killed):  # the next delivery takes the claim back, marks it, and dies
        handler.handle(resumed)
    time.sleep(0.45)
    handler.effect = box
    done = handler.handle(resumed)  # the same message handed out again, its lease run out
    assert done.outcome is Outcome.REVIEW and box.sent == []
    parked = ledger.get("wa-h5")
    assert parked is not None and parked.error is not None and parked.error.get("stage") == "message"


class MarkFails(Refusing):
    """The first write-ahead mark fails, and so does the release that follows; ``lands``: the mark is
    written all the same, only its reply is lost."""

    def __init__(self, inner: Ledger, *, lands: bool) -> None:
        super().__init__(inner)
        self.lands, self.failed = lands, False

    def write_ahead(self, key: str, token: int, lease_seconds: float, stage: str, *, owner: str = "") -> bool:
        if self.failed:
            return self.inner.write_ahead(key, token, lease_seconds, stage, owner=owner)
        self.failed = True
        if self.lands:
            self.inner.write_ahead(key, token, lease_seconds, stage, owner=owner)
        self.down.add("released")
        raise LedgerUnavailableError("store went away (write_ahead)")


@pytest.mark.parametrize("how", ["transient-after-mark", "mark-reply-lost"])
def test_a_chains_own_mark_from_an_attempt_that_sent_nothing_does_not_park_it(ledger: Ledger, how: str) -> None:
    # The attempt marked the ledger, then knew it sent nothing (a 4xx to the message, a mark whose reply
    # was lost), and its release met the store down: the next delivery resumes a claim carrying that mark.
    # Before: parked lease_expired, never sent (13 of 1,666 in one chaos run).
    store: Refusing = MarkFails(ledger, lands=True) if how == "mark-reply-lost" else Refusing(ledger)
    handler, box = build(store, Mailbox(ahead=True))
    if how == "transient-after-mark":
        store.down.add("released")
        box.fail_with = TransientSendError("451 try again later", reason="tempfail")
    d = delivery("wa-h6")
    step = handler.handle(d)
    assert step.action is Action.RETRY and box.sent == []
    held = ledger.get("wa-h6")
    assert held is not None and held.state is State.CLAIMED and held.mark is not None
    store.down.clear()
    box.fail_with = None
    done = handler.handle(next_of(d, step, retries=1))
    assert done.outcome is Outcome.SENT and box.sent == [("wa-h6", "first")]


class Lockstep(LedgerWrapper):
    """A real ledger on which another worker's delivery of the same intent moves in lockstep with this one:
    right after each read of ``key`` comes back, the next of ``then`` runs (the other worker's steps)."""

    def __init__(self, inner: Ledger, key: str, *then: Any) -> None:
        super().__init__(inner)
        self.key, self.then = key, list(then)

    def get(self, key: str) -> Any:
        record = self.inner.get(key)
        if key == self.key and self.then:
            self.then.pop(0)()
        return record


def rotating(old: str, new: str) -> tuple[Delivery, Delivery]:
    """One intent's delivery on a worker still on secrets [old, new] (it claims under the old key and looks
    up the new one), and on a worker already on [new, old] (the other way round): phase 2 of a rotation,
    half-way through its rolling restart (see docs/security.md)."""
    return delivery(old, older_keys=(new,)), delivery(new, older_keys=(old,))


def test_a_rotation_race_between_workers_of_both_phases_sends_once(ledger: Ledger) -> None:
    """The other worker looks up, claims and sends between this one's look-up and its claim: both
    look-ups found nothing. Before the re-read after the claim, both sent (campaign-blips-rotate)."""
    on_old, on_new = rotating("rr1-old", "rr1-new")
    box = Mailbox()
    other, _ = build(ledger, box)
    theirs: list[Step] = []
    handler, _ = build(Lockstep(ledger, "rr1-new", lambda: theirs.append(other.handle(on_new))), box)
    step = handler.handle(on_old)
    assert [s.outcome for s in theirs] == [Outcome.SENT] and theirs[0].key == "rr1-new"
    assert (step.outcome, step.action) == (Outcome.IN_FLIGHT, Action.RESCHEDULE) and not step.carry.owners
    assert box.sent == [("rr1-new", "first")]
    assert ledger.get("rr1-old") is None  # withdrawn: the claim that never ran left no trace
    again = handler.handle(next_of(on_old, step, older_keys=("rr1-new",)))  # its look-up now follows the record
    assert (again.outcome, again.key) == (Outcome.DUPLICATE, "rr1-new") and again.value["message_id"] == "m-1"
    assert len(box.sent) == 1


def test_a_rotation_race_where_both_claims_see_each_other_withdraws_both_and_the_next_sends_once(
        ledger: Ledger) -> None:
    """Lockstep: both look up (nothing), both claim, both re-read and see the other's claim. Neither runs;
    both withdraw and are rescheduled; the next deliveries send it once and replay it once."""
    on_old, on_new = rotating("rr2-old", "rr2-new")
    box = Mailbox()
    other, _ = build(ledger, box)
    theirs: dict[str, Any] = {}

    def their_lookup_and_claim() -> None:  # after this one's look-up, before its claim
        theirs["d"] = d = other.recorded_key(on_new)
        theirs["claim"] = ledger.claim(other.request(d, new_owner("task-2")))

    def their_reread() -> None:  # after this one's claim and re-read: the other re-reads too
        theirs["step"] = other.settle(theirs["d"], theirs["claim"])

    handler, _ = build(Lockstep(ledger, "rr2-new", their_lookup_and_claim, their_reread), box)
    step = handler.handle(on_old)
    assert theirs["claim"].status.value == "acquired"
    assert (step.outcome, step.action) == (Outcome.IN_FLIGHT, Action.RESCHEDULE)
    assert (theirs["step"].outcome, theirs["step"].action) == (Outcome.IN_FLIGHT, Action.RESCHEDULE)
    assert box.sent == [] and ledger.get("rr2-old") is None and ledger.get("rr2-new") is None
    mine = handler.handle(next_of(on_old, step, older_keys=("rr2-new",)))
    later = other.handle(next_of(on_new, theirs["step"], older_keys=("rr2-old",)))
    assert (mine.outcome, mine.key) == (Outcome.SENT, "rr2-old")
    assert (later.outcome, later.key) == (Outcome.DUPLICATE, "rr2-old") and box.sent == [("rr2-old", "first")]


class RereadFails(LedgerWrapper):
    """A real ledger whose reads of ``key`` fail after the first (the look-up answers, the re-read does not),
    and whose withdrawals fail too while ``down`` says so (the whole store went away)."""

    def __init__(self, inner: Ledger, key: str, *, down: bool) -> None:
        super().__init__(inner)
        self.key, self.down, self.reads = key, down, 0

    def get(self, key: str) -> Any:
        if key == self.key:
            self.reads += 1
            if self.reads > 1:
                raise LedgerUnavailableError("connection reset")
        return self.inner.get(key)

    def withdraw(self, key: str, token: int) -> bool:
        if self.down:
            raise LedgerUnavailableError("store went away (withdraw)")
        return self.inner.withdraw(key, token)


@pytest.mark.parametrize("down", [False, True], ids=["withdrawn", "store-down"])
def test_a_rotation_reread_that_fails_runs_nothing_and_leaves_no_claim_behind(ledger: Ledger, down: bool) -> None:
    """The other worker sent it under the other key between this one's look-up and claim, and this one's
    re-read fails: nothing runs. Its claim is withdrawn then or, with the store down, by the next delivery
    (whose look-up finds the other key's record): left, it would be taken over and sent again after its lease."""
    on_old, on_new = rotating("rr3-old", "rr3-new")
    box = Mailbox()
    other, _ = build(ledger, box)
    inner = Lockstep(ledger, "rr3-new", lambda: other.handle(on_new))
    handler, _ = build(RereadFails(inner, "rr3-new", down=down), box)
    step = handler.handle(on_old)
    assert (step.outcome, step.action) == (Outcome.LEDGER_UNAVAILABLE, Action.RESCHEDULE)
    assert box.sent == [("rr3-new", "first")]  # the other worker's send, and only that
    held = ledger.get("rr3-old")
    if down:  # still held, never run: the next delivery carries its owner
        assert held is not None and held.state is State.CLAIMED and step.carry.owners == (held.owner,)
    else:
        assert held is None and not step.carry.owners
    handler.ledger = ledger  # the store answers again
    again = handler.handle(next_of(on_old, step, older_keys=("rr3-new",)))
    assert (again.outcome, again.key) == (Outcome.DUPLICATE, "rr3-new") and len(box.sent) == 1
    assert ledger.get("rr3-old") is None


def test_a_rotation_claim_left_unchecked_then_taken_back_on_the_other_phase_is_checked(ledger: Ledger) -> None:
    """As above with the store down, but the next delivery runs on a worker of the other phase: its key is
    the new one, and its look-up of the old one finds the chain's own unchecked claim and takes it back,
    without looking at the new key. The check after the claim does, and withdraws it: sent once."""
    on_old, on_new = rotating("rr5-old", "rr5-new")
    box = Mailbox()
    other, _ = build(ledger, box)
    handler, _ = build(RereadFails(Lockstep(ledger, "rr5-new", lambda: other.handle(on_new)), "rr5-new", down=True),
                       box)
    step = handler.handle(on_old)
    assert step.outcome is Outcome.LEDGER_UNAVAILABLE and box.sent == [("rr5-new", "first")]
    handler.ledger = ledger
    hopped = next_of(on_new, step, older_keys=("rr5-old",))  # the chain's key, as a worker on [new, old] makes it
    again = handler.handle(hopped)
    assert (again.outcome, again.action) == (Outcome.IN_FLIGHT, Action.RESCHEDULE) and len(box.sent) == 1
    assert ledger.get("rr5-old") is None
    last = handler.handle(next_of(hopped, again, older_keys=("rr5-old",)))
    assert (last.outcome, last.key) == (Outcome.DUPLICATE, "rr5-new") and len(box.sent) == 1


@pytest.mark.parametrize("down", [False, True], ids=["withdrawn", "store-down"])
def test_a_rotation_race_with_a_failed_reread_is_checked_again_and_sends_once(ledger: Ledger, down: bool) -> None:
    """Lockstep, and this one's re-read fails: nothing runs. Then the other re-reads: it meets this one's
    claim (store down: still held) and withdraws, or it does not and sends. This one's next delivery takes its
    claim back or follows the other key's record: sent once in all."""
    on_old, on_new = rotating("rr4-old", "rr4-new")
    box = Mailbox()
    other, _ = build(ledger, box)
    theirs: dict[str, Any] = {}

    def their_lookup_and_claim() -> None:
        theirs["d"] = d = other.recorded_key(on_new)
        theirs["claim"] = ledger.claim(other.request(d, new_owner("task-2")))

    handler, _ = build(RereadFails(Lockstep(ledger, "rr4-new", their_lookup_and_claim), "rr4-new", down=down), box)
    step = handler.handle(on_old)
    assert step.outcome is Outcome.LEDGER_UNAVAILABLE and box.sent == []
    their_step = other.settle(theirs["d"], theirs["claim"])
    assert their_step.outcome is (Outcome.IN_FLIGHT if down else Outcome.SENT)
    handler.ledger = ledger
    again = handler.handle(next_of(on_old, step, older_keys=("rr4-new",)))
    later = other.handle(next_of(on_new, their_step, older_keys=("rr4-old",)))
    winner = "rr4-old" if down else "rr4-new"
    assert box.sent == [(winner, "first")]
    assert {again.outcome, later.outcome} == ({Outcome.SENT, Outcome.DUPLICATE} if down else {Outcome.DUPLICATE})
    assert again.key == later.key == winner and ledger.get("rr4-old" if not down else "rr4-new") is None


def test_a_claim_taken_over_by_the_chain_and_resumed_without_a_mark_is_sent(ledger: Ledger) -> None:
    # The chain took the claim over from a dead holder that had not begun (no mark), then could not
    # mark (the store blinked) nor release: its next delivery resumes a claim with one reclaim and no
    # mark. Before: parked lease_expired, never sent (the chaos run's case).
    store = MarkFails(ledger, lands=False)
    handler, box = build(store, Mailbox(ahead=True))
    dead_holder(ledger, "wa-h7", ahead=True, marked=False)
    d = delivery("wa-h7")
    step = handler.handle(d)
    assert step.action is Action.RETRY and box.sent == []
    store.down.clear()
    done = handler.handle(next_of(d, step, retries=1))
    assert done.outcome is Outcome.SENT and box.sent == [("wa-h7", "first")]
    record = ledger.get("wa-h7")
    assert record is not None and record.state is State.SENT and record.reclaims == 1


def test_the_retention_rule_counts_from_the_due_time_and_the_loss_rule_from_the_enqueue(ledger: Ledger) -> None:
    """A message enqueued long ago with a countdown that fell due just now is not older than the retention
    (it cannot have been claimed before it was due); but enqueued before an acknowledged loss, it meets the
    loss rule whenever it falls due (another copy of its intent may have been sent before the loss)."""
    handler, box = build(ledger)
    now = time.time()
    long_ago = now - ledger.retention_seconds - 3600
    fresh = handler.handle(delivery("h-due", enqueued_at=long_ago, due_at=now - 1))
    assert fresh.outcome is Outcome.SENT and len(box.sent) == 1
    ledger.recovered_at = now - 60
    lost = handler.handle(delivery("h-due-lost", enqueued_at=now - 120, due_at=now - 1))
    assert lost.outcome is Outcome.REVIEW and len(box.sent) == 1
    record = ledger.get("h-due-lost")
    assert record is not None and record.error is not None and record.error["reason"] == "ledger_lost"


class TakenOverMidSend(Mailbox):
    """A send that stalls past its lease: another delivery takes the claim over meanwhile (and ``then`` runs
    as it), before this one's provider answers ``fail_with``."""

    def __init__(self, then: Any) -> None:
        super().__init__()
        self.then = then

    def perform(self, payload: Payload, key: str) -> Any:
        if self.then is not None:
            then, self.then = self.then, None
            time.sleep(0.35)  # the lease runs out (its renewals stopped: a paused process)
            then()
        return super().perform(payload, key)


class Paused:
    """The lease keeper of a paused process: it renews nothing."""

    def hold(self, *_: Any) -> None:
        return None

    def drop(self, *_: Any) -> None:
        return None


@pytest.mark.parametrize("newer", ["sent", "still_held"])
def test_a_caller_whose_claim_was_taken_over_is_told_what_the_record_comes_to(
        ledger: Ledger, newer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the simulator (sim/traces/smtp_caller_told_failed_record_says_sent.json): a delivery paused past
    its lease, the provider refused it for good, and its `failed` met a claim another delivery had taken over
    and then sent: its caller was told `failed` while the record says `sent`. The newer holder's record is the
    intent's: a final one is replayed, a live one waited for as any copy waits."""
    import idemmail_celery.handler as handler_mod

    monkeypatch.setattr(handler_mod, "keeper", Paused())

    def newer_holder() -> None:
        taken = ledger.claim(ClaimRequest(key="h-over", task_name="tests.mail", payload='{"args":[],"kwargs":{}}',
                                          fingerprint="", owner="newer:1", lease_seconds=30.0))
        assert taken.status.value == "reclaimed"
        if newer == "sent":
            ledger.complete("h-over", taken.token, {"message_id": "m-newer"})

    box = TakenOverMidSend(newer_holder)
    box.fail_with = PermanentSendError("550 no such user", reason="rejected")
    handler, _ = build(ledger, box, lease_seconds=0.2)
    step = handler.handle(delivery("h-over"))
    if newer == "sent":
        assert (step.outcome, step.action) == (Outcome.DUPLICATE, Action.RETURN)
        assert step.value["message_id"] == "m-newer"
    else:
        assert (step.outcome, step.action) == (Outcome.IN_FLIGHT, Action.RESCHEDULE)
    record = ledger.get("h-over")
    assert record is not None and record.state is (State.SENT if newer == "sent" else State.CLAIMED)


def test_a_chains_own_mark_behind_a_reclaim_and_a_lost_claim_reply_is_void(ledger: Ledger) -> None:
    """Found by the simulator (sim/traces/smtp_parks_unsent_intent_lease_expired.json): a delivery took over a
    dead holder's unmarked claim, marked, sent nothing (a transient error) and could not release; its retry's
    claim landed with its reply lost; the delivery after that took the claim back two owners on. The mark was
    the chain's own, written by a delivery that then ended with a step and no verdict, yet, with a reclaim in
    the record's past and the mark two tokens back, it was taken for a dead holder's: parked for review
    although nothing had been sent."""
    refusing = Refusing(ledger)
    handler, box = build(refusing, Mailbox(ahead=True), lease_seconds=0.2)
    ledger.claim(ClaimRequest(key="h-own2", task_name="tests.mail", payload=delivery("h-own2").payload.to_json(),
                              fingerprint="", owner=new_owner("dead"), writes_ahead=True, lease_seconds=0.2))
    time.sleep(0.35)  # a holder that promised its mark died before it: the next claimer runs the intent
    box.fail_with = TransientSendError("connection dropped before the message", reason="smtp_dropped")
    refusing.down.add("released")
    d = delivery("h-own2")
    first = handler.handle(d)  # reclaimed, marked, nothing sent, the release refused
    assert first.action is Action.RETRY
    marked = ledger.get("h-own2")
    assert marked is not None and marked.reclaims == 1 and marked.mark is not None
    box.fail_with = None
    refusing.down = {"claim_lost_reply"}
    second = handler.handle(next_of(d, first))  # takes the claim back; the reply is lost
    assert second.action is Action.RESCHEDULE and len(second.carry.owners) == 2
    refusing.down.clear()
    third = handler.handle(next_of(d, second))  # takes it back from the second owner: the mark is two back
    assert third.outcome is Outcome.SENT and box.sent == [("h-own2", "first")]


class DiesAfterSending(Mailbox):
    """The provider takes the message, and the worker dies before it hears back (nothing the handler catches)."""

    class Killed(BaseException):
        pass

    def perform(self, payload: Payload, key: str) -> Any:
        super().perform(payload, key)
        raise self.Killed


@pytest.mark.parametrize("carries_key", [True, False], ids=["keyed", "keyless"])
def test_a_rotation_claim_whose_holder_died_before_its_check_is_not_taken_over_and_sent_again(
        ledger: Ledger, carries_key: bool) -> None:
    """Found by the simulator (sim/traces/keyed_campaign_rotation_crash_after_accept_sends_twice.json): during a
    key-secret rotation one delivery claimed the intent under the new key, passed its check and sent, and died
    before it heard back; another claimed it under the old key and died before its check. Once both leases ran
    out, a delivery following the old key's record took that claim over and sent the intent under the old key:
    a key the provider never saw, so two emails (and a keyless provider sends twice anyway). A claim taken
    over during a rotation is checked like a new one unless it shows it may have run (its mark): the never-run
    one runs nothing, the intent is followed to the other key, where it is sent with that key or parked, and
    the record under the old key then says the same."""
    box = DiesAfterSending(carries_key=carries_key, ahead=not carries_key)
    handler, _ = build(ledger, box, lease_seconds=0.2)
    on_old, on_new = rotating("rr6-old", "rr6-new")
    with pytest.raises(DiesAfterSending.Killed):  # claims the new key, checks the old one (nothing), sends, dies
        handler.handle(on_new)
    ledger.claim(ClaimRequest(key="rr6-old", task_name="tests.mail", payload=on_old.payload.to_json(),
                              fingerprint="", owner=new_owner("dies-before-its-check"), writes_ahead=not carries_key,
                              lease_seconds=0.2))
    time.sleep(0.35)
    after = Mailbox(carries_key=carries_key, ahead=not carries_key)
    handler.effect = after
    step = handler.handle(on_new)  # its look-up finds the old key's record first
    assert {key for key, _ in box.sent + after.sent} == {"rr6-new"}  # one key: one email
    assert step.key == "rr6-new"
    if carries_key:
        assert step.outcome is Outcome.SENT  # sent again with the key the provider de-duplicates on
    else:
        assert step.outcome is Outcome.REVIEW and after.sent == []  # marked and dead: it may have been sent
    old, new = ledger.get("rr6-old"), ledger.get("rr6-new")
    assert old is not None and new is not None and old.state is new.state  # the old key's record says the same


@pytest.mark.parametrize("other", ["sent", "unreadable"])
def test_a_rotation_claim_taken_over_from_a_paused_holder_keeps_its_tokens(ledger: Ledger, other: str) -> None:
    """Found by the simulator (sim/traces/keyless_rotation_withdrawn_takeover_reissues_a_paused_holders_token.json):
    a claim taken over during a rotation, whose re-read of the other key then failed (or met its record), was
    withdrawn. Its key's next claim started the tokens again at 1, the token of the holder it had been taken
    from, which was paused, not dead: that holder's mark landed on the new claim, and the intent went out twice.
    A claim taken over is never withdrawn: the intent is followed to the other key, and this record says what
    it comes to there."""
    box = Mailbox(ahead=True)
    handler, _ = build(ledger, box)
    on_old, on_new = rotating("rr7-old", "rr7-new")
    if other == "sent":
        assert handler.handle(delivery("rr7-new")).outcome is Outcome.SENT  # the intent, under the new key
    paused = ledger.claim(ClaimRequest(key="rr7-old", task_name="tests.mail", payload=on_old.payload.to_json(),
                                       fingerprint="", owner=new_owner("paused"), writes_ahead=True, lease_seconds=0.2))
    time.sleep(0.35)
    if other == "unreadable":
        handler.ledger = RereadFails(ledger, "rr7-new", down=False)
        handler.ledger.reads = 1  # the look-up is not made here (the delivery finds the old key first)
    step = handler.handle(on_new)  # its look-up finds the old key's record first, and takes the claim over
    held = ledger.get("rr7-old")
    assert held is not None and held.token > paused.token  # not withdrawn: no token is handed out twice
    assert ledger.write_ahead("rr7-old", paused.token, 30, "message", owner=paused.record.owner) is False
    if other == "sent":
        assert (step.outcome, step.key) == (Outcome.DUPLICATE, "rr7-new") and len(box.sent) == 1
        assert held.state is State.SENT and held.result == ledger.get("rr7-new").result  # type: ignore[union-attr]
    else:
        assert step.outcome is Outcome.LEDGER_UNAVAILABLE and box.sent == []


def test_a_keyed_attempt_that_may_have_sent_stays_the_intents_key_through_a_rotation(ledger: Ledger) -> None:
    """Found by the simulator (sim/traces/keyed_rotation_released_maybe_sent_claim_withdrawn_sends_twice.json):
    during a rotation a keyed send under the old key was accepted with its reply lost (released, to be retried
    with the key); the retry's claim landed with its reply lost, and the delivery after it took the claim back
    with nothing on it but the release note. Taken for a claim that never ran, it was withdrawn in favour of
    a never-run claim under the new key, and the intent went out again under a key the provider never saw."""
    refusing = Refusing(ledger)
    box = Mailbox(carries_key=True)
    handler, _ = build(refusing, box, lease_seconds=0.2)
    on_old, on_new = rotating("rr8-old", "rr8-new")
    box.fail_with = AmbiguousSendError("the reply never came", reason="timeout")

    class AcceptedThenTimedOut(Mailbox):
        def perform(self, payload: Payload, key: str) -> Any:
            self.sent.append((key, payload.kwargs.get("body")))
            raise AmbiguousSendError("the reply never came", reason="timeout")

    handler.effect = first_box = AcceptedThenTimedOut(carries_key=True)
    first = handler.handle(on_old)
    assert first.action is Action.RETRY and first_box.sent == [("rr8-old", "first")]
    # A copy on a worker of the other phase claimed the new key before that send began, and died before its check.
    ledger.claim(ClaimRequest(key="rr8-new", task_name="tests.mail", payload=on_new.payload.to_json(),
                              fingerprint="", owner="dead:1", lease_seconds=0.2))
    handler.effect = box
    box.fail_with = None
    refusing.down.add("claim_lost_reply")
    second = handler.handle(next_of(on_new, first, older_keys=("rr8-old",)))  # reopens the old key's claim
    assert second.action is Action.RESCHEDULE
    refusing.down.clear()
    time.sleep(0.35)
    step = handler.handle(next_of(on_new, second, older_keys=("rr8-old",)))
    for _ in range(3):
        if step.action is not Action.RESCHEDULE:
            break
        step = handler.handle(next_of(on_new, step, older_keys=("rr8-old",)))
    assert {key for key, _ in first_box.sent + box.sent} == {"rr8-old"}  # one key: one email
    assert (step.outcome, step.key) == (Outcome.SENT, "rr8-old")
