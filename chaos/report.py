"""Regenerated sections of ``docs/benchmarks.md``: each command rewrites only its own part.

A section sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; a file without the
markers gets the section appended, so ``make bench`` and ``make chaos`` can share the page.
"""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, name: str, text: str, title: str = "# Benchmarks and fault injection\n") -> None:
    """Replace (or add) section ``name`` of ``path`` with ``text``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{text.strip()}\n{end}\n"
    old = path.read_text() if path.exists() else title
    if start in old and end in old:
        head, rest = old.split(start, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        new = head + block + ("\n" + tail if tail else "")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
