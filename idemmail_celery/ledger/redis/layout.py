"""The Redis ledger's record layout (format version :data:`LAYOUT`): :class:`Names` spells every key, the functions
below pack what goes into them and read it back. The Lua scripts (``prelude.lua``) write the same shapes."""

from __future__ import annotations

import base64
import binascii
import functools
import json
import re
import zlib
from typing import Any

from ...errors import LedgerError
from ..base import Mark, Record, State, dumps_json, loads_json

DEFAULT_BUCKETS = 16
#: States with an index (a sorted set per bucket); ``sent`` has none (a counter keeps their number).
_INDEXED = (State.CLAIMED, State.RELEASED, State.FAILED, State.REVIEW)
#: The format version of this layout, in every epoch marker; a store whose markers name another is refused.
LAYOUT = "1"
#: Shelves per bucket unless the markers say otherwise (fixed when the ledger is created, see ``_shelf``).
DEFAULT_SHELVES = 64
#: A shelf's dead entries are swept at most every retention / this, and at least every second.
_SWEEP_SPLIT = 8
#: Longest value in a record field: within ``hash-max-listpack-value`` (64), so the hash stays a listpack.
_CHUNK = 64
_HEX64 = re.compile(r"[0-9a-f]{64}")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _shelf(key: str, shelves: int) -> int:
    """The shelf of ``key`` in its bucket: bits of a 64-hex key not used by its bucket, else Adler-32 of it."""
    if len(key) == 64 and _HEX64.fullmatch(key):
        return int(key[8:16], 16) % shelves
    return zlib.adler32(key.encode()) % shelves


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while n > 0:
        n, d = divmod(n, 36)
        out = digits[d] + out
    return out or "0"


def _message_id(mid: str) -> str:
    """A message id as an entry holds it: a UUID in 22 base64url characters after ``u``, else ``=`` + itself."""
    if len(mid) == 36 and _UUID.fullmatch(mid):
        return "u" + base64.urlsafe_b64encode(bytes.fromhex(mid.replace("-", "")))[:22].decode("ascii")
    return "=" + mid


def _message_id_of(text: str) -> str:
    if text[0] == "=":
        return text[1:]
    h = base64.urlsafe_b64decode(text[1:] + "==").hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _body(result: dict[str, Any] | None, error: dict[str, Any] | None) -> str:
    """A sent record's result and error as its shelf entry ends, the message id stored once.

    ``m<id>``: the message id alone; ``v<json><id>``: it and a ``value`` repeating it (``send_email``'s);
    ``r<json><id>``: it and other fields; ``*[result, error]``: anything else; ``""``: neither. ``<id>``
    (:func:`_message_id`) comes last. Whatever does not read back equal is stored the plain way."""
    if result is None or error is not None or not isinstance(result.get("message_id"), str):
        return _plain(result, error)
    mid = result["message_id"]
    rest = {k: v for k, v in result.items() if k != "message_id"}
    value = rest.get("value")
    if not rest:
        text = "m" + _message_id(mid)
    elif list(rest) == ["value"] and isinstance(value, dict) and value.get("message_id") == mid:
        text = "v" + (dumps_json({k: v for k, v in value.items() if k != "message_id"}) or "") + _message_id(mid)
    else:
        text = "r" + (dumps_json(rest) or "") + _message_id(mid)
    # A result JSON would change (a tuple, a non-string key) differs here too, and is stored the plain way.
    return text if _unbody(text) == (result, None) else _plain(result, error)


def _plain(result: dict[str, Any] | None, error: dict[str, Any] | None) -> str:
    r, e = dumps_json(result), dumps_json(error)
    return "" if r is None and e is None else f"*[{r or 'null'},{e or 'null'}]"


_DECODER = json.JSONDecoder()


