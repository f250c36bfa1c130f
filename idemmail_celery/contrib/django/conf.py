"""The library's settings, read from Django's: ``CELERY_IDEMMAIL_X`` (through ``config_from_object``, like any
Celery setting) or plain ``IDEMMAIL_X``, copied to the ``CELERY_`` name when that is not set (docs/django.md).
What ``celery.py`` sets on ``app.conf`` wins over both; the environment variables are read last.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

from django.conf import settings as django_settings

from ...config import SETTINGS

NAMESPACE = "CELERY_"  # config_from_object's, which plain IDEMMAIL_* settings are copied under
#: The upper-case names a Django project may set, by ``app.conf`` name.
NAMES = {s.conf: s.conf.upper() for s in SETTINGS}
_UNSET = object()
_project_app: list[Any] = []


def remember_app() -> Any:
    """Keep (and return) the Celery app current when Django starts, the one ``proj/__init__.py`` imports; None if
    none is. ``celery.current_app`` is per thread: in a threaded server's request threads it is Celery's
    unconfigured fallback app, whose ledger and broker are not the project's."""
    from celery import current_app

    app = current_app._get_current_object()
    if app.main == "default":  # Celery's fallback, made when no app was current: not the project's
        return None
    _project_app[:] = [app]
    return app


def celery_app() -> Any:
    """The project's Celery app: the one current when Django started, else ``celery.current_app``."""
    if _project_app:
        return _project_app[0]
    from celery import current_app

    return current_app._get_current_object()


def django_names() -> list[str]:
    """Every ``IDEMMAIL_*`` and ``CELERY_IDEMMAIL_*`` name in Django's settings."""
    return sorted(n for n in dir(django_settings) if n.startswith(("IDEMMAIL_", NAMESPACE + "IDEMMAIL_")))


def apply_plain_settings() -> None:
    """Copy each plain ``IDEMMAIL_X`` Django setting to ``CELERY_IDEMMAIL_X`` unless that is set."""
    for upper in NAMES.values():
        value = getattr(django_settings, upper, _UNSET)
        if value is not _UNSET and getattr(django_settings, NAMESPACE + upper, _UNSET) is _UNSET:
            setattr(django_settings, NAMESPACE + upper, value)


class DjangoConf:
    """A read-only ``app.conf`` look-alike over Django's settings (what the system checks resolve), a Celery
    app's ``conf`` (values set in ``celery.py``) consulted first."""

    def __init__(self, app_conf: Any = None) -> None:
        self.app_conf = app_conf

    def get(self, name: str, default: Any = None) -> Any:
        upper = name.upper()  # CELERY_IDEMMAIL_X, then IDEMMAIL_X
        values = (self.app_conf.get(name) if self.app_conf is not None else None,
                  getattr(django_settings, NAMESPACE + upper, None), getattr(django_settings, upper, None))
        return next((value for value in values if value is not None), default)

    def __iter__(self) -> Iterator[str]:
        return iter(NAMES)


def sqlalchemy_url(alias: str = "default") -> str:
    """The SQLAlchemy URL of Django's database ``alias`` (PostgreSQL, MariaDB/MySQL, SQLite): where the
    relay reads the outbox when ``idemmail_outbox_url`` is not set. PostgreSQL ``OPTIONS`` pass on
    (``{"options": "-c search_path=shop"}``)."""
    db = django_settings.DATABASES[alias]
    engine = str(db["ENGINE"])
    if engine.endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    scheme = {"postgresql": "postgresql+psycopg", "mysql": "mysql+pymysql"}.get(engine.rsplit(".", 1)[-1])
    if scheme is None:
        raise ValueError(f"the outbox relay cannot read a {engine} database; set idemmail_outbox_url")
    user, password = (quote(str(db.get(part) or ""), safe="") for part in ("USER", "PASSWORD"))
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    port = f":{db['PORT']}" if db.get("PORT") else ""
    options = {k: v for k, v in (db.get("OPTIONS") or {}).items() if isinstance(v, (str, int))}
    query = f"?{urlencode(options)}" if options and scheme.startswith("postgresql") else ""
    return f"{scheme}://{auth}{db.get('HOST') or 'localhost'}{port}/{db['NAME']}{query}"
