"""pytest fixtures for idemmail-celery users: a pytest plugin, loaded wherever the package is installed.

The package registers this module under the ``pytest11`` entry point of the same name, so
the fixtures need no ``conftest.py`` line::

    def test_receipt_is_sent_once(fake_provider):
        provider = HTTPProvider(fake_provider.url, api_key=fake_provider.api_key)
        ...
        assert fake_provider.delivery_count() == 1

A ``conftest.py`` that also lists ``pytest_plugins = ["idemmail_celery.testing.fixtures"]``
gets the same plugin, not a second one; ``-p no:idemmail_celery.testing.fixtures`` turns it
off. Beside Celery's ``celery.contrib.pytest``: see docs/testing.md.

This is the only module of the package that imports pytest, and nothing else
imports it: pytest stays a test-time dependency.
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
