"""Test helpers for code that sends email through idemmail-celery.

:class:`FakeProvider` is a real HTTP server on loopback speaking the
Resend-compatible API, with idempotency keys, delivery counts and fault
injection, so a test can prove "one delivery per intent" over real sockets; :class:`FakeAPI`
records every POST for any other side effect (a CRM, Slack). ``python -m
idemmail_celery.testing`` runs the fake provider as a server of its own (a mail catcher).
pytest loads the fixtures (:mod:`.fixtures`) by itself wherever the package is installed
(a ``pytest11`` entry point).
"""

from __future__ import annotations

from .fake_api import FakeAPI
from .fake_provider import DEFAULT_API_KEY, FAULT_KINDS, Attempt, Delivery, FakeProvider

__all__ = ["DEFAULT_API_KEY", "FAULT_KINDS", "Attempt", "Delivery", "FakeAPI", "FakeProvider"]
