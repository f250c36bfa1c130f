"""The tasks a Django project gets, registered when Django starts (and by ``app.autodiscover_tasks()``): the shared
tasks ``send_email`` and ``send_campaign``, and the outbox relay on the project's app only (docs/django.md, "The
Celery app and its tasks").
"""

from __future__ import annotations

from celery import Celery, Task
from django.db import router

from ...bulk import send_campaign
from ...config import Settings
from ...mail import send_email
from ...outbox import RELAY_TASK, run_relay
from .conf import sqlalchemy_url
from .models import OutboxRow

__all__ = ["outbox_url", "register_relay_task", "send_campaign", "send_email"]


def outbox_url(conf: object) -> str:
    """``idemmail_outbox_url``, else the SQLAlchemy URL of the database Django writes outbox rows to."""
    return Settings.resolve(conf).outbox_url or sqlalchemy_url(router.db_for_write(OutboxRow))


def register_relay_task(app: Celery) -> Task:
    """The relay task on ``app`` alone, not shared: another app in the process keeps its own relay
    (:func:`idemmail_celery.outbox.register_relay`, for its own database)."""

    def outbox_relay() -> int:
        """Publish committed outbox rows to the broker (idemmail_celery.outbox.drain)."""
        return run_relay(app, outbox_url(app.conf))

    task: Task = app.task(name=RELAY_TASK, shared=False, ignore_result=True)(outbox_relay)
    return task
