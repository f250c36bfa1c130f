"""SMTP provider: ``smtp://`` and ``smtps://``, with the standard library's :mod:`smtplib`.

**SMTP has no idempotency key.** A server cannot be told "this is the same message
as before, drop it", so :attr:`SMTPProvider.accepts_idempotency_key` is False. The
Message-ID is derived from the intent key (``<key@domain>``), which lets a person
(or a reconciler searching the mailbox) recognise a copy, but nothing de-duplicates
on it.

**The window after DATA is physically ambiguous.** Once the server has answered
``354`` and the message bytes are on the wire, the server may have queued the
message even if the final ``250`` never reaches us (the connection drops, the
reply times out, the worker dies). That case raises
:class:`~idemmail_celery.errors.AmbiguousSendError` (reason ``"after_data"``), and
the library **parks such sends for review rather than resend them**: you get at
most one message, and a person decides the rare ambiguous case. Everything that
fails before the message bytes are written is known to have sent nothing and is
retried.

URL::

    smtp://[user@]host[:port][?starttls=1&timeout=10&domain=example.com&local_hostname=worker1.example.com]
    smtps://[user@]host[:port][?...]            implicit TLS, port 465 by default (smtp: 25)

The password never goes in the URL (that raises
:class:`~idemmail_celery.errors.ConfigurationError`): pass ``password=`` (or
``api_key=``, the name ``from_url`` callers use for every provider), or set
``IDEMMAIL_SMTP_PASSWORD``. It is never logged and never shown in ``repr()``.
Credentials are refused over an unencrypted connection to anything but loopback:
use ``smtps://`` or ``?starttls=1``.

Each :meth:`SMTPProvider.send` opens a fresh connection (connect, EHLO, STARTTLS,
AUTH, one transaction, QUIT). That costs a few round trips per message and keeps
every send independent: no connection state shared between threads or leaking
between a failed send and the next one. ``timeout`` (default 30 s) applies to each
socket operation, so one send can take several timeouts in the worst case: keep
the task's lease well above it.

How SMTP replies map to the outcomes the state machine understands:

========================================================  =======================================
what happened                                             raised (``reason``)
========================================================  =======================================
refused, timed out, TLS failure, lost before DATA         ``TransientSendError`` (``connect``)
authentication failed (logged at ERROR once per process)  ``TransientSendError`` (``auth``)
4xx to MAIL, to any RCPT, or to the DATA command          ``TransientSendError`` (``tempfail``)
5xx to MAIL or the DATA command, every RCPT refused       ``PermanentSendError`` (``rejected``)
some RCPT refused with 5xx, others accepted               sent to the accepted ones; the result's
                                                          ``extra["refused"]`` lists the others
lost or timed out from the first message byte on        ``AmbiguousSendError`` (``after_data``)
interrupted (a soft time limit) before the message bytes  ``TransientSendError`` (``interrupted``)
interrupted from the first message byte on                ``AmbiguousSendError`` (``after_data``)
final reply 4xx / 5xx                                     ``TransientSendError`` (``tempfail``) /
                                                          ``PermanentSendError`` (``rejected``)
final reply 2xx                                           ``SendResult``
any other reply before DATA (not 2xx/4xx/5xx)             ``TransientSendError`` (``protocol``)
a non-ASCII address and a server without SMTPUTF8         ``PermanentSendError`` (``rejected``)
========================================================  =======================================

A 4xx to any RCPT fails the whole send before DATA (nothing was sent, the retry goes
to every recipient), even if other recipients were accepted or refused for good.

Every error names the stage the conversation reached (``at RCPT TO``, ``after the message
was written``), and so does the ``review`` record of an ``after_data`` send (``ledger show``).
A send interrupted by an exception of the worker's own (Celery's ``SoftTimeLimitExceeded``)
is told apart the same way: before the message was written the server holds nothing, so it is
retried, never parked; only from the first message byte on is it parked for review. A worker
killed outright (SIGKILL) cannot say anything, so the provider says it beforehand: once the
server has accepted ``DATA``, and before the first message byte, it writes a mark into the ledger
(:func:`~idemmail_celery.providers.base.about_to_send`; no mark, no message). A worker killed
before the mark sent nothing the server keeps: the next claimer sends the intent once. One killed
after it is parked as ``lease_expired`` with ``stage: message`` (it may have been queued); the
server's log tells, by the Message-ID ``<key@domain>``.

A provider holds no connection between sends, so one instance can be shared by threads.
"""

from __future__ import annotations

