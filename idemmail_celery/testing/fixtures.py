"""pytest fixtures for idemmail-celery users, loaded through the ``pytest11`` entry point (docs/testing.md).

The only module of the package that imports pytest, and nothing imports it: pytest stays a test-time dependency.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .fake_provider import FakeProvider

__all__ = ["fake_provider"]


@pytest.fixture
def fake_provider() -> Iterator[FakeProvider]:
    """A :class:`FakeProvider` listening on 127.0.0.1 for one test, stopped afterwards whatever happens."""
    fake = FakeProvider().start()
    try:
        yield fake
    finally:
        fake.stop()
