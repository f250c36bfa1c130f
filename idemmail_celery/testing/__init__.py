"""Test helpers for code that sends email through idemmail-celery.

:class:`FakeProvider` is a real HTTP server on loopback speaking the
Resend-compatible API, with idempotency keys, delivery counts and fault
injection, so a test can prove "one delivery per intent" over real sockets.
pytest users load the fixtures with
``pytest_plugins = ["idemmail_celery.testing.fixtures"]``.
"""

from __future__ import annotations

from .fake_provider import DEFAULT_API_KEY, FAULT_KINDS, Attempt, Delivery, FakeProvider

__all__ = ["DEFAULT_API_KEY", "FAULT_KINDS", "Attempt", "Delivery", "FakeProvider"]
