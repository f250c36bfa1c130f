"""Redis ledger: ``redis://``, ``rediss://``, ``redis+cluster://`` and ``sentinel://``.

Every transition is one atomic Lua script on one hash slot, timed by the server's clock. The layout and why it is
so: docs/ledgers.md; measurements: docs/benchmarks.md. Modules: ``store.py`` (:class:`RedisLedger`, the moves),
``checks.py`` (server checks), ``epochs.py`` (loss detection), ``listing.py``, ``plumbing.py`` (shared calls),
``client.py`` (client and errors), ``scripts.py`` (the Lua scripts), ``layout.py`` (key names and packing)."""

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
