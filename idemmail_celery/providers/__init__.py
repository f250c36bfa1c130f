"""Email providers, chosen by URL like ledgers and kombu transports; the table of them, and which de-duplicate on
the key: docs/providers.md. API keys never go inside URLs: pass ``api_key=`` or set the provider's variable.
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
