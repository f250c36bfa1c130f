"""Email providers, chosen by URL like ledgers and kombu transports.

=====================  =====================================  ======================
URL                    provider                               de-duplicates on key
=====================  =====================================  ======================
``https://host/path``  Resend-compatible HTTP API             yes (Idempotency-Key)
``resend://``          the same, at Resend's API
``smtp://``,           SMTP (STARTTLS with ``?starttls=1``),  no: Message-ID from the
``smtps://``           with ``smtplib``                       key; crash after DATA
                                                              -> review
``console://``         prints each message (development)      n/a
``file:///dir``        one ``.eml`` per message, named by key  yes (one file per key)
``postmark://``        Postmark ``POST /email``               no: tagged with the key;
                                                              searched by metadata
``sendgrid://``        SendGrid v3 ``/v3/mail/send``          no: tagged with the key;
                                                              Email Activity search
``ses://REGION``       Amazon SES v2, SigV4-signed            no: tagged with the key;
                                                              events via SNS webhook
=====================  =====================================  ======================

API keys never go inside URLs: pass ``api_key=`` (``idemmail_provider_api_key``)
or set the environment variable the provider names.
"""

from __future__ import annotations

from typing import Any

from .._registry import load, scheme_of
from ..errors import ConfigurationError
from .base import Provider, SendResult

__all__ = ["Provider", "SendResult", "backend_for", "from_url", "register_provider"]

_PROVIDERS: dict[str, str] = {
    "https": "idemmail_celery.providers.http:HTTPProvider",
    "http": "idemmail_celery.providers.http:HTTPProvider",
    "resend": "idemmail_celery.providers.http:HTTPProvider",
    "smtp": "idemmail_celery.providers.smtp:SMTPProvider",
    "smtps": "idemmail_celery.providers.smtp:SMTPProvider",
    "console": "idemmail_celery.providers.console:ConsoleProvider",
    "file": "idemmail_celery.providers.console:FileProvider",
    "postmark": "idemmail_celery.providers.postmark:PostmarkProvider",
    "sendgrid": "idemmail_celery.providers.sendgrid:SendGridProvider",
    "ses": "idemmail_celery.providers.ses:SESProvider",
}


def register_provider(scheme: str, target: str) -> None:
    """Serve URLs starting ``scheme://`` with ``"module:Class"``."""
    _PROVIDERS[scheme.lower()] = target


def backend_for(url: str) -> type[Provider]:
    """The provider class for ``url``, without connecting."""
    scheme = scheme_of(url, "provider")
    target = _PROVIDERS.get(scheme)
    if target is None:
        raise ConfigurationError(f"no email provider for {scheme}:// (known: {', '.join(sorted(_PROVIDERS))})")
    cls: type[Provider] = load(target, Provider)
    return cls


def from_url(url: str, **options: Any) -> Provider:
    """Build the provider for ``url`` (``api_key=``, ``timeout=`` and provider options)."""
    backend: Any = backend_for(url)
    provider: Provider = backend(url, **options)
    return provider
