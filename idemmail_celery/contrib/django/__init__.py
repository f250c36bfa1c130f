"""idemmail-celery as a Django app (label ``idemmail``; add ``"idemmail_celery.contrib.django"`` to
``INSTALLED_APPS``): its settings, checks, tasks, outbox model, admin review queue and email backend, described in
docs/django.md. Django is imported only inside this package: the core never imports it.
"""

from typing import Any


def __getattr__(name: str) -> Any:  # on first use: this package loads before Django's app registry is ready
    if name == "EmailBackend":
        from .mail import EmailBackend

        return EmailBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