def _unbody(text: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The result and error of a shelf entry's end (see :func:`_body`)."""
    if not text:
        return None, None
    kind = text[0]
    if kind == "*":
        result, error = json.loads(text[1:])
        return result, error
    if kind == "m":
        return {"message_id": _message_id_of(text[1:])}, None
    rest, end = _DECODER.raw_decode(text, 1)
    mid = _message_id_of(text[end:])
    if kind == "v":
        return {"message_id": mid, "value": {"message_id": mid, **rest}}, None
    return {"message_id": mid, **rest}, None


def _seconds(value: str | None) -> float | None:
    """A stored time in seconds: integer microseconds, or seconds with a point (an operator's change)."""
    if value is None or value == "":
        return None
    return float(value) if "." in value or "e" in value else int(value) / 1_000_000


def _pack(text: str) -> str:
    """A 64-hex digest as 43 base64url characters, anything else as ``~`` + itself (never two packed alike)."""
    if len(text) == 64 and _HEX64.fullmatch(text):
        return base64.urlsafe_b64encode(bytes.fromhex(text))[:43].decode("ascii")
    return "~" + text if text else ""


def _pack_all(texts: list[str]) -> list[str]:
    """:func:`_pack` of many texts (a listing's thousands), the 64-hex ones without a regex."""
    out = []
    for text in texts:
        try:
            raw = bytes.fromhex(text) if len(text) == 64 else None
        except ValueError:
            raw = None
        if raw is not None and raw.hex() == text:  # lower case, no spaces: as _HEX64 reads it
            out.append(binascii.b2a_base64(raw, newline=False)[:43].translate(_URLSAFE).decode("ascii"))
        else:
            out.append(_pack(text))
    return out


_URLSAFE = bytes.maketrans(b"+/", b"-_")


#: The digits of a packed fingerprint: ASCII but NUL and ``~``, so it is text (UTF-8) a script copies as it is.
_B126 = "".join(chr(i) for i in range(1, 128) if i != 0x7E)
_B126_PAIRS = [a + b for a in _B126 for b in _B126]  # index d: the two base-126 digits of d < 126 * 126
_B126_VALUE = {ch: i for i, ch in enumerate(_B126)}


def _pack_fp(fingerprint: str) -> str:
    """A 64-hex fingerprint as 37 base-126 characters, anything else as ``~`` + itself, none as ``""``."""
    if len(fingerprint) == 64 and _HEX64.fullmatch(fingerprint):
        n, pairs = int(fingerprint, 16), []
        for _ in range(19):  # two digits a step (half the big-number divisions); the 38th digit is always 0
            n, d = divmod(n, 126 * 126)
            pairs.append(_B126_PAIRS[d])
        return "".join(reversed(pairs))[1:]
    return "~" + fingerprint if fingerprint else ""


def _unpack_fp(packed: str) -> str:
    """A fingerprint as :func:`_pack_fp` packed it."""
    if not packed or packed[0] == "~":
        return packed[1:]
    n = 0
    for ch in packed:
        n = n * 126 + _B126_VALUE[ch]
    return f"{n:064x}"


@functools.lru_cache(maxsize=256)  # a claim's, then its completion's: spelled once
def _field(key: str) -> bytes:
    """A key as its shelf field: a 64-hex key as its 32 bytes, else ``~`` + itself (``!~`` + itself at 32 bytes)."""
    if len(key) == 64 and _HEX64.fullmatch(key):
        return bytes.fromhex(key)
    text = ("~" + key).encode()
    return b"!" + text if len(text) == 32 else text


def _unfield(text: str) -> str:
    if text[:1] == "~":
        return text[1:]
    return text[2:] if text[:1] == "!" else text


#: A shelf's entry: expiry, retention, token, attempts, reclaims, then its fingerprint's kind (see ``prelude.lua``).
_ENTRY = re.compile(r"([0-9a-z]+)(?:R([0-9a-z]+))?(?:T([0-9a-z]+))?(?:A([0-9a-z]+))?(?:C([0-9a-z]+))?([.~])")


def _unpack(packed: str) -> str:
    """A key as :func:`_pack` packed it."""
    if not packed or packed[0] == "~":
        return packed[1:]
    return base64.urlsafe_b64decode(packed + "=").hex()


def _chunked(value: dict[str, Any] | None) -> list[Any]:
    """The canonical JSON of ``value`` as script arguments: how many chunks, then the chunks."""
    return _counted(dumps_json(value) or "")


def _marked(mark: Mark | None) -> list[Any]:
    """A write-ahead mark as script arguments (:func:`_chunked`): 0 for none."""
    return _chunked(None if mark is None else mark.to_dict())


def _counted(text: str) -> list[Any]:
    """``text`` as script arguments: how many chunks, then the chunks."""
    parts = _chunks(text)
    return [len(parts), *parts]


@functools.lru_cache(maxsize=256)
def _counted_name(text: str) -> tuple[Any, ...]:
    """:func:`_counted` of a text that comes back every call (a task's name): cut once."""
    return tuple(_counted(text))


def _chunks(text: str) -> list[str]:
    """``text`` in pieces of at most :data:`_CHUNK` bytes of UTF-8, cut between characters."""
    if text.isascii():
        parts = [text[i:i + _CHUNK] for i in range(0, len(text), _CHUNK)]
    else:
        parts, part, size = [], "", 0
        for ch in text:
            n = len(ch.encode("utf-8"))
            if size + n > _CHUNK:
                parts.append(part)
                part, size = "", 0
            part, size = part + ch, size + n
        if part:
            parts.append(part)
    return parts


def _joined(h: dict[str, str], base: str) -> str | None:
    """A chunked field read back: ``base``, ``base2``, ``base3``, ... joined."""
    first = h.get(base)
    if first is None:
        return None
    parts, i = [first], 2
    while f"{base}{i}" in h:
        parts.append(h[f"{base}{i}"])
        i += 1
    return "".join(parts)


def _read_record(key: str, fields: list[str] | dict[str, str], payload: str | None, retention_seconds: float) -> Record:
    """A record kept as a hash (its ``HGETALL``, flat or a dict); expiry: ``retention_seconds`` after its update."""
    h = fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2], strict=True))
    state = State(h["s"])
    updated = _seconds(h.get("u")) or 0.0
    return Record(
        key=key, task_name=_joined(h, "n") or "", state=state, token=int(h["t"]), owner=_joined(h, "o") or "",
        lease_expires_at=_seconds(h.get("l")), attempts=int(h.get("a", 0)), reclaims=int(h.get("c", 0)),
        payload=payload or None, fingerprint=_unpack_fp(h.get("f", "")), result=loads_json(_joined(h, "r")),
        error=loads_json(_joined(h, "e")), created_at=_seconds(h.get("k")) or 0.0, updated_at=updated,
        expires_at=updated + retention_seconds if state.expires else None,
        mark=Mark.from_dict(loads_json(_joined(h, "w"))), resolution=loads_json(_joined(h, "d")),
        writes_ahead=h.get("p") == "1")