import email.policy
import email.utils
import logging
import os
import re
import smtplib
import ssl
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
    """Send through an SMTP server, one connection per message; see the module docstring.

    ``url`` is ``smtp://`` or ``smtps://`` as above. Keyword arguments override the URL's
    options: ``password``/``api_key`` (else ``IDEMMAIL_SMTP_PASSWORD``), ``timeout``
    (seconds per socket operation), ``starttls``, ``domain`` (for the Message-ID),
    ``local_hostname`` (the EHLO name; default the machine's FQDN) and ``ssl_context``
    (default: the system's trusted CAs, hostname checked).
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
        self._check_connection_options()
        self._password = self._choose_password(password, api_key)
        if self._password is not None and not (self.implicit_tls or self.starttls or is_loopback(self.host)):
            raise ConfigurationError(
                f"refusing to send SMTP credentials unencrypted to {self.host}: use smtps:// or ?starttls=1")

    def _check_connection_options(self) -> None:
        """:class:`ConfigurationError` for a timeout or a TLS choice that cannot work."""
        if self.timeout <= 0:
            raise ConfigurationError("timeout must be a positive number of seconds")
        if self.implicit_tls and self.starttls:
            raise ConfigurationError("smtps:// is already TLS from the first byte; drop ?starttls=1")

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

    # -- sending --

    @scrubbed
    def send(self, message: EmailMessage, *, key: str) -> SendResult:
        """Send ``message`` in one SMTP transaction; Message-ID ``<key@domain>``, Date now.

        Envelope recipients are ``message.recipients()`` (Bcc only in the envelope).
        Returns ``SendResult(message_id=<the Message-ID>, provider="smtp",
        extra={"smtp_reply": "250 ...", "refused": [...]})``; ``refused`` (present only
        when some recipients were refused for good while others were accepted) lists
        ``{"index", "code", "reply"}``: ``index`` is the recipient's place (from 1) in
        ``message.recipients()`` (to, cc, bcc), never the address, since the result is
        stored in the ledger and replayed to duplicates. No error message carries an
        address either (server replies are scrubbed): they reach logs, Flower and the
        ledger. Raises as in the module's table.
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
            self._mail_from(conn, sender, options, key)
            stage = "RCPT TO"
            refused = self._rcpt_to(conn, recipients, key)
            stage = "DATA"
            self._data_command(conn, key)
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
            return _transient(f"interrupted at {stage} with {self._where()} ({why}); nothing was sent: the server "
                              "holds no message before DATA", "interrupted", key)
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
                    raise _transient(f"{self._where()} does not offer STARTTLS (required by ?starttls=1)",
                                     "connect", key)
                conn.starttls(context=self._tls_context())
                conn.ehlo()
        except (OSError, ValueError) as exc:  # smtplib's errors, ssl.SSLError and socket errors are OSErrors
            _close(conn)
            raise _transient(f"cannot connect to {self._where()}: {_describe(exc)}", "connect", key) from exc
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
            raise _transient(f"{self._where()} dropped the connection during AUTH: {exc}", "connect", key) from None
        except smtplib.SMTPException as exc:
            _close(conn)
            text = _describe(exc).replace(password, "***")
            message = f"SMTP authentication at {self._where()} failed: {text}"  # the user name is often an address
            _log_auth_failure_once(message)
            # from None: the server's reply is already in the message, scrubbed; nothing more to chain.
            raise _transient(message, "auth", key) from None
        except OSError as exc:
            _close(conn)
            raise _transient(f"lost {self._where()} during AUTH: {_describe(exc)}", "connect", key) from None

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

    def _mail_from(self, conn: smtplib.SMTP, sender: str, options: list[str], key: str) -> None:
        try:
            code, reply = conn.mail(sender, options)
        except OSError as exc:
            raise _transient(f"lost {self._where()} at MAIL FROM: {_describe(exc)}", "connect", key) from exc
        if code != 250:
            _refuse_before_data("MAIL FROM", code, reply, key)  # not the address: messages reach logs

    def _rcpt_to(self, conn: smtplib.SMTP, recipients: list[str], key: str) -> list[dict[str, Any]]:
        refused: list[dict[str, Any]] = []
        deferred: list[str] = []
        # Recipients are named by their place (#1 = the first of message.recipients()), never their address.
        for index, address in enumerate(recipients, 1):
            try:
                code, reply = conn.rcpt(address)
            except OSError as exc:
                raise _transient(f"lost {self._where()} at RCPT TO: {_describe(exc)}", "connect", key) from exc
            if code in (250, 251):
                continue
            if code == 421 or not 500 <= code <= 599:  # 421: the server is closing the channel
                deferred.append(f"#{index}: {_reply(code, reply)}")
                if code == 421:
                    break
            else:
                refused.append({"index": index, "code": code, "reply": _text(reply)})
        if deferred:
            raise _transient(f"{len(deferred)} of {len(recipients)} recipient(s) temporarily refused: "
                             f"{'; '.join(deferred)}", "tempfail", key)
        if len(refused) == len(recipients):
            details = "; ".join(f"#{r['index']}: {r['code']} {r['reply']}" for r in refused)
            raise PermanentSendError(f"every recipient ({len(refused)}) was refused: {details}", reason="rejected",
                                     key=key)
        return refused

    def _data_command(self, conn: smtplib.SMTP, key: str) -> None:
        # The DATA verb alone: until 354 arrives the server holds no message, so a failure is safe to retry.
        try:
            conn.putcmd("data")
            code, reply = conn.getreply()
        except OSError as exc:
            raise _transient(f"lost {self._where()} at DATA: {_describe(exc)}", "connect", key) from exc
        if code != 354:
            _refuse_before_data("DATA", code, reply, key)

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
            raise _transient(f"{self._where()} deferred the message: {_reply(code, reply)}", "tempfail", key)
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


# -- helpers --


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


def _transient(message: str, reason: str, key: str) -> TransientSendError:
    return TransientSendError(message, reason=reason, key=key)


def _refuse_before_data(command: str, code: int, reply: bytes, key: str) -> NoReturn:
    """A reply refusing MAIL or DATA: nothing was sent, so only 5xx is final."""
    if 500 <= code <= 599:
        raise PermanentSendError(f"{command} refused: {_reply(code, reply)}", reason="rejected", key=key)
    reason = "tempfail" if 400 <= code <= 499 else "protocol"
    raise _transient(f"{command} refused: {_reply(code, reply)}", reason, key)


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
