"""Development providers: ``console://`` prints each message, ``file:///dir`` writes one ``.eml`` per key.

What each does and guarantees: docs/providers.md, "Development providers".
"""

from __future__ import annotations

import contextlib
import email.parser
import email.policy
import errno
import hashlib
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import TextIO
from urllib.parse import parse_qs, quote, unquote, urlsplit

from ..email import EmailMessage, message_id_for
from ..errors import ConfigurationError, TransientSendError
from ..redaction import scrubbed
from .base import Provider, SendResult
from .smtp import message_id_domain

__all__ = ["ConsoleProvider", "FileProvider"]

log = logging.getLogger("idemmail_celery.providers.console")

_MAX_NAME = 200  # keep "<name>.eml" under the usual 255-byte file name limit


class ConsoleProvider(Provider):
    """Print a short summary and the MIME text to ``stream=`` or ``sys.stdout`` (looked up at each send).

    In a worker, whose stdout Celery logs at WARNING, each message is logged at INFO instead.
    """

    name = "console"
    accepts_idempotency_key = False

    def __init__(
        self,
        url: str = "console://",
        *,
        stream: TextIO | None = None,
        domain: str | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() != "console":
            raise ConfigurationError(f"ConsoleProvider serves console:// URLs, not {parts.scheme}://")
        if parts.netloc or parts.path not in ("", "/"):
            raise ConfigurationError(f"console:// takes no host or path (only ?domain=); got {url!r}")
        self.domain = domain or _domain_option(parts.query, url)
        self._stream = stream
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ConsoleProvider(domain={self.domain!r})"

    @scrubbed
    def send(self, message: EmailMessage, *, key: str) -> SendResult:
        """Write the message; returns ``SendResult(message_id="<key@domain>", provider="console")``."""
        message_id = message_id_for(key, message_id_domain(message, self.domain))
        mime = message.to_mime(message_id=message_id)
        text = mime.as_bytes(policy=email.policy.SMTPUTF8.clone(linesep="\n")).decode("utf-8", "replace")
        if not text.endswith("\n"):
            text += "\n"
        block = (
            f"----- idemmail console: key {key} -----\n"
            f"message-id: {message_id}\n"
            f"recipients: {len(message.recipients())}\n"
            f"subject:    {message.subject}\n\n"
            f"{text}"
            f"----- end {message_id} -----\n"
        )
        stream = self._stream if self._stream is not None else sys.stdout
        if self._stream is None and _redirected(stream):
            # In a worker, Celery turns stdout into log records at WARNING: a routine message is INFO.
            log.info("%s", block.rstrip("\n"))
            return SendResult(message_id=message_id, provider=self.name)
        with self._lock:
            stream.write(block)
            stream.flush()
        return SendResult(message_id=message_id, provider=self.name)


def _redirected(stream: object) -> bool:
    """Is ``stream`` Celery's stdout-to-logging proxy (a worker's ``worker_redirect_stdouts``)?"""
    proxy = getattr(sys.modules.get("celery.utils.log"), "LoggingProxy", None)
    return proxy is not None and isinstance(stream, proxy)


class FileProvider(Provider):
    """Write each message to ``<dir>/<key>.eml`` at most once per key (created on first send).

    ``extra`` holds ``path`` and ``created`` (False, with the stored Message-ID, when the file existed).
    """

    name = "file"
    accepts_idempotency_key = True

    def __init__(
        self,
        url: str,
        *,
        domain: str | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() != "file":
            raise ConfigurationError(f"FileProvider serves file:// URLs, not {parts.scheme}://")
        if parts.netloc not in ("", "localhost"):
            raise ConfigurationError(f"file:// URLs take an absolute path, as in file:///var/mail/out; got {url!r}")
        path = unquote(parts.path)
        if not path or not os.path.isabs(path):
            raise ConfigurationError(f"file:// URLs take an absolute path, as in file:///var/mail/out; got {url!r}")
        self.directory = Path(path)
        self.domain = domain or _domain_option(parts.query, url)

    def __repr__(self) -> str:
        return f"FileProvider({self.directory.as_uri()!r})"

    def path_for(self, key: str) -> Path:
        """Where the message for ``key`` is (or would be) written."""
        name = quote(key, safe="")
        if not name or len(name) > _MAX_NAME or name.startswith("."):
            name = "sha256-" + hashlib.sha256(key.encode("utf-8")).hexdigest()
        return self.directory / f"{name}.eml"

    @scrubbed
    def send(self, message: EmailMessage, *, key: str) -> SendResult:
        target = self.path_for(key)
        message_id = message_id_for(key, message_id_domain(message, self.domain))
        raw = message.to_mime(message_id=message_id).as_bytes()
        try:
            existing = self.find_sent(key)
            if existing is not None:
                return existing
            created = _publish(self.directory, target, raw)
            if not created:  # another writer won the race; its file is the one that counts
                existing = self.find_sent(key)
        except OSError as exc:
            raise TransientSendError(f"cannot write {target}: {exc}", reason="io", key=key) from exc
        if existing is not None:
            return existing
        return SendResult(message_id=message_id, provider=self.name, extra={"path": str(target), "created": created})

    def find_sent(self, key: str) -> SendResult | None:
        """The message already written for ``key`` (``created`` False), or None."""
        target = self.path_for(key)
        try:
            with target.open("rb") as fh:
                headers = email.parser.BytesHeaderParser(policy=email.policy.compat32).parse(fh)
        except FileNotFoundError:
            return None
        stored = headers.get("Message-ID")
        message_id = str(stored).strip() if stored is not None else ""
        return SendResult(message_id=message_id, provider=self.name, extra={"path": str(target), "created": False})


def _publish(directory: Path, target: Path, raw: bytes) -> bool:
    """Make ``target`` hold ``raw`` unless it exists; True if this call created it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".eml")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, target)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            return _create_exclusive(target, raw)
        _fsync_directory(directory)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _create_exclusive(target: Path, raw: bytes) -> bool:
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as fh:
        fh.write(raw)
        fh.flush()
        os.fsync(fh.fileno())
    return True


def _fsync_directory(directory: Path) -> None:
    # So the new name survives a power cut; best effort (not every platform can open a directory).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _domain_option(query: str, url: str) -> str | None:
    values = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(values) - {"domain"})
    if unknown:
        raise ConfigurationError(f"unknown option(s) {', '.join(unknown)} in {url!r} (known: domain)")
    domains = values.get("domain") or [""]
    return domains[-1] or None