def _read_entry(key: str, value: str, payload: str | None, retention_ms: int) -> Record:
    """A ``sent`` record kept as a shelf's entry (task name and owner not kept; created when it was sent)."""
    m = _ENTRY.match(value)
    if m is None:
        raise LedgerError(f"Redis ledger error: the shelved record of {key} cannot be read")
    expires, retention, token, attempts, reclaims, kind = m.groups()
    at = m.end()
    if kind == ".":
        fp, body = _unpack_fp(value[at:at + 37]), value[at + 37:]
    else:
        space = value.index(" ", at)
        fp, body = bytes.fromhex(value[at:space]).decode(), value[space + 1:]
    expires_ms = int(expires, 36) * 100  # tenths of a second
    updated = (expires_ms - (int(retention, 36) if retention else retention_ms)) / 1000
    result, error = _unbody(body)
    return Record(
        key=key, task_name="", state=State.SENT, token=int(token, 36) if token else 1, owner="",
        lease_expires_at=None, attempts=int(attempts, 36) if attempts else 1,
        reclaims=int(reclaims, 36) if reclaims else 0, payload=payload or None, fingerprint=fp, result=result,
        error=error, created_at=updated, updated_at=updated, expires_at=expires_ms / 1000)


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a SCAN pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class Names:
    """The key names of one ledger (the list is in docs/ledgers.md), plus ``<prefix>:{00}:roster``, the live
    workers' key-secret ids. ``bb``, the bucket, is CRC32 of the intent key in two hex digits."""

    def __init__(self, prefix: str, buckets: int, shelves: int) -> None:
        self.prefix, self.buckets = prefix, buckets
        #: The KEYS of the keys used last (see ``script_keys``).
        self._recent: dict[str, tuple[str, ...]] = {}
        self._shelves = shelves
        #: Per bucket: the names' stem, and a record script's bucket keys (indexes, counter, marker).
        self.stems = [f"{prefix}:{{{b:02x}}}:" for b in range(buckets)]
        self.tails = [[*(f"{stem}i:{s.value}" for s in _INDEXED), f"{stem}c:sent", f"{stem}epoch"]
                      for stem in self.stems]

    @property
    def shelves(self) -> int:
        return self._shelves

    @shelves.setter
    def shelves(self, value: int) -> None:
        self._shelves = value
        self._recent = {}  # their shelf names may change

    def bucket(self, key: str) -> int:
        return zlib.crc32(key.encode()) % self.buckets

    def record(self, key: str) -> str:
        return f"{self.stems[self.bucket(key)]}r:{_pack(key)}"

    def payload(self, key: str) -> str:
        """The string holding the record's first payload."""
        return f"{self.stems[self.bucket(key)]}p:{_pack(key)}"

    def shelf(self, key: str) -> str:
        """The hash holding ``key``'s record once it is sent."""
        return f"{self.stems[self.bucket(key)]}d:{_shelf(key, self.shelves):x}"

    def script_keys(self, key: str) -> list[str]:
        """A record script's KEYS: record, indexes, sent counter, epoch marker, payload, shelf. The last 256
        keys' are kept: a completion follows its claim, and spelling the names costs as much as the call."""
        recent = self._recent  # replaced when the shelf count changes: names made before stay out of it
        keys = recent.get(key)
        if keys is None:
            b = zlib.crc32(key.encode()) % self.buckets
            stem, packed = self.stems[b], _pack(key)
            keys = (f"{stem}r:{packed}", *self.tails[b], f"{stem}p:{packed}", f"{stem}d:{_shelf(key, self._shelves):x}")
            if len(recent) >= 256:
                recent = self._recent = {}
            if recent is self._recent:
                recent[key] = keys
        return list(keys)

    def claim_keys(self, key: str) -> list[str]:
        """The claim script's KEYS: only what it touches (each key costs the call)."""
        k = self.script_keys(key)
        return [k[0], k[1], k[2], k[6], k[7], k[8]]

    def index(self, bucket: int, state: State) -> str:
        """The bucket's index of ``state`` (``sent`` has none: that name is never written)."""
        return f"{self.stems[bucket]}i:{state.value}"

    def counter(self, bucket: int) -> str:
        """The bucket's count of ``sent`` records: a hash of expiry granule (µs) -> records."""
        return self.tails[bucket][-2]

    def marker(self, bucket: int) -> str:
        """The bucket's epoch marker (a hash; see ``epochs.py``)."""
        return self.tails[bucket][-1]

    def written(self, bucket: int) -> list[str]:
        """The bucket's indexes and sent counter (one exists once a record was written there)."""
        return self.tails[bucket][:-1]

    def listed(self, bucket: int, keys: list[str], *, payloads: bool) -> list[str]:
        """The listing script's KEYS: the record names of ``keys`` (one bucket), then with ``payloads`` theirs."""
        stem, packed = self.stems[bucket], _pack_all(keys)
        records = [f"{stem}r:{p}" for p in packed]
        return records + [f"{stem}p:{p}" for p in packed] if payloads else records

    def everything(self) -> str:
        """A SCAN pattern matching every name in the ledger's buckets."""
        return _glob_escape(f"{self.prefix}:{{") + "*"

    def shelves_of(self, bucket: int) -> str:
        """A SCAN pattern matching the bucket's shelves."""
        return _glob_escape(f"{self.stems[bucket]}d:") + "*"

    def sort(self, name: str) -> tuple[int, str] | None:
        """The bucket of a name :meth:`everything` matched, and ``"record"`` or ``"shelf"`` (None: neither)."""
        at = len(self.prefix) + 2  # "<prefix>:{" then the bucket's two hex digits
        try:
            b = int(name[at:at + 2], 16)
        except ValueError:
            return None
        if b >= self.buckets or not name.startswith(self.stems[b]):
            return None
        kind = {"r:": "record", "d:": "shelf"}.get(name[len(self.stems[b]):len(self.stems[b]) + 2])
        return None if kind is None else (b, kind)

    def key_of(self, record: str) -> str:
        """The intent key of a record's name (one :meth:`sort` called ``"record"``)."""
        b = int(record[len(self.prefix) + 2:len(self.prefix) + 4], 16)
        return _unpack(record[len(self.stems[b]) + 2:])

    def hop(self, key: str, digest: str) -> str:
        return f"{self.stems[self.bucket(key)]}h:{digest}"

    def roster(self) -> str:
        """The key-secret roster (a hash of worker -> expiry and secret ids)."""
        return f"{self.stems[0]}roster"
