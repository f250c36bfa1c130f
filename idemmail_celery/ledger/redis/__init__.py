"""Redis ledger: ``redis://``, ``rediss://``, ``redis+cluster://`` and ``sentinel://``.

A record in progress is a hash, a sent one an entry on a shelf; every transition is one
Lua script (``*.lua`` beside ``store.py``, registered with the client's script support and called with
EVALSHA, loaded again on NOSCRIPT; see ``scripts.py``), so a claim, a completion or a replay is one atomic
round trip.
Lease times come from the Redis server's clock (``TIME``), so worker clocks do
not have to agree.

**Buckets.** Keys are spread over ``buckets`` hash-tagged buckets (16 by default)
so that every script touches keys of one hash slot, as Redis Cluster requires::

    <prefix>:{<bb>}:r:<packed key>   a record not yet sent (a hash)
    <prefix>:{<bb>}:p:<packed key>   its first payload (a string; gone on sent unless keep_payload)
    <prefix>:{<bb>}:d:<shelf>        sent records whose key falls on this shelf (a hash; see below)
    <prefix>:{<bb>}:i:<state>        the bucket's index of claimed, released, failed or review records
    <prefix>:{<bb>}:c:sent           the bucket's count of sent records, by expiry (a hash)
    <prefix>:{<bb>}:h:<digest>       a reschedule's mark (see ``mark_hop``; expires)
    <prefix>:{<bb>}:epoch            the bucket's epoch marker (a hash: the epoch, the layout's version, ...)

``bb`` is the bucket number in two hex digits, chosen by CRC32 of the intent key.
On one Redis the buckets cost nothing on the hot path; listing, stats and purge
visit every bucket.

**A record in progress** (``claimed``, ``released``, ``failed``, ``review``) is a hash of its own:
short field names (see ``prelude.lua``), times as integer microseconds, a 64-hex key packed in
43 base64url characters in its name, a 64-hex fingerprint in 37 base-126 ASCII characters (anything
else as ``~`` + itself), the owner, task name, result and error in chunks of at most 64 bytes, and
the payload in a string of its own: every value within Redis's ``hash-max-listpack-value``, so
the hash stays compact (listpack).

**A sent record is an entry on its shelf**. Most records are ``sent`` and stay for the
retention, and a key of its own with a TTL costs Redis about 150 bytes before its first byte of
data. So the completion that makes a record ``sent`` moves it, in the same script, onto its
*shelf*: one of ``shelves`` hashes per bucket (64 by default, fixed in the markers when the ledger
is created), chosen by bits of the key itself (see ``_shelf``), never by the clock. A claim or a read
therefore looks in at most two places, whatever the retention: the record's hash, then its shelf
(one ``HGET``). The entry's field is the key's 32 bytes (a 64-hex key; anything else ``~`` +
itself), its value one string: expiry (the server's clock, in tenths of a second, rounded up), then retention,
token, attempts and reclaims (each only when not the ledger's, 1, 1, 0), the fingerprint (its 37
characters, copied as they are), and the result with its message id stored once (a UUID packed in 22
characters; ``send_email``'s ``value`` repeating the message id is rebuilt on read; anything else as
JSON). Task name, owner and the time of the first claim are not kept: nothing reads them once the
intent is sent (a duplicate is told the result, a must-match check reads the fingerprint,
``forget`` rewrites the result; attempts and reclaims stay for operators).

**Expiry** is the entry's own stamp, checked by every script against the server's ``TIME``: an
entry past it is dead (a claim replaces it, a read ignores it). A clock stepped back only makes
entries live longer; stepped forward, they end that much sooner, never sooner than the retention
minus the step. Nothing visits entries to delete them: a completion writing onto a shelf sweeps its
dead entries when the shelf's sweep time (field ``""``, at most every retention / 8) has come, so a
shelf holds at most an eighth of a retention's dead entries; and a shelf's TTL is its longest-lived
entry's expiry (it only grows), so a shelf nobody writes to any more goes by itself.
Fields are bytes, not text: read a shelf through the ledger (or a client that does not decode
replies); the listing's script replies with them in hex.

Measured (``python -m bench.memory``, 100,000 ``send_email`` records as workers write them, see
docs/benchmarks.md for the figures and the shapes compared). ``stats`` reads the per-bucket counters
(an ``HLEN`` of the shelves would count dead entries until their sweep), which count a record until
its expiry's granule ends (at most 1% of the retention late).

**Loss detection.** Each bucket holds an epoch marker that every script checks: a store flushed, or
restarted empty, stops every claim until an operator acknowledges the loss (``ledger ack-loss``). See
``epochs.py``, :meth:`RedisLedger.loss_status` and docs/operations.md ("Ledger loss").

**One layout, format version 1** (:data:`LAYOUT`). The markers carry it; a store whose markers name another
version is refused at first use (:class:`UnsafeLedgerError`), so that a later release changes the format on
purpose and decides how it reads this one. There is nothing to migrate from: no earlier layout was released.

**The store must not evict keys**: an evicted ``sent`` record reopens its key and the next duplicate sends again.
At first use the ledger refuses a ``maxmemory-policy`` other than ``noeviction`` (unless
``allow_eviction=True``) and reads it again on the claim path every ``policy_recheck_seconds``; a worker warns
at start about a server with neither AOF nor RDB save points. See ``checks.py``.

**Modules.** ``store.py``: :class:`RedisLedger` and its record moves; ``checks.py``: the server checks;
``epochs.py``: the epoch markers; ``listing.py``: listing, counting, the review queue's pages; ``plumbing.py``:
what they share (the client's calls); ``client.py``: the client built from a URL (or a caller's own) and its
errors; ``scripts.py``: the Lua scripts; ``layout.py``: every key name and packing.
"""

from .layout import (
    DEFAULT_BUCKETS,
    DEFAULT_SHELVES,
    LAYOUT,
    Names,
    _b36,
    _body,
    _field,
    _pack,
    _pack_fp,
    _unbody,
    _unpack_fp,
)
from .scripts import _lua
from .store import RedisLedger

__all__ = [
    "DEFAULT_BUCKETS", "DEFAULT_SHELVES", "LAYOUT", "Names", "RedisLedger", "_b36", "_body", "_field", "_lua",
    "_pack", "_pack_fp", "_unbody", "_unpack_fp",
]
