"""A campaign's batches survive errors per recipient, on every real backend.

``send_batch`` claims a batch in one round trip and settles each recipient with the same
handler a single send uses. These tests make one recipient's ledger move or provider call
fail (the store refusing one move, another holder taking one claim over, a reconcile search
that errors) and check that exactly that recipient is settled accordingly and the rest of
the batch is sent, once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from celery import Celery

from idemmail_celery.bulk import CAMPAIGN_TASK, send_batch
from idemmail_celery.chain import Verdict
from idemmail_celery.handler import Delivery, Outcome
from idemmail_celery.keys import Payload
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, Ledger, State
from idemmail_celery.ledger.base import new_owner
from idemmail_celery.ledger.wrapper import LedgerWrapper

from .test_handler import Lockstep, Mailbox, Refusing, build


def recipients(n: int, prefix: str) -> list[Delivery]:
    return [Delivery(key=f"{prefix}-{i}", task_name="tests.mail",
                     payload=Payload([], {"to": f"r{i}@example.com", "body": f"to r{i}"}), attempt_id="camp-1",
                     max_retries=30) for i in range(n)]


def test_a_ledger_blip_recording_one_recipient_settles_it_and_the_batch_goes_on(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idemmail_celery.errors import LedgerUnavailableError

    monkeypatch.setattr("idemmail_celery.handler.time.sleep", lambda s: None)
    blip_key = "b1-2"

    class BlipOne(Refusing):
        def _finish(self, key: str, token: int, state: State, **kw: Any) -> None:
            if key == blip_key and self.down:
                raise LedgerUnavailableError("connection reset")
            self.inner._finish(key, token, state, **kw)

    refusing = BlipOne(ledger)
    refusing.down.add("on")
    handler, box = build(refusing)
    batch = send_batch(handler, recipients(5, "b1"), owner="camp:1:aaaa")
    assert batch.tally() == Counter({Outcome.SENT: 4, Outcome.PENDING: 1})
    assert len(box.sent) == 5 and set(batch.verdicts()) == {blip_key}
    # The next pass takes its own claim back and records the verdict: nothing is sent again.
    refusing.down.clear()
    carried = batch.verdicts()
    again = [replace(d, resume_owners=("camp:1:aaaa",), verdict=Verdict.from_header(carried.get(d.key)), retries=1)
             for d in recipients(5, "b1")]
    second = send_batch(handler, again, owner="camp:1:bbbb")
    assert second.tally() == Counter({Outcome.SENT: 1, Outcome.DUPLICATE: 4}) and len(box.sent) == 5
    assert Counter(r.state for r in (ledger.get(d.key) for d in again) if r) == Counter({State.SENT: 5})


def test_a_recipient_another_holder_took_over_mid_batch_does_not_stop_the_batch(ledger: Ledger) -> None:
    handler, box = build(ledger)
    stolen = "b2-1"

    class TakeOver(Mailbox):
        def perform(self, payload: Payload, key: str) -> Any:
            if key == stolen:  # a single send_email took this recipient's claim over meanwhile, and sent
                record = ledger.get(key)
                assert record is not None
                ledger._force(key, record.token, replace(record, token=record.token + 1, owner="single:1"))
                ledger.complete(key, record.token + 1, {"message_id": "m-single", "value": None})
            return super().perform(payload, key)

    handler.effect = box = TakeOver()
    batch = send_batch(handler, recipients(3, "b2"), owner="camp:2")
    assert [s.outcome for s in batch.steps] == [Outcome.SENT] * 3 and len(box.sent) == 3
    lost = [fields for outcome, fields in box.reports if fields.get("reason") == "lease_lost"]
    assert len(lost) == 1 and lost[0]["recorded"] == "false"  # said loudly: the newer holder's record stands
    assert ledger.get(stolen).result["message_id"] == "m-single"  # type: ignore[union-attr,index]
    assert ledger.get("b2-2").state is State.SENT  # type: ignore[union-attr]


def test_a_reconcile_search_that_fails_parks_that_recipient_and_the_batch_goes_on(ledger: Ledger) -> None:
    handler, box = build(ledger)

    class SearchDown(Mailbox):
        def reconcile(self, key: str, payload: Payload) -> Any:
            raise ConnectionError("search API down")

    handler.effect = box = SearchDown()
    ds = recipients(3, "b3")
    ledger.claim(ClaimRequest(key=ds[1].key, task_name="tests.mail", payload=ds[1].payload.to_json(),
                              fingerprint="", owner="dead:1", lease_seconds=0.2))  # a crashed campaign copy
    time.sleep(0.35)
    batch = send_batch(handler, ds, owner="camp:3")
    assert [s.outcome for s in batch.steps] == [Outcome.SENT, Outcome.REVIEW, Outcome.SENT]
    parked = ledger.get(ds[1].key)
    assert parked is not None and parked.state is State.REVIEW and parked.error["reason"] == "lease_expired"  # type: ignore[index]
    assert [k for k, _ in box.sent] == [ds[0].key, ds[2].key]


def test_a_dead_passs_batch_parks_only_the_recipient_whose_send_had_begun(ledger: Ledger) -> None:
    # A pass claimed five recipients, marked the first (its send began: SMTP had accepted DATA) and died.
    # Before the write-ahead mark all five were parked lease_expired, four of them never sent.
    ds = recipients(5, "b6")
    dead = new_owner("camp-dead")
    claims = ledger.claim_many([ClaimRequest(key=d.key, task_name="tests.mail", payload=d.payload.to_json(),
                                             fingerprint="", owner=dead, lease_seconds=0.2, writes_ahead=True)
                                for d in ds])
    assert ledger.write_ahead(ds[0].key, claims[0].token, 0.2, "message") is True
    time.sleep(0.35)
    handler, box = build(ledger, Mailbox(ahead=True))
    batch = send_batch(handler, ds, owner=new_owner("camp-next"))
    assert [s.outcome for s in batch.steps] == [Outcome.REVIEW] + [Outcome.SENT] * 4
    assert [k for k, _ in box.sent] == [d.key for d in ds[1:]]
    parked = ledger.get(ds[0].key)
    assert parked is not None and parked.error is not None and parked.error["stage"] == "message"


def test_every_claim_of_a_batch_is_renewed_until_it_is_settled(ledger: Ledger) -> None:
    handler, box = build(ledger, lease_seconds=0.6)
    ds = recipients(3, "b4")
    seen: list[ClaimStatus] = []

    class Slow(Mailbox):
        def perform(self, payload: Payload, key: str) -> Any:
            time.sleep(0.5)
            if key == ds[1].key:  # 0.5 s in, the last recipient's lease (0.6 s) would be near its end...
                time.sleep(0.5)   # ...and past it by now, were it not renewed
                probe = ledger.claim(ClaimRequest(key=ds[2].key, task_name="tests.mail", fingerprint="",
                                                  payload=ds[2].payload.to_json(), owner="other:1"))
                seen.append(probe.status)
            return super().perform(payload, key)

    handler.effect = box = Slow()
    batch = send_batch(handler, ds, owner="camp:4")
    assert seen == [ClaimStatus.BUSY]  # another copy could not take it over: no second send
    assert [s.outcome for s in batch.steps] == [Outcome.SENT] * 3 and len(box.sent) == 3


def test_two_spellings_of_one_mailbox_are_one_recipient(tmp_path: Any) -> None:
    app = Celery("bulk-spell", set_as_current=False)
    app.conf.update(idemmail_ledger_url=f"sqlite:///{tmp_path / 'l.sqlite3'}", idemmail_key_secret="s",
                    idemmail_provider_url=f"file://{tmp_path / 'out'}", idemmail_default_from="shop@example.com")
    from idemmail_celery.bulk import _send_campaign
    from idemmail_celery.mail import register

    register(app)
    campaign = app.task(bind=True, name=CAMPAIGN_TASK, max_retries=None)(_send_campaign)
    out = campaign.apply(kwargs={"campaign_id": "c2", "subject": "Hi", "text": "x", "recipients": [
        "ann@example.com", "ann@EXAMPLE.com", "Ann Smith <ann@example.com>", "bob@example.com"]}).get()
    assert (out["total"], out["sent"]) == (2, 2)
    assert len(list((tmp_path / "out").iterdir())) == 2


def campaign_app(tmp_path: Any, secret: Any, name: str = "bulk") -> tuple[Celery, Any]:
    """A real app on a SQLite ledger and a file provider (one file per delivered email)."""
    app = Celery(name, set_as_current=False)
    app.conf.update(idemmail_ledger_url=f"sqlite:///{tmp_path / 'l.sqlite3'}", idemmail_key_secret=secret,
                    idemmail_provider_url=f"file://{tmp_path / 'out'}", idemmail_default_from="shop@example.com")
    from idemmail_celery.bulk import _send_campaign
    from idemmail_celery.mail import register

    register(app)
    return app, app.task(bind=True, name=CAMPAIGN_TASK, max_retries=None)(_send_campaign)


def test_a_campaign_after_a_key_secret_rotation_sends_no_recipient_again(tmp_path: Any) -> None:
    people = ["ann@example.com", "bob@example.com"]
    _, before = campaign_app(tmp_path, "old-secret", "bulk-rot-1")
    first = before.apply(kwargs={"campaign_id": "c-rot", "subject": "Hi", "text": "x", "recipients": people}).get()
    assert first["sent"] == 2
    app, after = campaign_app(tmp_path, ["new-secret", "old-secret"], "bulk-rot-2")
    again = after.apply(kwargs={"campaign_id": "c-rot", "subject": "Hi", "text": "x",
                                "recipients": [*people, "cy@example.com"]}).get()
    assert (again["sent"], again["duplicate"]) == (1, 2)
    assert len(list((tmp_path / "out").iterdir())) == 3  # one email per recipient, ever
    # A single send of the same intent agrees with the campaign.
    single = app.tasks["idemmail_celery.send_email"].apply(
        kwargs={"to": "cy@example.com", "subject": "Hi", "text": "x", "event_id": "c-rot"}).get()
    assert single["status"] == "duplicate" and len(list((tmp_path / "out").iterdir())) == 3


def test_a_pass_sealed_under_a_secret_this_worker_lacks_waits_for_one_that_has_it(tmp_path: Any) -> None:
    """Rotation, workers deployed one by one: a pass a worker on [new, old] handed on reaches one still on [old].
    Its pass state (the verdicts of sends made, how many passes were time slices) is neither trusted nor
    dropped: the message is requeued as it came, and nothing is sent meanwhile."""
    from celery.exceptions import Retry

    from idemmail_celery.chain import CAMPAIGN_HEADER, KEY_MARK_HEADER, OWNER_HEADER

    app, campaign = campaign_app(tmp_path, "old-secret", "bulk-rot-wait")
    newer = replace(app.tasks["idemmail_celery.send_email"].key_builder, secret=["new-secret", "old-secret"])
    call = {"campaign_id": "c-w", "subject": "Hi", "text": "x", "recipients": ["ann@example.com", "bob@example.com"]}
    headers: dict[str, Any] = {OWNER_HEADER: "camp:1:aaaa", CAMPAIGN_HEADER: {"from": 1, "tally": {}, "continued": 3}}
    headers[KEY_MARK_HEADER] = newer.seal(headers, Payload([], call), task_name=CAMPAIGN_TASK)
    out = campaign.apply(kwargs=call, headers=headers)
    assert out.state == "RETRY" and isinstance(out.result, Retry), out.result
    assert getattr(out.result.exc, "reason", None) == "unknown_key_secret"
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # nothing sent


def test_a_worker_without_the_key_secret_keeps_campaigns_and_sends_waiting(tmp_path: Any) -> None:
    """A server ledger and no key secret on this worker: no key can be made, no seal read or written. The
    message must not end FAILURE (acknowledged, nothing recorded): it waits, as it came, for a worker that can."""
    from .conftest import REDIS_URL, unique

    app, campaign = campaign_app(tmp_path, None, "bulk-no-secret")
    app.conf.update(idemmail_ledger_url=REDIS_URL, idemmail_ledger_options={"prefix": unique("nosecret")})
    call = {"campaign_id": "c-n", "subject": "Hi", "text": "x", "recipients": ["ann@example.com"]}
    out = campaign.apply(kwargs=call)
    assert out.state == "RETRY", out.result
    single = app.tasks["idemmail_celery.send_email"].apply(kwargs={"to": "ann@example.com", "subject": "Hi",
                                                                   "text": "x", "event_id": "e-n"})
    assert single.state == "RETRY", single.result
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # nothing sent


def test_a_long_wait_for_a_key_secret_is_said_at_error(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A secret removed while messages sealed under it were queued: the wait never ends by itself (nothing
    dropped, no key guessed), so after ten minutes every requeue says so at ERROR."""
    from idemmail_celery.chain import KEY_MARK_HEADER, OWNER_HEADER, SECRET_WAIT_HEADER

    app, campaign = campaign_app(tmp_path, "old-secret", "bulk-rot-long")
    newer = replace(app.tasks["idemmail_celery.send_email"].key_builder, secret=["new-secret", "old-secret"])
    call = {"campaign_id": "c-l", "subject": "Hi", "text": "x", "recipients": ["ann@example.com"]}
    headers: dict[str, Any] = {OWNER_HEADER: "camp:1:bbbb"}
    headers[KEY_MARK_HEADER] = newer.seal(headers, Payload([], call), task_name=CAMPAIGN_TASK)
    levels = []
    for since in (None, time.time() - 3600):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="idemmail_celery"):
            out = campaign.apply(kwargs=call, headers={**headers, **({SECRET_WAIT_HEADER: since} if since else {})})
        assert out.state == "RETRY"
        levels.append([r.levelname for r in caplog.records if "key secret this worker does not have" in r.message])
    assert levels == [["WARNING"], ["ERROR"]]


