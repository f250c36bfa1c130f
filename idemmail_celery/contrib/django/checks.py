"""System checks (``manage.py check``, and every ``runserver``, ``migrate`` and Celery worker start): one message
per setting that is missing or wrong, each id (``idemmail.E001``...) in docs/django.md's table.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings
from django.core.checks import CheckMessage, Error, Warning, register

from ...config import SETTINGS, Settings, _refuse_unknown
from ...errors import ConfigurationError
from ...mail import build_provider
from ...outbox import DEFAULT_TABLE
from .conf import NAMES, NAMESPACE, DjangoConf, celery_app, django_names

_SECRET_HINT = ("Set IDEMMAIL_KEY_SECRET (or CELERY_IDEMMAIL_KEY_SECRET) in settings.py from your secret store, "
                "e.g. os.environ['IDEMMAIL_KEY_SECRET']; IDEMMAIL_ALLOW_PLAIN_KEYS = True accepts plain keys "
                "on purpose.")


@register("idemmail")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The library's settings as the project's Celery app will read them."""
    conf = DjangoConf(celery_app().conf)
    messages: list[CheckMessage] = [*_unknown_names(), *_conflicts()]
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        value = conf.get(setting.conf)
        if value is None or (isinstance(value, str) and not value.strip()):
            continue
        try:
            values[setting.conf] = setting.parse(NAMES[setting.conf], value)
        except ConfigurationError as exc:
            messages.append(Error(str(exc), id="idemmail.E002", obj=NAMES[setting.conf],
                                  hint="See the configuration reference (docs/configuration.md)."))
    try:
        resolved = Settings.resolve(values)
    except ConfigurationError:  # already reported above, by name
        return messages
    if not resolved.key_secrets and not resolved.allow_plain_keys:
        if resolved.ledger_url.startswith("sqlite"):
            messages.append(Warning("IDEMMAIL_KEY_SECRET is not set: intent keys are plain SHA-256 (the embedded "
                                    "SQLite ledger allows it, for development).", hint=_SECRET_HINT,
                                    id="idemmail.W001", obj="IDEMMAIL_KEY_SECRET"))
        else:
            messages.append(Error("IDEMMAIL_KEY_SECRET is not set: with a server ledger send_email refuses every "
                                  "call, since plain SHA-256 intent keys can be brute-forced back to guessable "
                                  "addresses and order ids.", hint=_SECRET_HINT, id="idemmail.E001",
                                  obj="IDEMMAIL_KEY_SECRET"))
    if resolved.outbox_table != DEFAULT_TABLE:
        messages.append(Error(
            f"IDEMMAIL_OUTBOX_TABLE is {resolved.outbox_table!r}, but the outbox model (and its migration) is the "
            f"table {DEFAULT_TABLE!r}: the relay would drain a table nothing writes to.",
            hint="Leave IDEMMAIL_OUTBOX_TABLE unset with this app.", id="idemmail.E004", obj="IDEMMAIL_OUTBOX_TABLE"))
    if resolved.provider_url:
        try:
            build_provider(resolved)
        except (ConfigurationError, ImportError) as exc:
            problem = str(exc) if isinstance(exc, ConfigurationError) else (
                f"idemmail_provider_url names a provider whose module cannot be imported ({exc})")
            messages.append(Error(problem, id="idemmail.E007", obj="IDEMMAIL_PROVIDER_URL",
                                  hint="See the providers page (docs/providers.md)."))
    else:
        messages.append(Warning("IDEMMAIL_PROVIDER_URL is not set: send_email has no provider to send through.",
                                hint="e.g. IDEMMAIL_PROVIDER_URL = 'resend://' (see docs/providers.md).",
                                id="idemmail.W003", obj="IDEMMAIL_PROVIDER_URL"))
    if not resolved.default_from:
        messages.append(Warning("IDEMMAIL_DEFAULT_FROM is not set: every send_email call must pass from_.",
                                hint="e.g. IDEMMAIL_DEFAULT_FROM = 'Shop <shop@example.com>'.",
                                id="idemmail.W002", obj="IDEMMAIL_DEFAULT_FROM"))
    return messages


def _unknown_names() -> list[CheckMessage]:
    out: list[CheckMessage] = []
    for name in django_names():
        try:
            _refuse_unknown([name.removeprefix(NAMESPACE).lower()])
        except ConfigurationError as exc:
            out.append(Error(f"{name}: {exc}", id="idemmail.E005", obj=name))
    return out


def _conflicts() -> list[CheckMessage]:
    missing = object()
    out: list[CheckMessage] = []
    for upper in NAMES.values():
        plain = getattr(django_settings, upper, missing)
        namespaced = getattr(django_settings, NAMESPACE + upper, missing)
        if plain is not missing and namespaced is not missing and plain != namespaced:
            out.append(Error(f"{upper} and {NAMESPACE}{upper} are both set, to different values",
                             hint="Keep one of them.", id="idemmail.E006", obj=upper))
    return out
