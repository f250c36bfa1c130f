"""The tasks a Django project gets: imported when Django starts (and by ``app.autodiscover_tasks()``).

``send_email`` and ``send_campaign`` are Celery shared tasks: importing them here registers them on
every app, so ``from idemmail_celery import send_email`` in a view and
``app.tasks["idemmail_celery.send_email"]`` both find them. The outbox relay is registered on the
project's app only (:func:`register_relay_task`, called when Django starts): schedule
``idemmail_celery.outbox_relay`` on beat; it drains ``idemmail_outbox_url``, else the database
Django writes the outbox model to.
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
    """The relay task on ``app`` alone, not a shared task: another app in the process (one that calls
    :func:`idemmail_celery.outbox.register_relay` for its own database) keeps its own relay."""

    def outbox_relay() -> int:
        return run_relay(app, outbox_url(app.conf))

    outbox_relay.__doc__ = "Publish committed outbox rows to the broker (idemmail_celery.outbox.drain)."
    task: Task = app.task(name=RELAY_TASK, shared=False, ignore_result=True)(outbox_relay)
    return task