class BrokenComplete(LedgerWrapper):
    """A real ledger whose completion of ``key`` fails with a defect (not a ledger error) after the send."""

    def __init__(self, inner: Ledger, key: str) -> None:
        super().__init__(inner)
        self.key = key

    def complete(self, key: str, token: int, result: Any = None) -> None:
        if key == self.key:
            raise RuntimeError("a driver bug")
        self.inner.complete(key, token, result)


def test_a_recipient_whose_settling_broke_after_the_send_is_parked_not_sent_again(ledger: Ledger) -> None:
    ds = recipients(3, "b5")
    handler, box = build(BrokenComplete(ledger, ds[1].key))  # the provider does not de-duplicate
    batch = send_batch(handler, ds, owner="camp:5:aaaa")
    assert [s.outcome for s in batch.steps] == [Outcome.SENT, Outcome.REVIEW, Outcome.SENT]
    parked = ledger.get(ds[1].key)
    assert parked is not None and parked.state is State.REVIEW
    assert parked.error["reason"] == "unexpected_error"  # type: ignore[index]
    again = [replace(d, resume_owners=("camp:5:aaaa",), retries=1) for d in ds]
    second = send_batch(handler, again, owner="camp:5:bbbb")
    assert second.tally() == Counter({Outcome.DUPLICATE: 3}) and len(box.sent) == 3  # nothing sent twice


