"""A real SMTP server for tests, with fault injection: :class:`SMTPSink` (its faults and options: docs/testing.md).

It records every message it accepts and can be told to misbehave on the next commands, so a test
can prove what a provider does when a server defers, refuses, or drops the connection after it has
the whole message.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import ssl
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, get_args

from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, AuthResult, Envelope, LoginPassword, Session, syntax

__all__ = ["AppliedFault", "FaultKind", "ReceivedMessage", "SMTPSink"]

FaultKind = Literal[
    "tempfail_mail", "reject_mail", "tempfail_rcpt", "reject_rcpt", "stall_rcpt", "tempfail_data_command",
    "reject_data_command", "tempfail_data", "reject_data", "drop_after_data", "stall_after_data", "slow_data",
]
_MAIL_FAULTS: dict[str, str] = {
    "tempfail_mail": "451 4.3.0 Sender temporarily refused (injected)",
    "reject_mail": "550 5.7.1 Sender rejected (injected)",
}
_RCPT_FAULTS: dict[str, str] = {
    "tempfail_rcpt": "450 4.2.1 Mailbox temporarily unavailable (injected)",
    "reject_rcpt": "550 5.1.1 No such user (injected)",
    "stall_rcpt": "",
}
_DATA_COMMAND_FAULTS: dict[str, str] = {
    "tempfail_data_command": "451 4.3.0 Not now (injected)",
    "reject_data_command": "554 5.5.0 Transaction refused (injected)",
}
_DATA_FAULTS: dict[str, str] = {
    "tempfail_data": "451 4.3.0 Try again later (injected)",
    "reject_data": "554 5.6.0 Message rejected (injected)",
    **dict.fromkeys(("drop_after_data", "stall_after_data", "slow_data"), ""),  # answered in handle_DATA
}


@dataclass(frozen=True)
class ReceivedMessage:
    """One message the sink took responsibility for."""

    mail_from: str
    rcpt_tos: tuple[str, ...]
    message_id: str | None
    raw: bytes
    #: False when the sink recorded it but never sent the final reply (drop/stall faults).
    acknowledged: bool = True
    #: The AUTH login the client used, if any.
    login: str | None = None


@dataclass(frozen=True)
class AppliedFault:
    """One fault that acted on a command."""

    kind: str
    #: When it acted (epoch seconds).
    at: float
    #: The Message-ID of the message it hit, for the faults that act once the data is in (``*_data``).
    message_id: str | None = None


class SMTPSink:
    """An SMTP server on 127.0.0.1, recording what it receives; ``with``, or :meth:`start` and :meth:`stop`.

    Thread-safe: the server runs in its own thread and event loop. ``port`` 0 picks a free one, kept
    across :meth:`stop`/:meth:`start`, so :attr:`url` stays valid while it is stopped.
    """

    def __init__(self, *, host: str = "127.0.0.1", credentials: tuple[str, str] | None = None,
                 ssl_context: ssl.SSLContext | None = None, implicit_tls: bool = False, slow_seconds: float = 1.0,
                 port: int = 0) -> None:
        if implicit_tls and ssl_context is None:
            raise ValueError("implicit_tls needs an ssl_context")
        self.host = host
        self.slow_seconds = slow_seconds
        self.implicit_tls = implicit_tls
        self._credentials = credentials
        self._ssl_context = ssl_context
        self._lock = threading.Lock()
        self._messages: list[ReceivedMessage] = []
        self._faults: list[list[Any]] = []  # [kind, remaining], in queue order
        self._applied: list[AppliedFault] = []
        self._controller: _Controller | None = None
        self._port: int | None = port or None

    # -- lifecycle --

    def start(self) -> SMTPSink:
        """Start listening; returns self. The port is chosen by the OS the first time."""
        if self._controller is not None:
            raise RuntimeError("SMTPSink already started")
        smtp_kwargs: dict[str, Any] = {"server_hostname": "sink.test", "ident": "idemmail SMTPSink"}
        if self._credentials is not None:
            smtp_kwargs.update(authenticator=self._authenticate, auth_require_tls=False)
        if self._ssl_context is not None and not self.implicit_tls:
            smtp_kwargs["tls_context"] = self._ssl_context
        controller = _Controller(_Handler(self), hostname=self.host, port=self._port or 0,
                                 ssl_context=self._ssl_context if self.implicit_tls else None, **smtp_kwargs)
        controller.start()
        self._controller = controller
        self._port = controller.port
        return self

    def stop(self) -> None:
        """Stop the server and drop open connections. Safe to call twice."""
        controller, self._controller = self._controller, None
        if controller is not None:
            controller.stop()

    def __enter__(self) -> SMTPSink:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("SMTPSink is not started")
        return self._port

    @property
    def url(self) -> str:
        """``smtp://127.0.0.1:PORT`` (``smtps://`` with ``implicit_tls``)."""
        return f"{'smtps' if self.implicit_tls else 'smtp'}://{self.host}:{self.port}"

    # -- what was received --

    def messages(self) -> list[ReceivedMessage]:
        """Every recorded message, oldest first (a copy)."""
        with self._lock:
            return list(self._messages)

    def count(self, message_id: str | None = None) -> int:
        """How many messages were recorded, or how many carried ``message_id`` (``<...>`` form)."""
        with self._lock:
            return sum(1 for m in self._messages if message_id is None or m.message_id == message_id)

    def applied(self) -> list[AppliedFault]:
        """Every fault that acted on a command, oldest first (a copy)."""
        with self._lock:
            return list(self._applied)

    def reset(self) -> None:
        """Forget recorded messages, pending faults and applied ones."""
        with self._lock:
            self._messages.clear()
            self._faults.clear()
            self._applied.clear()

    # -- faults --

    def fail_next(self, kind: FaultKind, times: int = 1) -> None:
        """Queue a fault for the next ``times`` commands it applies to (the faults: docs/testing.md)."""
        if kind not in get_args(FaultKind):
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(get_args(FaultKind))}")
        if times < 1:
            raise ValueError("times must be at least 1")
        with self._lock:
            self._faults.append([kind, times])

    def faults_left(self) -> int:
        """How many queued faults have not been applied yet (0: every ``fail_next`` has hit a command)."""
        with self._lock:
            return sum(times for _, times in self._faults)

    def _take_fault(self, kinds: dict[str, str], envelope: Envelope | None = None) -> str | None:
        """The first queued fault of ``kinds`` (None if none), taken off the queue and recorded as applied."""
        with self._lock:
            for entry in self._faults:
                if entry[0] in kinds:
                    entry[1] -= 1
                    if entry[1] == 0:
                        self._faults.remove(entry)
                    message_id = _message_id(envelope.original_content or b"") if envelope is not None else None
                    self._applied.append(AppliedFault(str(entry[0]), time.time(), message_id))
                    return str(entry[0])
        return None

    def _record(self, envelope: Envelope, session: Session, acknowledged: bool) -> int:
        raw = envelope.original_content or b""
        auth = session.auth_data
        login = auth.login.decode("utf-8", "replace") if isinstance(auth, LoginPassword) else None
        received = ReceivedMessage(envelope.mail_from or "", tuple(envelope.rcpt_tos), _message_id(raw), raw,
                                   acknowledged, login)
        with self._lock:
            self._messages.append(received)
            return len(self._messages)

    def _authenticate(self, server: SMTP, session: Session, envelope: Envelope, mechanism: str,
                      auth_data: Any) -> AuthResult:
        ok = (isinstance(auth_data, LoginPassword) and self._credentials is not None
              and (auth_data.login, auth_data.password) == tuple(c.encode() for c in self._credentials))
        return AuthResult(success=ok, handled=False, auth_data=auth_data if ok else None)


