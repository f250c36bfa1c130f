"""Shared plumbing: the broker's visibility timeout every countdown of the library stays below."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from idemmail_celery._common import transport_visibility_timeout


@pytest.mark.parametrize(("broker", "options", "expected"), [
    ("redis://127.0.0.1:6379/0", {}, 3600.0),          # kombu's Redis transport default
    ("rediss://127.0.0.1:6379/0", {"visibility_timeout": 10}, 10.0),
    ("sentinel://127.0.0.1:26379", {}, 3600.0),
    ("sqs://", {}, 1800.0),                              # kombu's SQS default: 30 minutes, not an hour
    ("sqs://", {"visibility_timeout": "45"}, 45.0),
    ("amqp://guest:guest@127.0.0.1:5672//", {"visibility_timeout": 10}, None),  # AMQP never redelivers a held one
    ("memory://", {}, None),
])
def test_the_visibility_timeout_is_read_per_transport_with_kombus_defaults(
    broker: str, options: dict[str, Any], expected: float | None
) -> None:
    app = Celery("vt", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = options
    assert transport_visibility_timeout(app) == expected
