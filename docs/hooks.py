"""MkDocs hooks: the pages generated from the code, so they cannot drift from it.

* ``configuration.md``: the ``<!-- settings-table -->`` marker becomes a section per setting,
  read from ``idemmail_celery.config.SETTINGS`` (one ``Setting`` record per setting:
  ``conf``, ``option``, ``env``, ``default``, ``doc``; a ``secret`` one's default is not shown);
  ``<!-- settings-notes -->`` becomes ``config.py``'s docstring from its paragraph on parsing on.
* ``operations.md``: the ``<!-- exit-codes -->`` marker becomes the table of the operator CLI's
  exit codes, read from ``idemmail_celery.cli.EXIT_CODES`` (the one place they are written).
* ``changelog.md``: ``CHANGELOG.md`` from the repository root, as it is.
* A link from a page to a repository file outside ``docs/`` (``[handler.py](../idemmail_celery/handler.py)``,
  which works when the page is read in the repository) keeps its text on the site, without the link;
  a link to a file that does not exist is left alone, for ``--strict`` to report.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- settings-table -->"
NOTES = "<!-- settings-notes -->"
EXIT_CODES = "<!-- exit-codes -->"


def _cell(value: Any) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


#: The default column's one word for a setting nothing sets by default (what "what it does" says happens then).
UNSET = "unset"


def _default(value: Any) -> str:
    if value is None:
        return UNSET
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value!r}`" if not isinstance(value, str) or not value else f"`{value}`"


def _facts(s: Any) -> list[tuple[str, str]]:
    """What the reference says of a setting besides its text: (label, value) pairs, in order."""
    secret = getattr(s, "secret", False)
    default = ("(not shown)" if s.default else UNSET) if secret else _default(s.default)
    facts = [("default", default)]
    if s.option:
        facts.append(("task option", _cell(s.option)))
    if s.env:
        facts.append(("environment", _cell(s.env)))
    return facts


def settings_reference() -> str:
    """Every setting as a section of its own (a heading to link to, its facts on one line, its text):
    long names in a five-column table wrapped mid-word on a laptop's screen."""
    from idemmail_celery.config import SETTINGS

    out = []
    for s in SETTINGS:
        facts = " · ".join(f"**{label}** {value}" for label, value in _facts(s))
        out.append(f"### `{s.conf}`\n\n{facts}\n\n{' '.join(str(s.doc or '').split())}\n")
    return "\n".join(out)


def exit_codes_table() -> str:
    """The operator CLI's exit codes as a Markdown table."""
    from idemmail_celery.cli import EXIT_CODES as codes

    out = ["| exit | meaning |", "|---|---|"]
    out += ["| " + str(code) + " | " + meaning.replace("|", "\\|") + " |" for code, meaning in codes.items()]
    return "\n".join(out)


def settings_notes() -> str:
    """``config.py``'s module docstring from its paragraph on parsing (``Values are parsed``) on, as Markdown:
    the paragraphs before it speak to a maintainer (the table in the code), the rest to a user."""
    import idemmail_celery.config as config

    doc = config.__doc__ or ""
    start = doc.find("Values are parsed")
    if start < 0:
        raise RuntimeError("config.py's docstring lost its paragraph on parsing ('Values are parsed ...')")
    text = doc[start:].strip()
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?(\w+)`", r"`\1`", text)
    return text.replace("``", "`")


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "changelog.md", content=(ROOT / "CHANGELOG.md").read_text()))
    return files


_REPO_LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)\s#]+)\)")


def _unlink_repository_files(markdown: str, page_dir: Path) -> str:
    def text(match: re.Match[str]) -> str:
        target = (page_dir / match.group(2)).resolve()
        inside = ROOT in target.parents and (ROOT / "docs") not in target.parents
        return match.group(1) if inside and target.exists() else match.group(0)

    return _REPO_LINK.sub(text, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    markdown = _unlink_repository_files(markdown, (ROOT / "docs" / page.file.src_uri).parent)
    if page.file.src_uri == "configuration.md":
        if MARKER not in markdown:
            raise RuntimeError(f"configuration.md lost its {MARKER} marker")
        markdown = markdown.replace(MARKER, settings_reference()).replace(NOTES, settings_notes())
    if page.file.src_uri == "operations.md":
        if EXIT_CODES not in markdown:
            raise RuntimeError(f"operations.md lost its {EXIT_CODES} marker")
        markdown = markdown.replace(EXIT_CODES, exit_codes_table())
    return markdown