def _message_id(raw: bytes) -> str | None:
    """The Message-ID header of a raw message, or None."""
    value = email.parser.BytesHeaderParser(policy=email.policy.compat32).parsebytes(raw).get("Message-ID")
    return str(value).strip() if value is not None else None


class _Handler:
    """aiosmtpd hooks; runs in the sink's event loop thread."""

    def __init__(self, sink: SMTPSink) -> None:
        self.sink = sink

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                          mail_options: list[str]) -> str:
        fault = self.sink._take_fault(_MAIL_FAULTS)
        if fault is not None:
            return _MAIL_FAULTS[fault]
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 2.1.0 OK"

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope, address: str,
                          rcpt_options: list[str]) -> str:
        fault = self.sink._take_fault(_RCPT_FAULTS)
        if fault == "stall_rcpt":
            await asyncio.get_running_loop().create_future()  # never answered; cancelled when the client goes
        if fault is not None:
            return _RCPT_FAULTS[fault]
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        return "250 2.1.5 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        fault = self.sink._take_fault(_DATA_FAULTS, envelope)
        if fault in ("drop_after_data", "stall_after_data"):
            self.sink._record(envelope, session, acknowledged=False)
            if fault == "drop_after_data" and server.transport is not None:
                server.transport.close()
            # Never answer: closing the connection (ours or the client's) cancels this coroutine.
            await asyncio.get_running_loop().create_future()
        if fault is not None and fault != "slow_data":
            return _DATA_FAULTS[fault]
        n = self.sink._record(envelope, session, acknowledged=True)
        if fault == "slow_data":
            await asyncio.sleep(self.sink.slow_seconds)
        return f"250 2.0.0 OK: queued as SINK{n}"


class _SinkSMTP(SMTP):
    """aiosmtpd's server, with a fault hook on the DATA verb (aiosmtpd answers 354 itself)."""

    @syntax("DATA")
    async def smtp_DATA(self, arg: str) -> None:
        handler = self.event_handler
        if isinstance(handler, _Handler) and self.envelope is not None and self.envelope.rcpt_tos:
            fault = handler.sink._take_fault(_DATA_COMMAND_FAULTS)
            if fault is not None:
                await self.push(_DATA_COMMAND_FAULTS[fault])
                return
        await super().smtp_DATA(arg)


class _Controller(Controller):
    """Serves :class:`_SinkSMTP` on port 0, learning the port the OS chose before the start-up probe."""

    def factory(self) -> SMTP:
        return _SinkSMTP(self.handler, **self.SMTP_kwargs)

    def _trigger_server(self) -> None:
        if isinstance(self.server, asyncio.Server) and self.server.sockets:
            self.port = int(self.server.sockets[0].getsockname()[1])
        super()._trigger_server()  # type: ignore[no-untyped-call]
