"""The outbox table as a Django model (read-only: written by :func:`.outbox.enqueue`, changed by the relay), column
for column :func:`idemmail_celery.outbox.outbox_table`, timestamps naive UTC as the relay writes them; and the review
queue's page in the admin.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db import models

from ...outbox import DEFAULT_TABLE, DISPATCHED, PENDING


class UTCDateTimeField(models.DateTimeField):
    """A naive-UTC timestamp column (what the relay reads and writes), aware UTC in Python."""

    def db_type(self, connection: Any) -> str | None:
        if connection.vendor == "postgresql":
            return "timestamp"  # without time zone: the relay compares it with naive UTC
        return str(super().db_type(connection))

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> dt.datetime | None:
        if isinstance(value, str):
            value = dt.datetime.fromisoformat(value)
        if isinstance(value, dt.datetime) and value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        return value  # type: ignore[no-any-return]

    def get_db_prep_value(self, value: Any, connection: Any, prepared: bool = False) -> Any:
        if isinstance(value, dt.datetime) and value.tzinfo is not None:
            value = value.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return value


class OutboxRow(models.Model):
    """One task call waiting for (or past) the relay: ``idemmail_outbox``."""

    STATES = ((PENDING, PENDING), (DISPATCHED, DISPATCHED))

    id = models.BigAutoField(primary_key=True)
    intent_key = models.CharField(max_length=128)
    task_name = models.CharField(max_length=255)
    args = models.TextField()
    kwargs = models.TextField()
    headers = models.TextField()
    options = models.TextField()
    state = models.CharField(max_length=16, choices=STATES)
    attempts = models.IntegerField()
    next_attempt_at = UTCDateTimeField()
    created_at = UTCDateTimeField()
    dispatched_at = UTCDateTimeField(null=True)
    last_error = models.TextField(null=True)

    class Meta:
        db_table = DEFAULT_TABLE
        verbose_name = "outbox row"
        constraints = [models.UniqueConstraint(fields=["intent_key"], name=f"uq_{DEFAULT_TABLE}_intent_key")]
        indexes = [models.Index(fields=["state", "next_attempt_at"], name=f"ix_{DEFAULT_TABLE}_pending")]

    def __str__(self) -> str:
        return f"{self.task_name} {self.intent_key} ({self.state})"


class ReviewRecord(models.Model):
    """The review queue's admin page and its permissions (no table: the records are the ledger's)."""

    class Meta:
        managed = False
        db_table = "idemmail_review_unused"  # never created
        verbose_name = "ledger record"
        verbose_name_plural = "ledger records (review queue)"
        default_permissions = ("view",)
        permissions = [
            ("view_payload", "Can see a ledger record's stored payload (personal data)"),
            ("mark_sent", "Can mark a ledger record sent"),
            ("release", "Can release a ledger record for a resend"),
            ("mark_failed", "Can mark a ledger record failed"),
            ("forget_payload", "Can erase a ledger record's personal data"),
        ]