def test_a_campaign_never_ends_with_a_verdict_it_could_not_record(tmp_path: Any) -> None:
    from idemmail_celery.bulk import MAX_PASSES
    from idemmail_celery.errors import LedgerUnavailableError

    app, campaign = campaign_app(tmp_path, "s", "bulk-verdict")
    sender = app.tasks["idemmail_celery.send_email"]
    real = sender.ledger

    class DownOnce(LedgerWrapper):  # the store goes away for the first completion of one recipient
        refused = 0

        def complete(self, key: str, token: int, result: Any = None) -> None:
            if self.refused < 4:  # every attempt of the first pass (the handler tries 4 times)
                self.refused += 1
                raise LedgerUnavailableError("connection reset")
            self.inner.complete(key, token, result)

    sender._idem_ledger = DownOnce(real)
    # The last pass a campaign has: it must still come back to record what it sent (Celery's apply()
    # runs the retry at once), not return with the recipient's claim held and nothing recorded.
    out = campaign.apply(kwargs={"campaign_id": "c-v", "subject": "Hi", "text": "x",
                                 "recipients": ["ann@example.com"]}, retries=MAX_PASSES).get()
    assert (out["sent"], out["pending"]) == (1, 0)  # recorded by the pass that came back for it
    record = real.get(sender.intent_key(to="ann@example.com", subject="Hi", text="x", event_id="c-v"))
    assert record is not None and record.state is State.SENT
    assert len(list((tmp_path / "out").iterdir())) == 1


