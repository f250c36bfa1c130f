"""The Lua scripts beside this module (``<name>.lua``), each one atomic transition or read; KEYS and ARGV are
documented at the top of each. A record script runs after the parts of ``prelude.lua`` its first line names."""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

from ...errors import LedgerError

#: The record scripts: they start with ``prelude.lua``.
_RECORD_SCRIPTS = ("claim", "finish", "renew", "force", "erase", "read", "page", "sweep", "withdraw", "listing")
#: Every script a ledger calls, by name (``<name>.lua``): the record scripts and those that stand alone.
SCRIPTS = (*_RECORD_SCRIPTS, "purge", "flag", "mark", "hop", "roster")
#: A record script's first line naming the prelude's parts it uses (none named: all of them).
_PARTS_USED = re.compile(r"-- Runs after prelude\.lua: ([a-z, ]+)\.")
_PART = re.compile(r"^-- part: ([a-z]+)\n", re.M)


def register(client: Any) -> dict[str, Any]:
    """Every script of :data:`SCRIPTS` registered with ``client``, by name."""
    return {name: client.register_script(_lua(name)) for name in SCRIPTS}


@functools.cache
def _lua(name: str) -> str:
    """The text of ``<name>.lua`` (read once), a record script's after its prelude parts (none named: all)."""
    text = (resources.files(__package__) / f"{name}.lua").read_text("utf-8")
    if name not in _RECORD_SCRIPTS:
        return text
    used = _PARTS_USED.match(text)
    if used is None:
        return _lua("prelude") + text
    return _prelude(tuple(part.strip() for part in used[1].split(","))) + text


@functools.cache
def _prelude(parts: tuple[str, ...]) -> str:
    """The prelude's opening comment and ``parts`` (a helper costs every call: a script carries only its own)."""
    pieces = _PART.split(_lua("prelude"))  # [intro, name, body, name, body, ...]
    known = dict(zip(pieces[1::2], pieces[2::2], strict=True))
    unknown = sorted(set(parts) - set(known))
    if unknown:
        raise LedgerError(f"Redis ledger scripts name unknown prelude parts: {', '.join(unknown)}")
    return pieces[0] + "".join(f"-- part: {name}\n{body}" for name, body in known.items() if name in parts)
