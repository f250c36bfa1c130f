"""Keep personal data (addresses, subjects, bodies) out of what Celery and the library show.

Error texts: :func:`scrub`, :func:`scrub_error`, :func:`scrubbed`; task arguments: :func:`on_before_publish`.
What is covered: docs/security.md. No Celery import here: the Celery-free handler scrubs with it.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar, cast

from ._common import LIBRARY_TASKS, logsafe
from .chain import KEY_HEADER
from .errors import SendError

__all__ = ["ADDRESS_MARK", "ARGSREPR", "KEY_HEADER", "PERSONAL_MARK", "cut_leaking_chain", "known", "kwargsrepr",
           "on_before_publish", "redacts", "register", "scrub", "scrub_error", "scrubbed"]

log = logging.getLogger("idemmail_celery")

#: What an address becomes in a scrubbed text.
ADDRESS_MARK = "<address>"
#: What a personal text of the message (a display name, the subject) becomes.
PERSONAL_MARK = "<redacted>"
#: Anything shaped like an address. Each side bounded (an address is at most 254 characters): unbounded, a
#: long run without "@" (a base64 blob a provider echoes) costs quadratic time while the claim is held.
_ADDRESS = re.compile(r"<?[^\s<>()\[\],;:\"'`]{1,254}@[^\s<>()\[\],;:\"'`]{1,254}>?")
#: An address as a URL writes it ("?to=ann%40example.com&"): the local part stops at "=", "&", "/", "?" and an
#: encoded space; the domain takes escapes of non-ASCII only.
_URL_ADDRESS = re.compile(r"(?<!%)(?<!%[0-9A-F])(?:[\w.!$'*+~-]|%(?!20|40)[0-9A-F]{2}){1,254}%40"
                          r"(?:[\w-]|%[89A-F][0-9A-F]){1,254}(?:\.(?:[\w-]|%[89A-F][0-9A-F]){1,254}){0,127}(?:%3E)?",
                          re.IGNORECASE)
# Any run of white space, also as JSON (\t, \n) or a URL (%20, +) writes it: providers collapse, re-wrap and
# escape the white space of what they quote.
_CANON = re.compile(r"(?P<gap>(?:\s|\\[tnrf]|\\u00[aA]0|%20|%09|%0[aAdD]|\+)+)|[^\s\\%+]+|.", re.DOTALL)
_JSON_TOKEN = re.compile(r'\\u([0-9a-fA-F]{4})(?:\\u([dD][c-fC-F][0-9a-fA-F]{2}))?|\\(["\\/bfnrt])|[^\\]+|\\')
_JSON_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_URL_TOKEN = re.compile(r"(?:%[0-9a-fA-F]{2})+|\+|[^%+]+|%")

#: A text with, for each of its characters, where it came from in the original: ``(text, starts, ends)``.
_View = tuple[str, list[int], list[int]]


def _lower(chunk: str) -> str:
    low = chunk.lower()  # what re.IGNORECASE compares, one character for one (never "İ" -> "i̇")
    return low if len(low) == len(chunk) else "".join(c if len(c.lower()) != 1 else c.lower() for c in chunk)


def _canonical(view: _View) -> _View:
    """``view`` lower-cased, every run of white space (as text, JSON or a URL writes it) one space."""
    text, starts, ends = view
    read = _Reading()
    for m in _CANON.finditer(text):
        a, b = m.span()
        if m.lastgroup == "gap":
            read.char(" ", starts[a], ends[b - 1])
        else:
            read.copy(_lower(m.group()), starts[a:b], ends[a:b])
    return read.view()


class _Reading:
    """A text being read into a :data:`_View`: each character with the span of the original it came from."""

    def __init__(self) -> None:
        self.out: list[str] = []
        self.starts: list[int] = []
        self.ends: list[int] = []

    def char(self, c: str, start: int, end: int) -> None:
        """One character read from ``original[start:end]`` (an escape)."""
        self.out.append(c)
        self.starts.append(start)
        self.ends.append(end)

    def copy(self, text: str, starts: Iterable[int], ends: Iterable[int]) -> None:
        """``text``, each of its characters from ``original[start:end]``."""
        self.out.append(text)
        self.starts.extend(starts)
        self.ends.extend(ends)

    def view(self) -> _View:
        return "".join(self.out), self.starts, self.ends


def _json_decoded(text: str) -> _View:
    """``text`` with JSON string escapes (``\\"``, ``\\u00e9``, a surrogate pair) read, leniently."""
    read = _Reading()
    for m in _JSON_TOKEN.finditer(text):
        a, b = m.span()
        high, low, short = m.group(1), m.group(2), m.group(3)
        if high is not None:
            code = int(high, 16)
            if low is not None and 0xD800 <= code <= 0xDBFF:
                code = 0x10000 + ((code - 0xD800) << 10) + (int(low, 16) - 0xDC00)
            elif low is not None:  # two escapes that are no pair: the second stands alone
                read.char(chr(code), a, a + 6)
                a, code = a + 6, int(low, 16)
            read.char(chr(code), a, b)
        elif short is not None:
            read.char(_JSON_ESCAPES[short], a, b)
        else:
            read.copy(m.group(), range(a, b), range(a + 1, b + 1))
    return read.view()


def _url_decoded(text: str) -> _View:
    """``text`` with URL escapes read (``%XX`` runs as UTF-8, ``+`` a space), leniently."""
    read = _Reading()
    for m in _URL_TOKEN.finditer(text):
        a, b = m.span()
        token = m.group()
        if token == "+":
            read.char(" ", a, b)
        elif token.startswith("%") and len(token) >= 3:
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            first = a  # where the character being decoded started
            for i in range(a, b, 3):
                chars = decoder.decode(bytes((int(text[i + 1:i + 3], 16),)))
                for c in chars:
                    read.char(c, first, i + 3)
                if chars:
                    first = i + 3
            for c in decoder.decode(b"", final=True):
                read.char(c, first, b)
        else:
            read.copy(token, range(a, b), range(a + 1, b + 1))
    return read.view()


def scrub(text: str, personal: Iterable[str] = ()) -> str:
    """``text`` without addresses (:data:`ADDRESS_MARK`, also URL-encoded) and without any of ``personal``.

    ``personal`` texts of 4 characters or more become :data:`PERSONAL_MARK`, matched ignoring case and white
    space, also as JSON or a URL writes them. Linear in the lengths (it runs while a claim is held).
    """
    items = {t for t in (item.strip() for item in personal) if len(t) >= 4}
    if items:
        identity = list(range(len(text)))
        views = [_canonical((text, identity, [i + 1 for i in identity]))]
        if "\\" in text:
            views.append(_canonical(_json_decoded(text)))
        if "%" in text:
            views.append(_canonical(_url_decoded(text)))
        spans: list[tuple[int, int]] = []
        for item in items:
            wanted = _canonical((item, list(range(len(item))), list(range(1, len(item) + 1))))[0].strip()
            if not wanted:  # white space alone as a URL or JSON writes it ("++++", "%20%20"): nothing to find
                continue
            for view, starts, ends in views:
                at = view.find(wanted)
                while at >= 0:
                    spans.append((starts[at], ends[at + len(wanted) - 1]))
                    at = view.find(wanted, at + len(wanted))
        text = _replaced(text, spans)
    if "@" in text:  # the common error text holds none: no scan at all
        text = _ADDRESS.sub(ADDRESS_MARK, text)
    if "%40" in text:  # digits only: no case to fold
        text = _URL_ADDRESS.sub(ADDRESS_MARK, text)
    return text


def _replaced(text: str, spans: list[tuple[int, int]]) -> str:
    """``text`` with each of ``spans`` (overlapping ones merged) replaced by :data:`PERSONAL_MARK`."""
    out: list[str] = []
    done = 0
    for a, b in sorted(spans):
        if out and a <= done:  # overlaps or touches the span before: one mark for both
            done = max(done, b)
        else:
            out += (text[done:a], PERSONAL_MARK)
            done = b
    out.append(text[done:])
    return "".join(out)


_E = TypeVar("_E", bound=SendError)


def scrub_error(exc: _E, personal: Iterable[str] = ()) -> _E:
    """Scrub ``exc``'s message in place (its ``args`` too, which Celery serializes) and cut a leaking chain."""
    personal = tuple(personal)
    clean = scrub(exc.message, personal)
    if clean != exc.message:
        exc.message = clean
        exc.args = (clean, *exc.args[1:])
    return cut_leaking_chain(exc, personal)


_X = TypeVar("_X", bound=BaseException)


def cut_leaking_chain(exc: _X, personal: Iterable[str] = ()) -> _X:
    """Cut ``exc`` (returned) off from its chained exceptions when any would leak: a traceback prints them all."""
    personal = tuple(personal)
    link, seen = exc.__cause__ or exc.__context__, 0
    while link is not None and seen < 100:
        text = str(link)
        if scrub(text, personal) != text:
            exc.__cause__, exc.__context__, exc.__suppress_context__ = None, None, True
            break
        link, seen = link.__cause__ or link.__context__, seen + 1
    return exc


_Send = TypeVar("_Send", bound=Callable[..., Any])


class _Message(Protocol):
    """What :func:`scrubbed` reads of an :class:`~idemmail_celery.email.EmailMessage` (which imports this module)."""

    def personal_texts(self) -> tuple[str, ...]: ...


def scrubbed(send: _Send) -> _Send:
    """Decorate a provider's ``send(self, message, *, key)``: a :class:`~idemmail_celery.errors.SendError` it
    raises, and every text in its result's ``extra`` (stored and replayed), are scrubbed of the message's texts."""

    @functools.wraps(send)
    def wrapper(self: Any, message: _Message, **kwargs: Any) -> Any:  # a Provider's send: a SendResult back
        try:
            result = send(self, message, **kwargs)
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


def known(name: str | None) -> bool:
    """Is ``name`` registered here (:func:`register`), redacting or not?"""
    return (name or "") in _tasks


for _name in LIBRARY_TASKS:  # redacted from import on, whether or not their modules are imported
    register(_name)


def redacts(name: str | None, headers: dict[str, Any]) -> bool:
    """Should a message of task ``name`` with these headers be redacted?"""
    check = _tasks.get(name or "")
    if check is None:
        return KEY_HEADER in headers  # an idempotent task this process does not know
    try:
        return check()
    except Exception as exc:  # a broken setting: redact (it also fails at apply_async, loudly)
        log.debug("idemmail: redaction setting for %s failed: %s", logsafe(name), logsafe(exc))
        return True


def on_before_publish(sender: str | None = None, headers: dict[str, Any] | None = None, *, unsure: bool = False,
                      **_: Any) -> None:
    """Celery's ``before_task_publish`` handler: redact ``argsrepr``/``kwargsrepr`` in place (``sender``: the task
    name; ``unsure``: not :func:`known` yet, an app not finalized: redacted too)."""
    if not headers:
        return
    args_done = str(headers.get("argsrepr") or "").startswith("<redacted")
    kwargs_done = str(headers.get("kwargsrepr") or "").startswith("<redacted")
    if (args_done and kwargs_done) or not (unsure or redacts(sender, headers)):  # apply_async redacted it
        return
    if not args_done:
        headers["argsrepr"] = ARGSREPR
    if not kwargs_done:
        headers["kwargsrepr"] = kwargsrepr(headers.get(KEY_HEADER))
