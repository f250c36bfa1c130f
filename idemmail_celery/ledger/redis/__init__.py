"""Redis ledger: ``redis://``, ``rediss://``, ``redis+cluster://`` and ``sentinel://``.

Every transition is one atomic Lua script (``*.lua``, see ``scripts.py``); lease times come from the server's
clock (``TIME``). Keys are spread over hash-tagged buckets, so every script touches one hash slot (Redis
Cluster). A record in progress is a compact hash of its own; a ``sent`` one is an entry on a *shelf*, a hash
chosen by the key, whose expiry every script checks against the server's clock. Each bucket's epoch marker
detects a store emptied under the ledger (``epochs.py``), and carries the layout's format version
(:data:`LAYOUT`). The store must not evict keys (``checks.py``). The layout and why it is so: docs/ledgers.md;
measurements: docs/benchmarks.md.

Modules: ``store.py`` (:class:`RedisLedger`, the record moves), ``checks.py`` (server checks), ``epochs.py``
(epoch markers), ``listing.py`` (listing and counting), ``plumbing.py`` (the client's calls they share),
``client.py`` (the client and its errors), ``scripts.py`` (the Lua scripts), ``layout.py`` (key names and packing).
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
