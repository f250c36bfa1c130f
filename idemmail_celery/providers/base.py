"""The provider contract: how a message leaves, and what a failure means.

A provider sends one :class:`~idemmail_celery.email.EmailMessage` under one
intent key and returns a :class:`SendResult`, or raises one of the outcomes the
state machine understands (:mod:`idemmail_celery.errors`):

==========================  ===================================================
raise                       when
==========================  ===================================================
``TransientSendError``      nothing left the process (connect refused, 401/403,
                            429, provider still processing the same key)
``PermanentSendError``      the provider refused the message for good (400/422)
``AmbiguousSendError``      it may have been accepted (5xx, read timeout, a
                            connection dropped after the request was written)
``SendNeedsReview``         the provider holds something else under this key
==========================  ===================================================

``accepts_idempotency_key`` says whether the provider de-duplicates on the key:
when True, an ambiguous attempt is retried with the same key; when False it is
parked for review (or reconciled, where the provider can be asked).

``writes_ahead`` says that a provider without a key calls :func:`about_to_send` right before
the first byte that could make the message exist at the service (see :mod:`idemmail_celery._ahead`):
a worker killed before that point is then known to have sent nothing, and its intent is sent
again instead of being parked for review.

It also holds two helpers every kind of provider needs: :func:`is_loopback`
(plain-text transports are allowed to loopback hosts only) and
:func:`first_time` (for errors logged once per process, such as refused
credentials).
"""

from __future__ import annotations

import ipaddress
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from .._ahead import about_to_send
from .._common import after_fork
from ..email import EmailMessage

__all__ = ["Provider", "SendResult", "about_to_send", "first_time", "is_loopback"]


@dataclass(frozen=True)
class SendResult:
    """What the provider said: its message id, and whatever else is worth storing."""

    message_id: str
    provider: str
    request_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"message_id": self.message_id, "provider": self.provider}
        if self.request_id:
            out["request_id"] = self.request_id
        if self.extra:
            out["extra"] = self.extra
        return out


class Provider(ABC):
    """Base class of every email provider. One module per provider, chosen by URL scheme."""

    #: Short name, stored with results ("resend", "smtp", ...).
    name: str = "provider"
    #: True if the provider de-duplicates on the key we send it.
    accepts_idempotency_key: bool = False
    #: True if :meth:`send` calls :func:`about_to_send` before anything can reach the service.
    writes_ahead: bool = False

    @abstractmethod
    def send(self, message: EmailMessage, *, key: str) -> SendResult:
        """Send ``message`` once under ``key``; raise a ``SendError`` subclass on failure."""

    def find_sent(self, key: str) -> SendResult | None:
        """Ask the provider whether a message tagged with ``key`` exists.

        Providers without an idempotency key implement it where the provider can
        be searched; None means "not found or cannot ask" (not proof of absence).
        """
        return None

    def close(self) -> None:
        """Release connections."""
        return None


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses: the only hosts a secret may reach in clear text."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_logged: set[str] = set()
_logged_lock = threading.Lock()


def first_time(what: str) -> bool:
    """True the first time ``what`` is asked about in this process (a forked child starts afresh).

    For errors worth one line per process, such as rejected credentials: every send would
    otherwise repeat them.
    """
    with _logged_lock:
        if what in _logged:
            return False
        _logged.add(what)
        return True


@after_fork
def _forget_logged() -> None:
    global _logged_lock
    _logged.clear()
    _logged_lock = threading.Lock()  # a parent thread may have held it at fork()
