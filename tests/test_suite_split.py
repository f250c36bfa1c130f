"""The split between ``make check`` and ``make test``: a test that needs a process of its own is marked
``worker`` wherever it is collected, so the quick run never starts one (docs/development.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import INTEGRATION, WORKER_FIXTURES


def test_every_test_that_starts_a_worker_is_marked_and_no_other_is_marked_by_the_rule(
    request: pytest.FixtureRequest,
) -> None:
    items = request.session.items
    assert items, "run as part of a session"
    for item in items:
        starts_one = INTEGRATION in Path(str(item.path)).parents or bool(
            WORKER_FIXTURES & set(getattr(item, "fixturenames", ())))
        if starts_one:
            assert item.get_closest_marker("worker"), f"{item.nodeid} starts a worker and is not marked"
    assert INTEGRATION.is_dir() and any(INTEGRATION.glob("test_*.py"))


def test_every_fixture_the_rule_names_is_defined() -> None:
    sources = "\n".join(path.read_text() for path in Path(__file__).parent.rglob("*.py"))
    for name in WORKER_FIXTURES:
        assert f"def {name}(" in sources, f"WORKER_FIXTURES names {name}, which no test module defines"