def test_a_pass_that_runs_out_of_time_hands_on_its_place_its_counts_and_its_verdicts(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idemmail_celery import bulk
    from idemmail_celery.errors import LedgerUnavailableError

    app, campaign = campaign_app(tmp_path, "s", "bulk-passes")
    app.conf.idemmail_campaign_pass_seconds = 1e-6  # every pass runs one batch, then hands on the rest
    sender = app.tasks["idemmail_celery.send_email"]
    real = sender.ledger
    people = ["ann@example.com", "bob@example.com", "cy@example.com", "di@example.com"]
    first_key = sender.intent_key(to=people[0], subject="Hi", text="x", event_id="c-p")

    class DownForAnn(LedgerWrapper):  # ann's completion fails on the first pass (4 tries): her verdict is carried
        refused = 0

        def complete(self, key: str, token: int, result: Any = None) -> None:
            if key == first_key and self.refused < 4:
                self.refused += 1
                raise LedgerUnavailableError("connection reset")
            self.inner.complete(key, token, result)

    sender._idem_ledger = DownForAnn(real)
    handed_on: list[dict[str, Any]] = []
    yield_pass = bulk._yield_pass

    def counted(task: Any, handler: Any, owner: str, verdicts: dict[str, Any], passes: int, start: int,
                *rest: Any) -> BaseException:
        handed_on.append({"from": start, "verdicts": len(verdicts), "retries": task.request.retries})
        return yield_pass(task, handler, owner, verdicts, passes, start, *rest)

    monkeypatch.setattr(bulk, "_yield_pass", counted)
    out = campaign.apply(kwargs={"campaign_id": "c-p", "subject": "Hi", "text": "x", "recipients": people,
                                 "batch_size": 1}).get()
    # Counted over every pass; ann's verdict recorded by the pass after hers, not sent again.
    assert (out["total"], out["sent"], out["duplicate"], out["pending"]) == (4, 4, 0, 0), out
    assert len(list((tmp_path / "out").iterdir())) == 4
    # ann's pass handed on her verdict; the next recorded it first, then went on where the first stopped.
    assert [(h["from"], h["verdicts"]) for h in handed_on] == [(1, 1), (2, 0), (3, 0)], handed_on
    assert [h["retries"] for h in handed_on] == [0, 1, 2]  # Celery's count; MAX_PASSES counts none of them
    for person in people:
        record = real.get(sender.intent_key(to=person, subject="Hi", text="x", event_id="c-p"))
        assert record is not None and record.state is State.SENT


def test_a_pass_lasts_half_the_visibility_timeout_unless_set() -> None:
    from idemmail_celery.bulk import pass_seconds
    from idemmail_celery.config import Settings

    def app(broker: str, **options: Any) -> Celery:
        a = Celery("bulk-vt", broker=broker, set_as_current=False)
        a.conf.broker_transport_options = options
        return a

    unset = Settings()
    assert pass_seconds(app("redis://127.0.0.1:6379/0", visibility_timeout=20), unset) == 10
    assert pass_seconds(app("redis://127.0.0.1:6379/0"), unset) == 1800  # kombu's default: an hour
    assert pass_seconds(app("amqp://guest@127.0.0.1//"), unset) == 900  # half RabbitMQ's consumer_timeout
    assert pass_seconds(app("redis://127.0.0.1:6379/0", visibility_timeout=20),
                        Settings(campaign_pass_seconds=5)) == 5


@pytest.mark.parametrize("header", [None, "x", {"from": -1, "tally": {}, "continued": 1},
                                    {"from": 9, "tally": {}, "continued": 1}, {"from": 1, "tally": {"bogus": 1},
                                                                                "continued": 1},
                                    {"from": 1, "tally": {"sent": "many"}, "continued": 0}])
def test_a_malformed_hand_on_goes_over_the_whole_list(header: Any) -> None:
    from idemmail_celery.bulk import _Resumed

    assert _Resumed.of(header, 5) == _Resumed()


class RecordsLate(LedgerWrapper):
    """A real ledger that refuses the first ``refusals[key]`` completions of a key, then takes ``slow[key]``
    seconds of a fake clock to record it, and refuses the claim batches numbered in ``down``."""

    def __init__(self, inner: Ledger, refusals: dict[str, int], slow: dict[str, float] | None = None,
                 clock: list[float] | None = None, down: tuple[int, ...] = ()) -> None:
        super().__init__(inner)
        self.refusals, self.slow, self.clock, self.down, self.batches = refusals, slow or {}, clock, down, 0

    def complete(self, key: str, token: int, result: Any = None) -> None:
        from idemmail_celery.errors import LedgerUnavailableError

        if self.refusals.get(key, 0) > 0:
            self.refusals[key] -= 1
            raise LedgerUnavailableError("connection reset")
        if key in self.slow and self.clock is not None:
            self.clock[0] += self.slow.pop(key)
        self.inner.complete(key, token, result)

    def claim_many(self, requests: Any) -> Any:
        from idemmail_celery.errors import LedgerUnavailableError

        self.batches += 1
        if self.batches in self.down:
            raise LedgerUnavailableError("connection refused")
        return self.inner.claim_many(requests)


PEOPLE = ["ann@example.com", "bob@example.com", "cy@example.com", "di@example.com", "ed@example.com"]


def paced_campaign(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[Any, Any, list[float]]:
    """A campaign whose passes last 100 s of a fake clock (``clock[0]``, moved by the test), the
    handler's waits between tries skipped; returns the campaign task, send_email and the clock."""
    import types

    from idemmail_celery import bulk

    clock = [0.0]
    monkeypatch.setattr(bulk, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr("idemmail_celery.handler.time.sleep", lambda s: None)
    app, campaign = campaign_app(tmp_path, "s", name)
    app.conf.idemmail_campaign_pass_seconds = 100
    return campaign, app.tasks["idemmail_celery.send_email"], clock


def test_a_pass_that_stops_with_verdicts_and_a_pending_recipient_loses_neither(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ann's and bob's sends cannot be recorded (their verdicts are carried), cy's provider says "later"
    # (released, pending), and the pass runs out of time; the next pass is slow recording ann's verdict.
    from idemmail_celery.errors import TransientSendError

    campaign, sender, clock = paced_campaign(tmp_path, monkeypatch, "bulk-stops")
    real = sender.ledger
    people = PEOPLE
    key = {p: sender.intent_key(to=p, subject="Hi", text="x", event_id="c-s") for p in people}
    # Every try of the first pass refused for ann and bob; the next pass takes its whole time recording ann.
    sender._idem_ledger = RecordsLate(real, {key[people[0]]: 4, key[people[1]]: 4}, {key[people[0]]: 100.0}, clock)
    deliver = sender.deliver
    later: list[str] = []

    def deliver_or_later(kwargs: dict[str, Any], k: str) -> Any:
        if kwargs["to"] == people[2] and not later:
            later.append(k)
            clock[0] += 100
            raise TransientSendError("try later", reason="throttled")
        return deliver(kwargs, k)

    monkeypatch.setattr(sender, "deliver", deliver_or_later)
    out = campaign.apply(kwargs={"campaign_id": "c-s", "subject": "Hi", "text": "x", "recipients": people,
                                 "batch_size": 1}).get()
    assert out["total"] == 5 and out["sent"] + out["duplicate"] == 5 and out["pending"] == 0, out
    assert len(list((tmp_path / "out").iterdir())) == 5  # everyone once, cy included
    for person in people:
        record = real.get(key[person])
        assert record is not None and record.state is State.SENT, (person, record)


def test_a_verdict_recorded_first_is_counted_once_when_the_list_reaches_it_later(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ed (last in the list) is sent and cannot be recorded; the whole list goes round again and records
    # his verdict first, which takes the pass's time: the pass hands on at the second recipient, and the
    # pass after it reaches ed again. He is counted once, and nobody is sent twice.
    campaign, sender, clock = paced_campaign(tmp_path, monkeypatch, "bulk-once")
    people = PEOPLE
    ed = sender.intent_key(to=people[4], subject="Hi", text="x", event_id="c-o")
    sender._idem_ledger = RecordsLate(sender.ledger, {ed: 4}, {ed: 100.0}, clock)
    out = campaign.apply(kwargs={"campaign_id": "c-o", "subject": "Hi", "text": "x", "recipients": people,
                                 "batch_size": 1}).get()
    counted = sum(out[o] for o in ("sent", "duplicate", "failed", "review", "pending"))
    assert (out["total"], counted, out["pending"]) == (5, 5, 0), out
    assert len(list((tmp_path / "out").iterdir())) == 5


def test_a_verdict_whose_next_pass_met_the_ledger_down_is_still_recorded_by_the_one_after(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ann is sent and cannot be recorded; bob's claim batch meets the ledger down, and so does the next
    # pass's claim of ann's verdict. The pass after that must still take ann's claim back (its holder is
    # the pass that sent her) and record her, not wait for the lease and send or park her again.
    monkeypatch.setattr("idemmail_celery.handler.time.sleep", lambda s: None)
    app, campaign = campaign_app(tmp_path, "s", "bulk-held")
    sender = app.tasks["idemmail_celery.send_email"]
    real = sender.ledger
    people = ["ann@example.com", "bob@example.com"]
    ann = sender.intent_key(to=people[0], subject="Hi", text="x", event_id="c-h")
    sender._idem_ledger = RecordsLate(real, {ann: 4}, down=(2, 3))
    out = campaign.apply(kwargs={"campaign_id": "c-h", "subject": "Hi", "text": "x", "recipients": people,
                                 "batch_size": 1}).get()
    assert (out["total"], out["sent"] + out["duplicate"], out["pending"]) == (2, 2, 0), out
    record = real.get(ann)
    assert record is not None and record.state is State.SENT, record
    assert len(list((tmp_path / "out").iterdir())) == 2


def test_a_batch_claim_whose_reply_was_lost_then_a_refused_pass_sends_every_recipient_once(tmp_path: Any) -> None:
    # Case 1 of issue 23: the first pass's batch claim lands with its reply lost; the next pass's claim
    # is refused. The pass after must take back the claims the first one holds, not find them busy
    # until their leases run out (and then park them for review, having sent nothing).
    from idemmail_celery.errors import LedgerUnavailableError

    app, campaign = campaign_app(tmp_path, "s", "bulk-lost-reply")
    sender = app.tasks["idemmail_celery.send_email"]
    real = sender.ledger

    class LostThenDown(LedgerWrapper):
        calls = 0

        def claim_many(self, requests: Any) -> Any:
            self.calls += 1
            if self.calls == 1:
                self.inner.claim_many(requests)  # it lands; its reply never comes back
                raise LedgerUnavailableError("reply lost")
            if self.calls == 2:
                raise LedgerUnavailableError("store went away")
            return self.inner.claim_many(requests)

    sender._idem_ledger = LostThenDown(real)
    people = [f"r{i}@example.com" for i in range(5)]
    out = campaign.apply(kwargs={"campaign_id": "c-lost", "subject": "Hi", "text": "x",
                                 "recipients": people}).get()
    assert (out["sent"], out["review"], out["pending"]) == (5, 0, 0)
    assert len(list((tmp_path / "out").iterdir())) == 5  # one email per recipient
    for to in people:
        record = real.get(sender.intent_key(to=to, subject="Hi", text="x", event_id="c-lost"))
        assert record is not None and record.state is State.SENT and record.reclaims == 0


def _no_provider_for(sender: Any, monkeypatch: pytest.MonkeyPatch, checks: int) -> list[int]:
    """The worker's provider cannot be built (no API key) for the first ``checks`` checks."""
    from idemmail_celery.errors import ConfigurationError

    seen = [0]
    real = sender.check

    def check(payload: Payload) -> None:
        seen[0] += 1
        if seen[0] <= checks:
            raise ConfigurationError("set idemmail_provider_api_key (or the provider's env variable)")
        real(payload)

    monkeypatch.setattr(sender, "check", check)
    return seen


def test_a_campaign_whose_provider_cannot_be_built_waits_and_sends_once_it_can(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Case 3 of issue 23: before, the campaign spent its 30 passes on the set-up error and ended SUCCESS
    # with "pending: 4", nobody holding them and nothing sent. Now it waits on the outage budget
    # (unlimited by default) like send_email, and sends when the provider can be built.
    from idemmail_celery.bulk import MAX_PASSES

    app, campaign = campaign_app(tmp_path, "s", "bulk-setup")
    sender = app.tasks["idemmail_celery.send_email"]
    _no_provider_for(sender, monkeypatch, checks=4 * (MAX_PASSES + 5))  # four a pass: past MAX_PASSES passes
    people = [f"r{i}@example.com" for i in range(4)]
    out = campaign.apply(kwargs={"campaign_id": "c-setup", "subject": "Hi", "text": "x",
                                 "recipients": people}).get()
    assert out["sent"] + out["duplicate"] == 4 and (out["pending"], out["failed"], out["review"]) == (0, 0, 0)
    assert len(list((tmp_path / "out").iterdir())) == 4  # each sent once


def test_a_campaign_past_its_outage_budget_fails_rather_than_ending_with_recipients_nobody_holds(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idemmail_celery.errors import ConfigurationError

    app, campaign = campaign_app(tmp_path, "s", "bulk-setup-budget")
    app.conf.idemmail_outage_max_retries = 3
    sender = app.tasks["idemmail_celery.send_email"]
    _no_provider_for(sender, monkeypatch, checks=10_000)
    result = campaign.apply(kwargs={"campaign_id": "c-setup-2", "subject": "Hi", "text": "x",
                                    "recipients": ["ann@example.com", "bob@example.com"]})
    assert result.state == "FAILURE" and isinstance(result.result, ConfigurationError)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_key_secret_rotation_between_passes_records_each_verdict_under_its_claims_key(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Case 2 of issue 23: a pass sends and cannot record (verdicts handed on); the next pass runs with
    # other key secrets. Before: its keys matched none of the verdicts, it took the claims back under the
    # older keys and sent those recipients again, and the campaign never ended (verdicts left for ever).
    monkeypatch.setattr("idemmail_celery.handler.time.sleep", lambda s: None)
    first, then = ["old"], ["new", "old"]
    app, campaign = campaign_app(tmp_path, first, "bulk-rotate")
    sender = app.tasks["idemmail_celery.send_email"]
    real = sender.ledger
    people = [f"r{i}@example.com" for i in range(6)]
    unrecorded = {sender.intent_key(to=to, subject="Hi", text="x", event_id="c-rot2"): 4 for to in people[::2]}
    sender._idem_ledger = RecordsLate(real, unrecorded)
    from idemmail_celery import bulk

    retried = bulk._next_pass  # where a pass hands on to the next
    passes = [0]

    def rotate_then_retry(*args: Any, **kwargs: Any) -> Any:
        passes[0] += 1
        assert passes[0] < 10, "the campaign never ends"
        app.conf.idemmail_key_secret = then  # the workers are redeployed with the other secrets
        sender._idem_settings = sender._idem_builder = None
        return retried(*args, **kwargs)

    monkeypatch.setattr(bulk, "_next_pass", rotate_then_retry)
    out = campaign.apply(kwargs={"campaign_id": "c-rot2", "subject": "Hi", "text": "x", "recipients": people}).get()
    assert len(list((tmp_path / "out").iterdir())) == 6  # one email per recipient: none sent twice
    assert out["sent"] + out["duplicate"] == 6 and out["pending"] == 0, out
    assert all(real.get(k).state is State.SENT for k in unrecorded)  # type: ignore[union-attr]


def test_a_stale_copy_of_a_pass_parks_its_sends_and_the_pass_with_their_verdicts_records_them_sent(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The flake of tests/integration/test_chain_ownership.py (issue 23, case 2), step by step: the first pass
    # sends and cannot record (the ledger is down) and hands its verdicts on; its worker's pool child is killed
    # (systemd's or a test's SIGTERM to the whole process group) after that retry was published and before its
    # message was acked, so the broker hands the first pass out again, with none of that state. The leases ran
    # out meanwhile (nothing renews them while the ledger is down): that copy takes the claims over as a crash
    # and, the provider keeping no key, parks them for review. Before: the pass carrying the verdicts then
    # counted them "duplicate" and left them in review for an operator, though it knew they were sent (the
    # integration test saw "sent 0, duplicate 3, ..." with "review: 37" cut off). Now it records them sent.
    monkeypatch.setattr("idemmail_celery.handler.time.sleep", lambda s: None)
    app, campaign = campaign_app(tmp_path, "s", "bulk-stale-copy")
    app.conf.idemmail_lease_seconds = 0.3
    sender = app.tasks["idemmail_celery.send_email"]
    monkeypatch.setattr(sender, "carries_key", lambda: False)  # as SMTP: a resend would go out again
    monkeypatch.setattr(sender, "reconcile", lambda key, payload: None)  # and nothing to search
    real = sender.ledger
    people = [f"r{i}@example.com" for i in range(5)]
    call = {"campaign_id": "c-stale", "subject": "Hi", "text": "x", "recipients": people}
    keys = [sender.intent_key(to=to, subject="Hi", text="x", event_id="c-stale") for to in people]
    sender._idem_ledger = RecordsLate(real, {k: 4 for k in keys[1:]})  # r0 recorded; r1..r4 sent, not recorded
    deliver = sender.deliver
    sends: list[str] = []

    def counted(kwargs: dict[str, Any], key: str) -> Any:
        sends.append(kwargs["to"])
        return deliver(kwargs, key)

    monkeypatch.setattr(sender, "deliver", counted)
    from idemmail_celery import bulk

    retried = bulk._next_pass  # where a pass hands on to the next
    stale: list[Any] = []

    def redelivered_then_retry(*args: Any, **kwargs: Any) -> Any:
        if not stale:  # the first pass's message, handed out again once its leases ran out
            ends = [r.lease_expires_at or 0.0 for r in (real.get(k) for k in keys[1:]) if r is not None]
            threading.Event().wait(max([0.0, *(t - time.time() for t in ends)]) + 0.05)  # time.sleep is a no-op
            stale.append(campaign.apply(kwargs=call).get())
        return retried(*args, **kwargs)

    monkeypatch.setattr(bulk, "_next_pass", redelivered_then_retry)
    out = campaign.apply(kwargs=call).get()
    assert sorted(sends) == sorted(people)  # everyone once: the stale copy sent nobody again
    assert stale[0]["review"] == 4 and stale[0]["duplicate"] == 1  # it could not know
    assert (out["sent"], out["duplicate"], out["review"], out["pending"]) == (4, 1, 0, 0), out
    for key in keys:
        record = real.get(key)
        assert record is not None and record.state is State.SENT, record


def rotating_recipients(n: int, prefix: str) -> tuple[list[Delivery], list[Delivery]]:
    """One campaign's recipients as a worker still on secrets [old, new] makes them (claimed under the old
    key, the new one looked up) and as one already on [new, old] does: phase 2 of a rotation, half-way
    through its rolling restart, with two copies of the campaign running."""
    ds = recipients(n, prefix)
    return ([replace(d, key=f"{prefix}-old-{i}", older_keys=(f"{prefix}-new-{i}",)) for i, d in enumerate(ds)],
            [replace(d, key=f"{prefix}-new-{i}", older_keys=(f"{prefix}-old-{i}",)) for i, d in enumerate(ds)])


def test_two_copies_of_a_campaign_on_workers_of_both_rotation_phases_send_each_recipient_once(ledger: Ledger) -> None:
    """The other copy looks up, claims and sends the whole batch between this copy's look-ups and its batch
    claim: both looked and found nothing. Before the re-read after the claim, both sent every recipient."""
    on_old, on_new = rotating_recipients(5, "br1")
    box = Mailbox()
    other, _ = build(ledger, box)
    theirs: list[Any] = []
    handler, _ = build(Lockstep(ledger, "br1-new-4", lambda: theirs.append(
        send_batch(other, on_new, owner="camp-b:1"))), box)
    batch = send_batch(handler, on_old, owner="camp-a:1")
    assert theirs[0].tally() == Counter({Outcome.SENT: 5})
    assert batch.tally() == Counter({Outcome.PENDING: 5})  # withdrawn, left for the next pass as busy ones are
    assert {s.outcome for s in batch.steps} == {Outcome.IN_FLIGHT} and sorted(k for k, _ in box.sent) == [
        f"br1-new-{i}" for i in range(5)]
    assert all(ledger.get(d.key) is None for d in on_old)  # no trace of the withdrawn claims
    again = send_batch(handler, [replace(d, resume_owners=("camp-a:1",), retries=1) for d in on_old], owner="camp-a:2")
    assert again.tally() == Counter({Outcome.DUPLICATE: 5}) and len(box.sent) == 5


def test_two_campaign_copies_in_lockstep_across_rotation_phases_withdraw_where_they_meet_and_send_once(
        ledger: Ledger) -> None:
    """Both copies look up, both claim the batch, then re-read recipient by recipient: this copy meets the
    other's claims and withdraws; the other then re-reads, meets only this copy's last claim, and both
    withdraw that one. The next passes send it once and replay the rest: five sends for five recipients."""
    on_old, on_new = rotating_recipients(5, "br2")
    box = Mailbox()
    other, _ = build(ledger, box)
    theirs: dict[str, Any] = {}

    def their_lookups_and_claim() -> None:  # after this copy's look-ups, before its batch claim
        theirs["ds"] = ds = [other.recorded_key(d) for d in on_new]
        theirs["claims"] = ledger.claim_many([other.request(d, "camp-b:1") for d in ds])

    def their_rereads() -> None:  # this copy is re-reading its last recipient: the other settles its batch
        theirs["steps"] = [other.settle(d, c) for d, c in zip(theirs["ds"], theirs["claims"], strict=True)]

    handler, _ = build(Lockstep(ledger, "br2-new-4", their_lookups_and_claim, their_rereads), box)
    batch = send_batch(handler, on_old, owner="camp-a:1")
    assert batch.tally() == Counter({Outcome.PENDING: 5})
    assert [s.outcome for s in theirs["steps"]] == [Outcome.SENT] * 4 + [Outcome.IN_FLIGHT]
    assert sorted(k for k, _ in box.sent) == [f"br2-new-{i}" for i in range(4)]
    assert ledger.get("br2-old-4") is None and ledger.get("br2-new-4") is None  # both withdrew where they met
    mine = send_batch(handler, [replace(d, resume_owners=("camp-a:1",), retries=1) for d in on_old], owner="camp-a:2")
    later = send_batch(other, [replace(d, resume_owners=("camp-b:1",), retries=1) for d in on_new], owner="camp-b:2")
    assert mine.tally() == Counter({Outcome.DUPLICATE: 4, Outcome.SENT: 1})
    assert later.tally() == Counter({Outcome.DUPLICATE: 5})
    assert sorted(k for k, _ in box.sent) == sorted([f"br2-new-{i}" for i in range(4)] + ["br2-old-4"])


def test_a_verdict_whose_recipient_another_holder_took_over_stays_to_record(ledger: Ledger) -> None:
    """Found by the simulator (sim/traces/campaign_verdict_dropped_on_a_busy_claim_sends_twice.json): a pass sent
    a recipient with an ambiguous answer and could not park it (its verdict travels on); another copy of the
    campaign took the claim over and died; the next pass found the claim busy and dropped the verdict while it
    still carried the first pass's owner, so a later pass took the claim over, found the first pass's own mark
    void, and sent the recipient again. A verdict is kept until its recipient is settled."""
    from idemmail_celery.errors import AmbiguousSendError

    refusing = Refusing(ledger)
    handler, box = build(refusing, Mailbox(ahead=True), lease_seconds=0.2)
    ds = recipients(1, "b9")
    first = new_owner("camp-first")
    box.fail_with = AmbiguousSendError("the reply never came", reason="timeout")
    refusing.down.add("review")
    sent = send_batch(handler, ds, owner=first)
    assert sent.outcomes() == [Outcome.PENDING] and len(box.sent) == 0 and set(sent.verdicts()) == {ds[0].key}
    refusing.down.clear()
    time.sleep(0.35)
    taken = ledger.claim(ClaimRequest(key=ds[0].key, task_name="tests.mail", payload=ds[0].payload.to_json(),
                                      fingerprint="", owner=new_owner("other-copy"), writes_ahead=True,
                                      lease_seconds=30))
    assert taken.status is ClaimStatus.RECLAIMED  # the other copy holds it (and will die)
    verdict = sent.verdicts()[ds[0].key]
    again = [replace(ds[0], resume_owners=tuple(verdict["owner"]), verdict=Verdict.from_header(verdict), retries=1)]
    busy = send_batch(handler, again, owner=new_owner("camp-next"))
    assert busy.outcomes() == [Outcome.PENDING]
    assert ds[0].key not in busy.settled_keys()  # its verdict is carried on, not dropped


def test_a_message_in_a_newer_header_format_waits_as_it_came_for_a_worker_that_reads_it(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Every message says the header format it was written in, sealed with the rest. A worker of this release
    meeting a newer format (a rolling upgrade, the new release's web processes first) neither guesses at it nor
    drops it: the message is requeued exactly as it came (its seal intact), nothing is claimed or sent, and the
    fix is said at ERROR once. The same message in this release's format sends."""
    from celery.exceptions import Retry

    from idemmail_celery.chain import FORMAT_HEADER, HEADER_FORMAT, KEY_MARK_HEADER, ChainState

    app, _ = campaign_app(tmp_path, "a-secret", "format-newer")
    send = app.tasks["idemmail_celery.send_email"]
    call = {"to": "ann@example.com", "subject": "Hi", "text": "x", "event_id": "e-format"}
    headers = send.intent_headers((), call)
    assert headers[FORMAT_HEADER] == HEADER_FORMAT and ChainState.from_headers(headers).readable
    newer = {k: v for k, v in headers.items() if k != KEY_MARK_HEADER} | {FORMAT_HEADER: "2"}
    newer[KEY_MARK_HEADER] = send.key_builder.seal(newer, Payload([], call))
    with caplog.at_level(logging.ERROR, logger="idemmail_celery"):
        out = send.apply(kwargs=call, headers=newer)
    assert out.state == "RETRY" and isinstance(out.result, Retry), out.result
    assert any("header format '2' is newer than this worker reads" in r.message for r in caplog.records)
    assert send.ledger.get(headers["idempotency_key"]) is None  # nothing claimed
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # nothing sent
    done = send.apply(kwargs=call, headers=headers).get()
    assert done["status"] == "sent" and len(list((tmp_path / "out").iterdir())) == 1
