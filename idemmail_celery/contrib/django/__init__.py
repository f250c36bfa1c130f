"""idemmail-celery as a Django app: add ``"idemmail_celery.contrib.django"`` to ``INSTALLED_APPS``.

What it gives a Django project (app label ``idemmail``):

* **settings** from Django's: ``CELERY_IDEMMAIL_*`` through the usual
  ``app.config_from_object("django.conf:settings", namespace="CELERY")``, and plain
  ``IDEMMAIL_*`` settings, copied under the ``CELERY_`` name when that one is not set
  (:mod:`.conf`); system checks name each one that is missing or does not parse (:mod:`.checks`);
* **the tasks**: ``send_email``, ``send_campaign`` and the outbox relay registered on the project's
  Celery app when Django starts (and by ``app.autodiscover_tasks()``), see :mod:`.tasks`;
* **the outbox** as a model with migrations (:class:`.models.OutboxRow`, the table the relay drains)
  and :func:`.outbox.enqueue_email`, which writes through Django's connection in the caller's
  ``transaction.atomic()``;
* **the review queue** in the Django admin, for every ledger backend (:mod:`.admin`);
* **Django's email** through ``send_email``: ``EMAIL_BACKEND = "idemmail_celery.contrib.django.EmailBackend"``
  (:mod:`.mail`).

Django itself is imported only inside this package: the core never imports it.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    # Imported on first use: the package itself loads before Django's app registry is ready.
    if name == "EmailBackend":
        from .mail import EmailBackend

        return EmailBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
