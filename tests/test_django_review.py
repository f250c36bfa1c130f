"""The review queue's list parameters (``contrib.django.review``): a date the hierarchy cannot hold is a note on
the page, never an error (the admin's list view answered these with a 500)."""

from __future__ import annotations

import datetime as dt

import pytest

from idemmail_celery.contrib.django.review import DATE_PARTS, MAX_PAGE, PER_PAGE, ListRequest

NOT_A_DATE = "the date: not a date, left out"


@pytest.mark.parametrize("parts", [("9999",), ("9999", "12"), ("9999", "12", "31"), ("0", "1", "1"),
                                   ("2026", "2", "30"), ("99999999999999999999",)])
def test_a_date_whose_range_python_cannot_hold_is_left_out_with_a_note(parts: tuple[str, ...]) -> None:
    asked = ListRequest.parse({**dict(zip(DATE_PARTS, parts, strict=False)), "task": "t"}, now=0.0)
    assert asked.problems == [NOT_A_DATE]
    assert asked.params == {"task": "t"}  # the other filters stay
    assert asked.query.since is None and asked.query.until is None


@pytest.mark.parametrize("digit", ["²", "2⁰2⁶"])
def test_a_year_of_digits_int_does_not_take_is_left_out_with_a_note(digit: str) -> None:
    asked = ListRequest.parse({"updated__year": digit, "updated__month": "1"}, now=0.0)
    assert asked.problems == [f"updated__year {digit!r}: left out"] and asked.params == {}


def test_the_last_dates_that_end_in_range_still_filter() -> None:
    utc = dt.timezone.utc
    day = ListRequest.parse({"updated__year": "9999", "updated__month": "12", "updated__day": "30"}, now=0.0)
    assert day.problems == []
    assert (day.query.since, day.query.until) == (dt.datetime(9999, 12, 30, tzinfo=utc).timestamp(),
                                                  dt.datetime(9999, 12, 31, tzinfo=utc).timestamp())
    month = ListRequest.parse({"updated__year": "9999", "updated__month": "11"}, now=0.0)
    assert month.query.until == dt.datetime(9999, 12, 1, tzinfo=utc).timestamp()
    year = ListRequest.parse({"updated__year": "9998"}, now=0.0)
    assert year.query.until == dt.datetime(9999, 1, 1, tzinfo=utc).timestamp()


def test_a_page_number_past_any_queue_stays_one_every_store_can_skip_to() -> None:
    """``?p=`` with more digits than a 64-bit integer holds: SQLite raised OverflowError and Redis an error reply
    (HTTP 500); PostgreSQL's "bigint out of range" showed as an unreachable ledger."""
    assert ListRequest.parse({"p": "1" + "0" * 22}, now=0.0).page == MAX_PAGE
    assert (MAX_PAGE - 1) * PER_PAGE < 2**63
    assert ListRequest.parse({"p": "7"}, now=0.0).page == 7
