"""The provider contract (docs/architecture.md, "A provider"): :class:`Provider`, :class:`SendResult`, and helpers
every provider needs: :func:`about_to_send` (the write-ahead mark), :func:`is_loopback` (the only hosts plain-text
credentials may reach) and :func:`first_time` (errors logged once per process).
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
        """The message tagged with ``key``, where the provider can be searched; None is no proof of absence."""
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
