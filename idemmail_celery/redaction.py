"""Keep personal data (addresses, subjects, bodies) out of what Celery and the library show.

**Error texts.** :func:`scrub` takes addresses (anything shaped ``local@domain``) and the
message's own addresses, display names and subject out of a text; :func:`scrub_error` does
it to a :class:`~idemmail_celery.errors.SendError` in place, and :func:`scrubbed` wraps a
provider's ``send`` so that every error it raises, and a stored response text, is scrubbed
before it reaches a log line, an exception, a Flower event, the result backend or the
ledger's ``error`` field. Every built-in provider's ``send`` is wrapped, and ``send_email``
scrubs again whatever a custom provider raises.

**Task arguments.** Celery copies a message's ``argsrepr``/``kwargsrepr`` headers into its task events
(Flower) and worker logs, and builds them from the real arguments unless the sender
gave its own. ``IdempotentTask.apply_async`` gives its own, but a message can be
published by other paths: ``app.send_task(name, ...)``, the outbox relay for a task
it does not know, canvas primitives, a retry. :func:`on_before_publish`, Celery's
``before_task_publish`` handler, therefore redacts every message, whatever the path, of

* a task registered here as redacting: every ``IdempotentTask`` whose
  ``redact_args`` setting is on (the default), and ``send_campaign``;
* a task this process does not know that carries an intent key header
  (``idempotency_key``): it was derived by an idempotent task somewhere.

The redacted headers read ``<redacted>`` and ``<redacted: idempotency key …>``.
Not covered: ``task_send_sent_event`` builds its ``task-sent`` event before the
signal, from what the sender gave (``apply_async`` gives the redacted text; a bare
``send_task`` does not), and a result backend with ``result_extended`` stores the
real arguments.

This module imports nothing from Celery: the Celery-free state machine
(:mod:`idemmail_celery.handler`) scrubs with it. The adapter, :mod:`idemmail_celery.task`,
connects :func:`on_before_publish` to the signal when it is imported, which importing
anything from the package does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import quote

from ._common import KEY_HEADER
from .errors import SendError

if TYPE_CHECKING:
    from .email import EmailMessage
    from .providers.base import Provider, SendResult

__all__ = ["ADDRESS_MARK", "ARGSREPR", "KEY_HEADER", "PERSONAL_MARK", "kwargsrepr", "on_before_publish", "redacts",
           "register", "scrub", "scrub_error", "scrubbed"]

log = logging.getLogger("idemmail_celery")

#: What an address becomes in a scrubbed text.
ADDRESS_MARK = "<address>"
#: What a personal text of the message (a display name, the subject) becomes.
PERSONAL_MARK = "<redacted>"
#: Anything shaped like an address ("550 5.1.1 <bob@example.com>: unknown", JSON, prose).
#: Each side bounded (an address is at most 254 characters): unbounded, a long run without "@" (a
#: base64 blob a provider echoes) costs quadratic time, and scrubbing runs while the claim is held.
_ADDRESS = re.compile(r"<?[^\s<>()\[\],;:\"'`]{1,254}@[^\s<>()\[\],;:\"'`]{1,254}>?")
#: An address as a URL writes it ("?to=ann%40example.com&", "%3Cann%40example.com%3E"): the local
#: part stops at "=", "&", "/", "?" and an encoded space; the domain takes escapes of non-ASCII only.
_URL_ADDRESS = re.compile(r"(?<!%)(?<!%[0-9A-F])(?:[\w.!$'*+~-]|%(?!20|40)[0-9A-F]{2}){1,254}%40"
                          r"(?:[\w-]|%[89A-F][0-9A-F]){1,254}(?:\.(?:[\w-]|%[89A-F][0-9A-F]){1,254}){0,127}(?:%3E)?",
                          re.IGNORECASE)
# Between the words of a personal text: any run of white space, also as JSON (\t, \n) or a URL
# (%20, +) writes it. Providers collapse, re-wrap and escape the white space of what they quote,
# so a subject with two spaces or a TAB must not escape its match by it.
_GAP = r"(?:\s|\\[tnrf]|\\u00[aA]0|%20|%09|%0[aAdD]|\+)+"
# The ways a provider writes a word it quotes: as given, as JSON (both ways), URL-encoded.
_SPELLINGS: tuple[Callable[[str], str], ...] = (
    lambda w: w, lambda w: json.dumps(w)[1:-1], lambda w: json.dumps(w, ensure_ascii=False)[1:-1],
    lambda w: quote(w, safe=""),
)


def scrub(text: str, personal: Iterable[str] = ()) -> str:
    """``text`` without addresses, and without any of ``personal`` (the message's names, subject).

    ``personal`` texts are matched ignoring case, also as JSON or a URL writes them (escaped
    quotes, ``\\uXXXX``, ``%20``), whatever white space stands between their words (a provider
    may collapse two spaces or a TAB into one space), longest first; texts under 4 characters
    are left alone (replacing "Hi" everywhere would garble the error and protect nothing).
    Addresses, also URL-encoded (``ann%40example.com``), are replaced by :data:`ADDRESS_MARK`
    wherever they appear.
    """
    items = {t for t in (item.strip() for item in personal) if len(t) >= 4}
    for item in sorted(items, key=len, reverse=True):
        words = item.split()
        forms = {_GAP.join(re.escape(spell(w)) for w in words) for spell in _SPELLINGS}
        text = re.sub("|".join(sorted(forms, key=len, reverse=True)), PERSONAL_MARK, text, flags=re.IGNORECASE)
    if "@" in text:  # the common error text holds none: no scan at all
        text = _ADDRESS.sub(ADDRESS_MARK, text)
    if "%40" in text:  # digits only: no case to fold
        text = _URL_ADDRESS.sub(ADDRESS_MARK, text)
    return text


_E = TypeVar("_E", bound=SendError)


def scrub_error(exc: _E, personal: Iterable[str] = ()) -> _E:
    """Scrub ``exc``'s message in place (its ``args`` too, which Celery serializes); returns it.

    An exception chained to it (``__cause__``/``__context__``) whose text would leak is cut
    off: tracebacks print every link of the chain.
    """
    personal = tuple(personal)
    clean = scrub(exc.message, personal)
    if clean != exc.message:
        exc.message = clean
        exc.args = (clean, *exc.args[1:])
    link = exc.__cause__ or exc.__context__
    while link is not None:
        if scrub(str(link), personal) != str(link):
            exc.__cause__, exc.__suppress_context__ = None, True
            break
        link = link.__cause__ or link.__context__
    return exc


_Send = TypeVar("_Send", bound=Callable[..., Any])


def scrubbed(send: _Send) -> _Send:
    """Decorate a provider's ``send(self, message, *, key)``: what it raises or stores is scrubbed.

    A :class:`~idemmail_celery.errors.SendError` leaves with :func:`scrub_error` applied
    (the message's addresses, display names and subject); every text in a result's ``extra``
    (an answer's raw text, an SMTP server's reply) is scrubbed the same way: the result is
    stored in the ledger and replayed to every duplicate.
    """

    @functools.wraps(send)
    def wrapper(self: Provider, message: EmailMessage, **kwargs: Any) -> SendResult:
        try:
            result: SendResult = send(self, message, **kwargs)
        except SendError as exc:
            scrub_error(exc, message.personal_texts())
            raise
        if result.extra:
            extra = _scrubbed_values(result.extra, message.personal_texts())
            if extra != result.extra:
                result = dataclasses.replace(result, extra=extra)
        return result

    return cast(_Send, wrapper)


def _scrubbed_values(value: Any, personal: tuple[str, ...]) -> Any:
    """``value`` with every text in it (through dicts and lists) scrubbed of addresses and ``personal``."""
    if isinstance(value, str):
        return scrub(value, personal)
    if isinstance(value, dict):
        return {k: _scrubbed_values(v, personal) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrubbed_values(v, personal) for v in value]
    if isinstance(value, tuple):
        return tuple(_scrubbed_values(v, personal) for v in value)
    return value


ARGSREPR = "<redacted>"

_lock = threading.Lock()
#: task name -> does it redact? (a callable: settings are resolved lazily, at publish time)
_tasks: dict[str, Callable[[], bool]] = {}


def register(name: str, redacts: Callable[[], bool] | bool = True) -> None:
    """Redact the arguments of every message of task ``name`` (``redacts``: a flag or a callable)."""
    with _lock:
        _tasks[name] = redacts if callable(redacts) else (lambda: bool(redacts))


def kwargsrepr(key: Any) -> str:
    """What a redacted message shows in place of its keyword arguments."""
    return f"<redacted: idempotency key {key}>" if key else "<redacted>"


def redacts(name: str | None, headers: dict[str, Any]) -> bool:
    """Should a message of task ``name`` with these headers be redacted?"""
    check = _tasks.get(name or "")
    if check is None:
        return KEY_HEADER in headers  # an idempotent task this process does not know
    try:
        return check()
    except Exception as exc:  # a broken setting: redact (it also fails at apply_async, loudly)
        log.debug("idemmail: redaction setting for %s failed: %s", name, exc)
        return True


def on_before_publish(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Celery's ``before_task_publish`` handler: redact ``headers`` (``argsrepr``/``kwargsrepr``) in place.

    ``sender`` is the task name. A message :func:`redacts` says yes to shows :data:`ARGSREPR` and
    :func:`kwargsrepr` of its intent key; one ``apply_async`` already redacted is left alone.
    """
    if not headers:
        return
    args_done = str(headers.get("argsrepr") or "").startswith("<redacted")
    kwargs_done = str(headers.get("kwargsrepr") or "").startswith("<redacted")
    if (args_done and kwargs_done) or not redacts(sender, headers):  # apply_async redacted it already
        return
    if not args_done:
        headers["argsrepr"] = ARGSREPR
    if not kwargs_done:
        headers["kwargsrepr"] = kwargsrepr(headers.get(KEY_HEADER))
