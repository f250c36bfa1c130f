# examples/django_shop/settings.py
import os
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

import django

BASE_DIR = Path(__file__).resolve().parent


def database(url: str) -> dict[str, object]:
    """``postgresql://user@host:5432/shop?options=...`` or ``sqlite:////path/shop.sqlite3`` as Django's dict."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": unquote(parts.path[1:])}
    return {"ENGINE": "django.db.backends.postgresql", "NAME": parts.path[1:], "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""), "HOST": parts.hostname or "", "PORT": parts.port or "",
            "OPTIONS": dict(parse_qsl(parts.query))}


SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-insecure-only-for-this-example")
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "idemmail_celery.contrib.django",  # settings, checks, send_email, the outbox model, the review queue
    "examples.django_shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "examples.django_shop.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
DATABASES = {"default": database(os.environ.get("SHOP_DATABASE_URL", f"sqlite:///{BASE_DIR / 'shop.sqlite3'}"))}
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"

# Django's email (send_mail, EmailMessage.send(), PasswordResetView) through send_email, once per intent:
# MAILERS from Django 6.1 on (which deprecates EMAIL_BACKEND), EMAIL_BACKEND before it.
if django.VERSION >= (6, 1):
    MAILERS = {"default": {"BACKEND": "idemmail_celery.contrib.django.EmailBackend"}}
else:
    EMAIL_BACKEND = "idemmail_celery.contrib.django.EmailBackend"
DEFAULT_FROM_EMAIL = "Shop <shop@example.com>"

# Celery, read by app.config_from_object("django.conf:settings", namespace="CELERY").
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", CELERY_BROKER_URL)
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_TASK_DEFAULT_QUEUE", "celery")
CELERY_BEAT_SCHEDULE = {  # the outbox relay: publishes committed rows
    "idemmail-outbox": {"task": "idemmail_celery.outbox_relay", "schedule": 2.0, "options": {"expires": 10}},
}

# idemmail-celery: CELERY_IDEMMAIL_<SETTING> like any Celery setting, or plain IDEMMAIL_<SETTING>.
CELERY_IDEMMAIL_LEDGER_URL = os.environ.get("SHOP_LEDGER_URL", "redis://127.0.0.1:6379/1")
CELERY_IDEMMAIL_LEDGER_OPTIONS = {"prefix": os.environ.get("SHOP_LEDGER_PREFIX", "shop")}
IDEMMAIL_KEY_SECRET = os.environ.get("SHOP_KEY_SECRET")  # from your secret store; `manage.py check` says if unset
IDEMMAIL_PROVIDER_URL = os.environ.get("SHOP_PROVIDER_URL", "console://")
IDEMMAIL_PROVIDER_API_KEY = os.environ.get("SHOP_PROVIDER_API_KEY")
IDEMMAIL_DEFAULT_FROM = "Shop <shop@example.com>"
