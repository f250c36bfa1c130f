"""SMTP provider (``smtp://``, ``smtps://``) with :mod:`smtplib`: no idempotency key, so a send that may have
reached the server after DATA is parked for review. URL, options and error table: docs/providers.md, "SMTP".
"""

from __future__ import annotations

import email.policy
import email.utils
import logging
import os
import re
import smtplib
import ssl
from collections.abc import Callable
from functools import partial
from typing import Any, NoReturn
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

from .._common import logsafe
from ..email import EmailMessage, message_id_for, split_address
from ..errors import AmbiguousSendError, ConfigurationError, PermanentSendError, SendError, TransientSendError
from ..redaction import scrub, scrubbed
from .base import Provider, SendResult, about_to_send, first_time, is_loopback

__all__ = ["PASSWORD_ENV", "SMTPProvider", "message_id_domain"]

log = logging.getLogger(__name__)

#: Environment variable holding the SMTP password when none is passed.
PASSWORD_ENV = "IDEMMAIL_SMTP_PASSWORD"
DEFAULT_TIMEOUT = 30.0
_DEFAULT_PORTS = {"smtp": 25, "smtps": 465}
_URL_OPTIONS = frozenset({"starttls", "timeout", "domain", "local_hostname"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _split_url(url: str) -> tuple[str, SplitResult, str, int | None]:
    """An ``smtp://``/``smtps://`` URL's scheme (lower case), parts, host and port (if it names one), or
    :class:`ConfigurationError`."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ConfigurationError(f"SMTPProvider serves smtp:// and smtps:// URLs, not {scheme}://")
    if parts.password is not None:
        # Never echo the URL: it holds the secret.
        raise ConfigurationError(f"the SMTP URL must not contain a password: pass password= or set {PASSWORD_ENV}")
    if not parts.hostname:
        raise ConfigurationError("the SMTP URL names no host (smtp://host[:port])")
    if parts.path not in ("", "/"):
        raise ConfigurationError(f"the SMTP URL takes no path; got {parts.path!r}")
    try:
        return scheme, parts, parts.hostname, parts.port
    except ValueError as exc:
        raise ConfigurationError(f"the SMTP URL has an invalid port: {exc}") from None


def message_id_domain(message: EmailMessage, domain: str | None = None) -> str:
    """The domain for the Message-ID: ``domain`` if given, else the sender's (IDNA-encoded)."""
    name = domain or split_address(message.sender)[1].rpartition("@")[2]
    try:
        return name.encode("idna").decode("ascii").lower()
    except UnicodeError:
        return name.lower()


class SMTPProvider(Provider):
    """Send through an SMTP server, one connection per message; keyword arguments override the URL's options.

    ``ssl_context`` defaults to the system's trusted CAs, hostname checked.
    """

    name = "smtp"
    accepts_idempotency_key = False
    writes_ahead = True

    def __init__(
        self,
        url: str,
        *,
        password: str | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
        starttls: bool | None = None,
        domain: str | None = None,
        local_hostname: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        scheme, parts, host, port = _split_url(url)
        query = _parse_query(parts.query)

        self.scheme = scheme
        self.host = host
        self.port = port or _DEFAULT_PORTS[scheme]
        self.implicit_tls = scheme == "smtps"
        self.username = unquote(parts.username) if parts.username else None
        self.starttls = starttls if starttls is not None else _flag(query.get("starttls", "0"), "starttls")
        self.timeout = float(timeout if timeout is not None else _number(query.get("timeout"), "timeout"))
        self.domain = domain or query.get("domain") or None
        self.local_hostname = local_hostname or query.get("local_hostname") or None
        self._ssl_context = ssl_context
        if self.timeout <= 0:
            raise ConfigurationError("timeout must be a positive number of seconds")
        if self.implicit_tls and self.starttls:
            raise ConfigurationError("smtps:// is already TLS from the first byte; drop ?starttls=1")
        self._password = self._choose_password(password, api_key)
        if self._password is not None and not (self.implicit_tls or self.starttls or is_loopback(self.host)):
            raise ConfigurationError(
                f"refusing to send SMTP credentials unencrypted to {self.host}: use smtps:// or ?starttls=1")

    def _choose_password(self, password: str | None, api_key: str | None) -> str | None:
        if password is not None and api_key is not None and password != api_key:
            raise ConfigurationError("pass the SMTP password as password= or api_key=, not two different ones")
        explicit = password if password is not None else api_key
        if self.username is None:
            if explicit is not None:
                # No "user@host" example: error texts are scrubbed of anything shaped like an address.
                raise ConfigurationError("an SMTP password was given (idemmail_provider_api_key) but the URL names no "
                                         "user to log in as: put the user name in the URL, before the host and an "
                                         "'@', or give no password to send without AUTH")
            return None  # IDEMMAIL_SMTP_PASSWORD may be meant for another provider; no user, no AUTH
        chosen = explicit if explicit is not None else os.environ.get(PASSWORD_ENV)
        if not chosen:
            raise ConfigurationError(f"the SMTP URL names user {self.username!r} but no password: "
                                     f"pass password= or set {PASSWORD_ENV}")
        return chosen

    def __repr__(self) -> str:
        user = f"{self.username}@" if self.username else ""
        tls = "implicit" if self.implicit_tls else "starttls" if self.starttls else "none"
        return f"SMTPProvider('{self.scheme}://{user}{self.host}:{self.port}', tls={tls}, timeout={self.timeout:g})"

    @scrubbed
    def send(self, message: EmailMessage, *, key: str) -> SendResult:
        """Send ``message`` in one transaction (Message-ID ``<key@domain>``, Bcc only in the envelope).

        ``extra`` holds ``smtp_reply`` and, when some recipients were refused for good, ``refused``:
        ``{"index", "code", "reply"}`` by place, never address (results and errors reach the ledger and logs).
        """
        message_id = message_id_for(key, message_id_domain(message, self.domain))
        sender = split_address(message.sender)[1]
        recipients = list(dict.fromkeys(message.recipients()))
        international = not all(a.isascii() for a in (sender, *recipients))
        mime = message.to_mime(message_id=message_id, date=email.utils.formatdate(usegmt=True))
        raw = mime.as_bytes(policy=email.policy.SMTPUTF8 if international else email.policy.SMTP)

        stage = "connect"  # the last step begun, named in an interruption's error
        conn: smtplib.SMTP | None = None
        try:
            conn = self._open(key)
            options = self._mail_options(conn, raw, international, key)
            stage = "MAIL FROM"
            self._expect(stage, 250, key, partial(conn.mail, sender, options))
            stage = "RCPT TO"
            refused = self._rcpt_to(conn, recipients, key)
            stage = "DATA"  # the verb alone: until 354 the server holds no message, so a failure is safe to retry
            self._expect(stage, 354, key, partial(conn.docmd, "data"))
            # The server stores nothing before the message's end: the write-ahead mark goes here, the
            # last moment before bytes that may make it exist. Refused (no mark): hang up mid-DATA, so
            # the server discards what it has, and send nothing.
            stage = "write-ahead"
            about_to_send("message")
            stage = "message"
            reply = self._transmit(conn, raw, key)
        except SendError:
            if stage == "write-ahead":
                _close(conn)  # no QUIT: inside DATA it would be read as the message's first line
                conn = None
            raise
        except smtplib.SMTPException:
            raise
        except Exception as exc:  # an interruption of the worker's own (a soft time limit) mid-conversation
            _close(conn)  # no QUIT: the server may be the thing that hung
            conn = None
            raise self._interrupted(stage, exc, key) from exc
        finally:
            if conn is not None:
                _hang_up(conn)
        extra: dict[str, Any] = {"smtp_reply": reply}
        if refused:
            extra["refused"] = refused
            log.warning("idemmail smtp: %s sent, but %d of %d recipient(s) refused: %s", logsafe(key), len(refused),
                        len(recipients), ", ".join(f"#{r['index']} {r['code']}" for r in refused))
        return SendResult(message_id=message_id, provider=self.name, extra=extra)

    def _interrupted(self, stage: str, exc: Exception, key: str) -> SendError:
        """What an interruption at ``stage`` means: before the message bytes the server holds nothing."""
        why = _describe(exc)
        if stage != "message":
            return TransientSendError(f"interrupted at {stage} with {self._where()} ({why}); nothing was sent: "
                                      "the server holds no message before DATA", "interrupted", key)
        return AmbiguousSendError(f"interrupted after the message was written to {self._where()} ({why}): the server "
                                  "may have queued it", reason="after_data", key=key)

    def _open(self, key: str) -> smtplib.SMTP:
        """Connect, greet, secure and authenticate; everything here is before DATA."""
        conn: smtplib.SMTP | None = None
        try:
            if self.implicit_tls:
                conn = smtplib.SMTP_SSL(self.host, self.port, local_hostname=self.local_hostname,
                                        timeout=self.timeout, context=self._tls_context())
            else:
                conn = smtplib.SMTP(self.host, self.port, local_hostname=self.local_hostname, timeout=self.timeout)
            conn.ehlo_or_helo_if_needed()
            if self.starttls:
                if not conn.has_extn("starttls"):
                    raise TransientSendError(f"{self._where()} does not offer STARTTLS (required by ?starttls=1)",
                                             "connect", key)
                conn.starttls(context=self._tls_context())
                conn.ehlo()
        except (OSError, ValueError) as exc:  # smtplib's errors, ssl.SSLError and socket errors are OSErrors
            _close(conn)
            raise TransientSendError(f"cannot connect to {self._where()}: {_describe(exc)}", "connect", key) from exc
        except TransientSendError:
            _close(conn)
            raise
        if self.username is not None and self._password is not None:
            self._login(conn, self.username, self._password, key)
        return conn

    def _login(self, conn: smtplib.SMTP, username: str, password: str, key: str) -> None:
        try:
            conn.login(username, password)
        except smtplib.SMTPServerDisconnected as exc:
            _close(conn)
            where = self._where()
            raise TransientSendError(f"{where} dropped the connection during AUTH: {exc}", "connect", key) from None
        except smtplib.SMTPException as exc:
            _close(conn)
            text = _describe(exc).replace(password, "***")
            message = f"SMTP authentication at {self._where()} failed: {text}"  # the user name is often an address
            _log_auth_failure_once(message)
            # from None: the server's reply is already in the message, scrubbed; nothing more to chain.
            raise TransientSendError(message, "auth", key) from None
        except OSError as exc:
            _close(conn)
            raise TransientSendError(f"lost {self._where()} during AUTH: {_describe(exc)}", "connect", key) from None

    def _mail_options(self, conn: smtplib.SMTP, raw: bytes, international: bool, key: str) -> list[str]:
        options: list[str] = []
        if conn.has_extn("size"):
            options.append(f"SIZE={len(raw)}")
        if not raw.isascii() and conn.has_extn("8bitmime"):
            options.append("BODY=8BITMIME")
        if international:
            if not conn.has_extn("smtputf8"):
                raise PermanentSendError(
                    f"{self._where()} does not support SMTPUTF8, needed for a non-ASCII address",
                    reason="rejected", key=key)
            options.append("SMTPUTF8")
        return options

    def _command(self, stage: str, key: str, call: Callable[[], tuple[int, bytes]]) -> tuple[int, bytes]:
        """One command before DATA and its reply; a lost connection there sent nothing."""
        try:
            return call()
        except OSError as exc:
            raise TransientSendError(f"lost {self._where()} at {stage}: {_describe(exc)}", "connect", key) from exc

    def _expect(self, stage: str, expected: int, key: str, call: Callable[[], tuple[int, bytes]]) -> None:
        code, reply = self._command(stage, key, call)
        if code != expected:
            _refuse_before_data(stage, code, reply, key)  # names the stage, not the address: messages reach logs

    def _rcpt_to(self, conn: smtplib.SMTP, recipients: list[str], key: str) -> list[dict[str, Any]]:
        refused: list[dict[str, Any]] = []
        deferred: list[str] = []
        # Recipients are named by their place (#1 = the first of message.recipients()), never their address.
        for index, address in enumerate(recipients, 1):
            code, reply = self._command("RCPT TO", key, partial(conn.rcpt, address))
            if code in (250, 251):
                continue
            if code == 421 or not 500 <= code <= 599:  # 421: the server is closing the channel
                deferred.append(f"#{index}: {_reply(code, reply)}")
                if code == 421:
                    break
            else:
                refused.append({"index": index, "code": code, "reply": _text(reply)})
        if deferred:
            raise TransientSendError(f"{len(deferred)} of {len(recipients)} recipient(s) temporarily refused: "
                                     f"{'; '.join(deferred)}", "tempfail", key)
        if len(refused) == len(recipients):
            details = "; ".join(f"#{r['index']}: {r['code']} {r['reply']}" for r in refused)
            raise PermanentSendError(f"every recipient ({len(refused)}) was refused: {details}", reason="rejected",
                                     key=key)
        return refused

    def _transmit(self, conn: smtplib.SMTP, raw: bytes, key: str) -> str:
        """Write the message and read the final reply: from here on a lost connection is ambiguous."""
        try:
            conn.send(_dot_stuff(raw) + b".\r\n")
            code, reply = conn.getreply()
        except OSError as exc:
            raise AmbiguousSendError(
                f"lost {self._where()} after the message was written (the server may have queued it): "
                f"{_describe(exc)}", reason="after_data", key=key) from exc
        if 200 <= code <= 299:
            return _reply(code, reply)
        if 400 <= code <= 499:
            raise TransientSendError(f"{self._where()} deferred the message: {_reply(code, reply)}", "tempfail", key)
        if 500 <= code <= 599:
            raise PermanentSendError(f"{self._where()} rejected the message: {_reply(code, reply)}",
                                     reason="rejected", key=key)
        raise AmbiguousSendError(f"unintelligible final reply from {self._where()} after the message was written: "
                                 f"{_reply(code, reply)}", reason="after_data", key=key)

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = ssl.create_default_context()
        return self._ssl_context

    def _where(self) -> str:
        return f"{self.host}:{self.port}"


def _parse_query(query: str) -> dict[str, str]:
    values = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(values) - _URL_OPTIONS)
    if unknown:
        if {"password", "api_key"} & set(unknown):
            raise ConfigurationError(f"the SMTP URL must not contain a password: pass password= or set {PASSWORD_ENV}")
        raise ConfigurationError(f"unknown SMTP URL option(s) {', '.join(unknown)} "
                                 f"(known: {', '.join(sorted(_URL_OPTIONS))})")
    repeated = sorted(name for name, v in values.items() if len(v) > 1)
    if repeated:
        raise ConfigurationError(f"SMTP URL option(s) given twice: {', '.join(repeated)}")
    return {name: v[0] for name, v in values.items()}


def _flag(value: str, name: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigurationError(f"SMTP URL option {name} must be 1 or 0, not {value!r}")


def _number(value: str | None, name: str) -> float:
    if value is None:
        return DEFAULT_TIMEOUT
    try:
        return float(value)
    except ValueError:
        raise ConfigurationError(f"SMTP URL option {name} must be a number, not {value!r}") from None


def _refuse_before_data(command: str, code: int, reply: bytes, key: str) -> NoReturn:
    """A reply refusing MAIL or DATA: nothing was sent, so only 5xx is final."""
    if 500 <= code <= 599:
        raise PermanentSendError(f"{command} refused: {_reply(code, reply)}", reason="rejected", key=key)
    reason = "tempfail" if 400 <= code <= 499 else "protocol"
    raise TransientSendError(f"{command} refused: {_reply(code, reply)}", reason, key)


def _log_auth_failure_once(message: str) -> None:
    if not first_time("auth:smtp"):
        return
    log.error("idemmail smtp: %s; sends are retried (then parked as failed) until the credentials are fixed",
              logsafe(message))


def _dot_stuff(raw: bytes) -> bytes:
    """RFC 5321 4.5.2 transparency, CRLF-terminated (``raw`` already uses CRLF line ends)."""
    stuffed = re.sub(rb"(?m)^\.", b"..", raw)
    return stuffed if stuffed.endswith(b"\r\n") else stuffed + b"\r\n"


def _text(reply: bytes | str) -> str:
    """A server reply on one line, addresses replaced by ``<address>`` (it reaches logs, Flower, the ledger)."""
    text = reply.decode("utf-8", "replace") if isinstance(reply, bytes) else reply
    return scrub(text.replace("\r", " ").replace("\n", " "))


def _reply(code: int, reply: bytes | str) -> str:
    return f"{code} {_text(reply)}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, smtplib.SMTPResponseException):
        return _reply(exc.smtp_code, exc.smtp_error)
    return f"{type(exc).__name__}: {_text(str(exc))}" if str(exc) else type(exc).__name__


def _close(conn: smtplib.SMTP | None) -> None:
    if conn is not None:
        conn.close()


def _hang_up(conn: smtplib.SMTP) -> None:
    """QUIT if the connection is still up (smtplib closes it itself on socket errors), then close."""
    try:
        if conn.sock is not None:
            conn.quit()
    except OSError:
        pass  # the outcome is already decided; a failed QUIT changes nothing
    finally:
        conn.close()
