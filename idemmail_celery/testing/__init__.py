"""Test helpers for code that sends email through idemmail-celery: fake servers on loopback (docs/testing.md).
"""

from __future__ import annotations

from .fake_api import FakeAPI
from .fake_provider import DEFAULT_API_KEY, FAULT_KINDS, Attempt, Delivery, FakeProvider

__all__ = ["DEFAULT_API_KEY", "FAULT_KINDS", "Attempt", "Delivery", "FakeAPI", "FakeProvider"]
