"""The app's configuration: what happens when Django starts."""

from __future__ import annotations

from django.apps import AppConfig


class IdemmailConfig(AppConfig):
    """``idemmail_celery.contrib.django``: label ``idemmail``."""

    name = "idemmail_celery.contrib.django"
    label = "idemmail"
    verbose_name = "Email intents (idemmail)"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks, conf, tasks  # noqa: F401  (checks register themselves; tasks register on every app)

        conf.apply_plain_settings()
        app = conf.remember_app()
        if app is not None:
            tasks.register_relay_task(app)
