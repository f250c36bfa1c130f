"""The listing contract (the review queue's pages), every backend: Redis, PostgreSQL, MariaDB and SQLite, all real.

``list_records`` pages in the order records entered their state, by cursor or by offset; ``summarize`` counts by
reason and by task. Each backend answers in its store (Redis: the per-state indexes and the listing script; SQL:
keyset pages on the listing index); the answers must be the ones a brute-force read of every record gives.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from idemmail_celery.keys import Payload
from idemmail_celery.ledger import ClaimRequest, Ledger, Record, State
from idemmail_celery.ledger.listing import (
    Position,
    RecordQuery,
    Summary,
    decode_cursor,
    label_of,
    reason_of,
    select_in_memory,
)

from .conftest import BACKENDS, drop_ledger, make_ledger

TASKS = ("idemmail_celery.send_email", "shop.tasks.invoice")
REASONS = ("lease_expired", "after_data", "ledger_lost")


def key_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def payload(i: int) -> str:
    return Payload([], {"to": [f"ann{i}@Example{i % 3}.org", f"Bob <bob{i}@shop.test>"], "subject": f"Secret {i}",
                        "text": "Dear Ann", "event_id": f"order-{i}", "template": ("receipt", "welcome")[i % 2],
                        "tags": {"campaign": ("winter", "spring")[i % 2]}}).to_json()


def park(ledger: Ledger, keys: list[str], *, reason: Any = None, task: Any = None) -> None:
    """Claim and park ``keys`` in this order (record ``i`` gets reason ``reason(i)`` and task ``task(i)``)."""
    for start in range(0, len(keys), 100):
        batch = keys[start:start + 100]
        claims = ledger.claim_many([
            ClaimRequest(key=k, task_name=(task or (lambda i: TASKS[i % 2]))(start + n), payload=payload(start + n),
                         fingerprint="f" * 64) for n, k in enumerate(batch)])
        for n, (k, c) in enumerate(zip(batch, claims, strict=True)):
            why = (reason or (lambda i: REASONS[i % 3]))(start + n)
            ledger.park(k, c.token, {"type": "SendNeedsReview", "reason": why, "at": time.time(), "message": "m" * 90})


def retime(ledger: Ledger, key: str, at: float) -> Record:
    """Set a record's time (an operator's change keeps the one it is given): ties and old records on demand."""
    record = ledger.get(key)
    assert record is not None
    moved = replace(record, token=record.token + 1, updated_at=at)
    assert ledger._force(key, record.token, moved)
    return moved


def every_page(ledger: Ledger, query: RecordQuery, limit: int) -> list[str]:
    keys, cursor = [], None
    while True:
        page = ledger.list_records(query, cursor=cursor, limit=limit)
        keys += [r.key for r in page.records]
        assert len(page.records) <= limit
        if page.next_cursor is None:
            return keys
        assert len(page.records) == limit
        cursor = page.next_cursor


def brute(ledger: Ledger, query: RecordQuery) -> list[str]:
    """What a read of every record gives (the base class's own answer)."""
    return [r.key for _, r in select_in_memory(ledger.iter_records(), query, None, 0, time.time()).items]


@pytest.fixture(params=BACKENDS)
def ledger(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    led = make_ledger(request.param, tmp_path_factory)
    yield led
    drop_ledger(led)


def test_pages_walk_every_parked_record_once_in_the_order_it_was_parked(ledger: Ledger) -> None:
    keys = [key_of(f"order-{i}") for i in range(40)] + ["raw-key-not-hex"]
    park(ledger, keys)
    base = time.time() - 60
    for n, k in enumerate(keys[5:15]):  # ties: ten records parked at the same instant (order by key)
        retime(ledger, k, base + (n % 2))
    expected = brute(ledger, RecordQuery(state=State.REVIEW))
    assert sorted(expected) == sorted(keys)
    for newest in (False, True):
        query = RecordQuery(state=State.REVIEW, newest_first=newest)
        order = expected[::-1] if newest else expected
        assert every_page(ledger, query, 7) == order
        by_number = [r.key for p in range(6) for r in ledger.list_records(query, offset=p * 7, limit=7).records]
        assert by_number == order
    page = ledger.list_records(RecordQuery(state=State.REVIEW), limit=100)
    assert page.next_cursor is None and len(page.records) == len(keys)
    assert ledger.list_records(RecordQuery(state=State.REVIEW), offset=41).records == []


def test_a_cursor_stays_good_while_records_come_and_go(ledger: Ledger) -> None:
    keys = [key_of(f"come-go-{i}") for i in range(12)]
    park(ledger, keys)
    query = RecordQuery(state=State.REVIEW)
    first = ledger.list_records(query, limit=5)
    assert [r.key for r in first.records] == keys[:5]
    ledger.resolve(keys[6], "failed", note="gone while paging")  # one after the page leaves
    ledger.resolve(keys[2], "failed", note="one before the page leaves")
    park(ledger, [key_of("parked-later")])  # one joins at the end
    second = ledger.list_records(query, cursor=first.next_cursor, limit=5)
    assert [r.key for r in second.records] == [keys[5], *keys[7:11]]
    third = ledger.list_records(query, cursor=second.next_cursor, limit=5)
    assert [r.key for r in third.records] == [keys[11], key_of("parked-later")] and third.next_cursor is None


def test_filters_by_state_task_reason_and_time(ledger: Ledger) -> None:
    keys = [key_of(f"filter-{i}") for i in range(30)]
    park(ledger, keys)
    old = time.time() - 3 * 86400
    for k in keys[:4]:
        retime(ledger, k, old)
    c = ledger.claim(ClaimRequest(key="failed-one", task_name=TASKS[0], payload=payload(0), fingerprint="f"))
    ledger.fail("failed-one", c.token, {"reason": "rejected"})
    for query in (RecordQuery(state=State.REVIEW, task=TASKS[1]),
                  RecordQuery(state=State.REVIEW, reason="after_data"),
                  RecordQuery(state=State.REVIEW, reason="after_data", task=TASKS[0]),
                  RecordQuery(state=State.REVIEW, until=time.time() - 86400),
                  RecordQuery(state=State.REVIEW, since=time.time() - 86400, reason="lease_expired"),
                  RecordQuery(state=State.REVIEW, reason="no_such_reason"),
                  RecordQuery(state=State.FAILED),
                  RecordQuery(state=State.FAILED, reason="rejected"),
                  RecordQuery(reason="rejected"),
                  RecordQuery()):
        expected = brute(ledger, query)
        assert every_page(ledger, query, 4) == expected, query
        assert [r.key for r in ledger.list_records(query, offset=3, limit=4).records] == expected[3:7], query
        for r in ledger.list_records(query, limit=100).records:
            assert query.matches(r)
    assert every_page(ledger, RecordQuery(state=State.REVIEW, until=time.time() - 86400), 10) == sorted(keys[:4])
    assert every_page(ledger, RecordQuery(state=State.FAILED), 10) == ["failed-one"]
    assert len(every_page(ledger, RecordQuery(state=State.REVIEW, task=TASKS[1]), 10)) == 15


def test_a_search_finds_key_start_message_id_template_tag_event_and_domain_never_personal_text(ledger: Ledger) -> None:
    keys = [key_of(f"search-{i}") for i in range(9)]
    park(ledger, keys)
    ledger.resolve(keys[3], "sent", result={"message_id": "MSG-0xBEEF-7"}, note="found in the provider's log")

    def found(words: str, state: State | None = State.REVIEW) -> list[str]:
        return every_page(ledger, RecordQuery(state=state, search=words), 3)

    assert found(keys[4][:7]) == [keys[4]]  # the start of a key
    assert found(keys[4][1:12]) == []  # ... not its middle
    assert found("beef-7", State.SENT) == [keys[3]] and found("0xbeef", None) == [keys[3]]  # a message id
    assert found("order-5") == [keys[5]]  # the event id
    assert found("WELCOME") == [k for i, k in enumerate(keys) if i % 2 and i != 3]  # the template, any case
    assert found("campaign=spring example1.org") == [keys[1], keys[7]]  # a tag and a recipient's domain: both
    assert found("shop.test") == [k for i, k in enumerate(keys) if i != 3]  # every record has a bob@shop.test
    assert found("invoice") == [k for i, k in enumerate(keys) if i % 2 and i != 3]  # the task name
    for personal in ("ann4", "bob4@shop.test", "secret", "dear"):  # addresses, the subject, the body: never
        assert found(personal) == [], personal
    assert found('"order-5"') == [] and found("order-5\\") == []  # quotes and backslashes: raw text never matches
    assert found("ördér") == []


def test_a_summary_counts_by_reason_and_by_task(ledger: Ledger) -> None:
    keys = [key_of(f"summary-{i}") for i in range(24)]
    park(ledger, keys)
    retime(ledger, keys[0], time.time() - 3 * 86400)  # a record of another day
    records = list(ledger.iter_records(State.REVIEW))
    reasons = Counter(reason_of(r) for r in records)
    tasks = Counter(r.task_name for r in records)
    days = Counter(int(r.updated_at // 86400) for r in records)
    assert len(days) >= 2
    assert ledger.summarize(RecordQuery(state=State.REVIEW)) == Summary(24, dict(reasons), dict(tasks), dict(days))
    only = ledger.summarize(RecordQuery(state=State.REVIEW, reason="after_data", task=TASKS[0]))
    both = sum(1 for r in records if reason_of(r) == "after_data" and r.task_name == TASKS[0])
    assert only.total == both
    assert only.reasons == dict(Counter(reason_of(r) for r in records if r.task_name == TASKS[0]))
    assert only.tasks == dict(Counter(r.task_name for r in records if reason_of(r) == "after_data"))
    assert only.days == dict(Counter(int(r.updated_at // 86400) for r in records
                                     if reason_of(r) == "after_data" and r.task_name == TASKS[0]))
    assert ledger.summarize(RecordQuery(state=State.REVIEW, search="winter")).total in (None, 12)
    assert ledger.summarize(RecordQuery(state=State.FAILED)).total == 0
    assert ledger.summarize(RecordQuery(state=State.REVIEW, since=time.time() + 60)).total == 0


def test_a_cursor_is_for_its_own_order(ledger: Ledger) -> None:
    park(ledger, [key_of(f"order-cursor-{i}") for i in range(3)])
    page = ledger.list_records(RecordQuery(state=State.REVIEW), limit=1)
    assert page.next_cursor is not None
    with pytest.raises(ValueError, match="order"):
        ledger.list_records(RecordQuery(state=State.REVIEW, newest_first=True), cursor=page.next_cursor)
    for bad in ("", "x", "bm90IGpzb24", page.next_cursor[:-3]):
        with pytest.raises(ValueError):
            decode_cursor(bad or "=", RecordQuery())


def test_the_listing_answers_what_reading_every_record_answers(ledger: Ledger) -> None:
    """Random reasons, tasks, ties and queries over every backend: each page walk is the brute-force order."""
    rng = random.Random(32)
    keys = [key_of(f"random-{i}") for i in range(90)]
    park(ledger, keys, reason=lambda i: rng.choice(REASONS), task=lambda i: rng.choice(TASKS))
    base = time.time() - 1000
    for k in rng.sample(keys, 30):
        retime(ledger, k, base + rng.choice((0, 1, 2, 500)))
    for _ in range(12):
        query = RecordQuery(state=State.REVIEW, task=rng.choice(("", *TASKS)), reason=rng.choice(("", *REASONS)),
                            search=rng.choice(("", "order-1", "winter", "example2.org receipt", keys[7][:3])),
                            since=rng.choice((None, base + 1)), until=rng.choice((None, base + 400, time.time() + 1)),
                            newest_first=rng.random() < 0.5)
        expected = brute(ledger, query)
        assert every_page(ledger, query, rng.choice((1, 5, 13))) == expected, query
        offset = rng.randrange(0, 20)
        assert [r.key for r in ledger.list_records(query, offset=offset, limit=6).records] == \
            expected[offset:offset + 6], query
        summary = ledger.summarize(query)
        assert summary.total in (None, len(expected)) and (summary.total is not None or query.search), query


@pytest.mark.parametrize("backend", ["redis", "postgresql"])
def test_a_sealed_ledger_lists_and_filters_what_it_opens(backend: str,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    from cryptography.fernet import Fernet

    from idemmail_celery.ledger.sealed import SealedLedger

    led = make_ledger(backend, tmp_path_factory, payload_keys=[Fernet.generate_key().decode()])
    assert isinstance(led, SealedLedger)
    try:
        keys = [key_of(f"sealed-{i}") for i in range(9)]
        park(led, keys)
        raw = led.backend.get(keys[0])
        assert raw is not None and str(raw.payload).startswith("fernet:")  # the store holds nothing readable
        after_data = [k for i, k in enumerate(keys) if i % 3 == 1]
        assert every_page(led, RecordQuery(state=State.REVIEW, reason="after_data"), 2) == after_data
        assert every_page(led, RecordQuery(state=State.REVIEW, search="order-4 example1.org"), 2) == [keys[4]]
        assert [r.key for r in led.list_records(RecordQuery(state=State.REVIEW), offset=2, limit=3).records] == \
            keys[2:5]
        assert label_of(led.list_records(RecordQuery(state=State.REVIEW), limit=1).records[0]).template == "receipt"
        counted = led.summarize(RecordQuery(state=State.REVIEW, task=TASKS[0]))
        assert counted.total == 5 and counted.reasons is None and counted.tasks == {TASKS[0]: 5, TASKS[1]: 4}
        assert counted.days is not None and sum(counted.days.values()) == 5
        assert led.summarize(RecordQuery(state=State.REVIEW, reason="after_data")).total is None
    finally:
        drop_ledger(led.backend)


def test_a_label_says_which_send_without_personal_data() -> None:
    record = Record(key="k", task_name="t", state=State.REVIEW, token=1, owner="", lease_expires_at=None,
                    attempts=1, reclaims=0, payload=payload(4), fingerprint="f")
    label = label_of(record)
    assert str(label) == "receipt · order-4 · campaign=winter · @example1.org, @shop.test"
    assert "ann" not in str(label) and "bob" not in str(label) and "Secret" not in str(label)
    mailbox = Payload([], {"to": "x@y.org", "event_id": "signup-ann@example.com", "tags": {"who": "bob@b.org"}})
    assert "@example.com" not in str(label_of(replace(record, payload=mailbox.to_json())))  # scrubbed
    for empty in (None, "fernet:abc", "not json", Payload(["ann@x.org"], {}).to_json()):
        assert str(label_of(replace(record, payload=empty))) == ""


def test_positions_order_as_the_stores_do() -> None:
    assert Position(1.0, "b") < Position(1.0, "c") < Position(2.0, "a")


def test_long_task_names_errors_and_results_are_read_whole(ledger: Ledger) -> None:
    """A store reads a record's task, error and result in chunks: one longer than it reads at first is read whole."""
    task = "shop." + "very_long_module_name." * 8 + "send"  # 181 characters
    c = ledger.claim(ClaimRequest(key="long-one", task_name=task, payload=payload(1), fingerprint="f"))
    ledger.park("long-one", c.token, {"type": "SendNeedsReview", "message": "x" * 600, "reason": "zz_last_field"})
    c = ledger.claim(ClaimRequest(key="long-two", task_name=task, payload=payload(2), fingerprint="f"))
    ledger._finish("long-two", c.token, State.FAILED, result={"message_id": "m" * 300 + "-tail"},
                   error={"message": "y" * 600, "reason": "zz_failed"})
    park(ledger, [key_of("short-one")])
    assert every_page(ledger, RecordQuery(state=State.REVIEW, task=task), 5) == ["long-one"]
    assert every_page(ledger, RecordQuery(state=State.REVIEW, reason="zz_last_field"), 5) == ["long-one"]
    assert every_page(ledger, RecordQuery(state=State.FAILED, search="mmm-tail", reason="zz_failed"), 5) == ["long-two"]
    counted = ledger.summarize(RecordQuery(state=State.REVIEW))
    assert counted.reasons == {"zz_last_field": 1, "lease_expired": 1} and counted.tasks == {task: 1, TASKS[0]: 1}
    assert ledger.summarize(RecordQuery(state=State.FAILED)).reasons == {"zz_failed": 1}


def test_a_reason_is_the_errors_own_never_one_inside_a_nested_object_or_a_message(ledger: Ledger) -> None:
    """The Redis script reads a plain error's reason off its text; nesting, escapes and a reason that is no string
    are decoded, so a ``"reason":"..."`` inside a detail or a message is never taken for the record's."""
    errors = {"nested": {"details": {"reason": "inner"}, "reason": "outer"},
              "quoted": {"message": 'the provider said "reason":"fake"', "reason": "real"},
              "number": {"reason": 5, "type": "SendNeedsReview"},
              "plain": {"at": 1.5, "message": "m", "reason": "plain_one", "type": "SendNeedsReview"}}
    for name, error in errors.items():
        c = ledger.claim(ClaimRequest(key=f"why-{name}", task_name=TASKS[0], payload=payload(1), fingerprint="f"))
        ledger.park(f"why-{name}", c.token, error)
    assert ledger.summarize(RecordQuery(state=State.REVIEW)).reasons == {"outer": 1, "real": 1, "": 1, "plain_one": 1}
    for reason, key in (("outer", "why-nested"), ("real", "why-quoted"), ("plain_one", "why-plain")):
        assert every_page(ledger, RecordQuery(state=State.REVIEW, reason=reason), 5) == [key]
    for reason in ("inner", "fake", "5"):
        assert every_page(ledger, RecordQuery(state=State.REVIEW, reason=reason), 5) == []
