"""The documentation: its generated parts (the configuration reference from ``config.SETTINGS``, the
exit codes from ``cli.EXIT_CODES``), and no passage kept in two places.

(The whole site is built with ``mkdocs build --strict`` by ``make docs`` in CI.)
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import itertools
import re
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

import idemmail_celery.config as config

ROOT = Path(__file__).resolve().parents[1]


def load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sections(reference: str) -> dict[str, dict[str, str]]:
    """setting -> its facts (``default``, ``task option``, ``environment``) and ``text``, from the reference."""
    out = {}
    for block in reference.split("### ")[1:]:
        heading, facts, text = block.strip().split("\n\n")
        fields = dict(re.findall(r"\*\*([a-z ]+)\*\* (.+?)(?= · |$)", facts))
        out[heading.strip("`")] = {**fields, "text": text}
    return out


def test_every_setting_is_a_section_with_its_option_environment_default_and_doc() -> None:
    reference = sections(load_hooks().settings_reference())
    assert list(reference) == [s.conf for s in config.SETTINGS]
    default = next(s.default for s in config.SETTINGS if s.conf == "idemmail_lease_seconds")
    lease = reference["idemmail_lease_seconds"]
    assert lease["default"] == f"`{default:g}`" and lease["task option"] == "`idempotency_lease_seconds`"
    assert "environment" not in lease and lease["text"].startswith("How long a claim holds")
    for setting in config.SETTINGS:
        facts = reference[setting.conf]
        assert facts.get("task option") == (f"`{setting.option}`" if setting.option else None)
        assert facts.get("environment") == (f"`{setting.env}`" if setting.env else None)
        assert facts["text"], f"{setting.conf} has no doc"


def test_one_word_for_no_default_and_every_variable_a_text_names_is_its_environment() -> None:
    reference = sections(load_hooks().settings_reference())
    for setting in config.SETTINGS:
        facts = reference[setting.conf]
        if setting.default is None or (setting.secret and not setting.default):
            assert facts["default"] == "unset", setting.conf
        assert facts["default"].lower() not in ("none", "`none`", "null")
        own = f"IDEMMAIL_{setting.field.upper()}"
        if own in facts["text"]:  # a text naming the setting's own variable: the variable is read
            assert setting.env == own, setting.conf
    assert reference["idemmail_provider_api_key"]["environment"] == "`IDEMMAIL_PROVIDER_API_KEY`"


def test_a_user_page_does_not_speak_of_the_code_that_makes_it() -> None:
    hooks = load_hooks()
    generated = hooks.settings_reference() + hooks.settings_notes() + hooks.exit_codes_table()
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md") if p.name != "development.md")
    text = generated + pages
    # Whole words only: Django's own DJANGO_SETTINGS_MODULE is a user's word, config.SETTINGS is not.
    for internal in (r"(?<!\w)SETTINGS\b", r"\bEXIT_CODES\b", "a row of", ":data:", "Why MkDocs"):
        assert not re.search(internal, text), internal


def test_a_secret_default_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    first = config.SETTINGS[0]
    secret = dataclasses.replace(first, conf="idemmail_x", default="s3cr3t", secret=True, doc="a | b")
    monkeypatch.setattr(config, "SETTINGS", (first, secret))
    text = load_hooks().settings_reference()
    assert "s3cr3t" not in text
    assert sections(text)["idemmail_x"]["default"] == "(not shown)"


def test_links_to_repository_files_keep_their_text_and_others_stay() -> None:
    hooks = load_hooks()
    page = "See [`handler.py`](../idemmail_celery/handler.py), [gone](../nothing.py) and [Ledgers](ledgers.md)."
    assert hooks._unlink_repository_files(page, ROOT / "docs") == (
        "See `handler.py`, [gone](../nothing.py) and [Ledgers](ledgers.md).")


def test_the_exit_codes_table_has_every_code_of_the_cli() -> None:
    from idemmail_celery.cli import EXIT_CODES

    table = load_hooks().exit_codes_table().splitlines()
    assert table[:2] == ["| exit | meaning |", "|---|---|"]
    assert [int(line.split("|")[1]) for line in table[2:]] == list(EXIT_CODES)


# -- one text, one place --

#: Longest run of words a page may share with another page (the README included). The README's
#: tagline once stood word for word on the home page (24 words): a page links instead.
PAGE_RUN = 20
#: Longest run of words a page may share with the package's docstrings. A definition may be said
#: alike in both; a paragraph copied from a module docstring (31 and 43 words, once) may not: the
#: docstring speaks to a maintainer, the page to a user, and copies drift apart.
DOCSTRING_RUN = 30


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9_']+", text.lower())


def page_prose(path: Path) -> list[str]:
    """A Markdown page's words outside its code blocks (an example may show the same call as a docstring)."""
    return words(re.sub(r"^```.*?^```", " ", path.read_text(), flags=re.S | re.M))


def docstring_words(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = (n for n in ast.walk(tree) if isinstance(n, kinds))
    return words("\n".join(filter(None, (ast.get_docstring(n) for n in nodes))))


def shared_run(a: list[str], b: list[str], limit: int) -> str | None:
    """A run of more than ``limit`` words that stands in both, or None."""
    n = limit + 1
    runs = {tuple(b[i:i + n]) for i in range(len(b) - n + 1)}
    return next((" ".join(a[i:i + n]) for i in range(len(a) - n + 1) if tuple(a[i:i + n]) in runs), None)


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_no_passage_of_one_page_is_repeated_on_another() -> None:
    prose = {path: page_prose(path) for path in PAGES}
    copies = [f"{a.relative_to(ROOT)} ~ {b.relative_to(ROOT)}: {run}"
              for (a, wa), (b, wb) in itertools.combinations(prose.items(), 2)
              if (run := shared_run(wa, wb, PAGE_RUN))]
    assert not copies, "\n".join(copies)


def test_no_page_copies_a_docstring() -> None:
    # Every run of DOCSTRING_RUN + 1 words of every docstring, indexed once (a pair of page and module
    # at a time was 15 s of make check); each page's runs are then looked up in it.
    n = DOCSTRING_RUN + 1
    owners: dict[tuple[str, ...], set[Path]] = {}
    for path in sorted((ROOT / "idemmail_celery").rglob("*.py")):
        doc = docstring_words(path)
        for i in range(len(doc) - n + 1):
            owners.setdefault(tuple(doc[i:i + n]), set()).add(path)
    copies: dict[tuple[Path, Path], str] = {}
    for page in PAGES:
        words = page_prose(page)
        for i in range(len(words) - n + 1):
            for source in owners.get(tuple(words[i:i + n]), ()):
                copies.setdefault((page, source), " ".join(words[i:i + n]))
    assert not copies, "\n".join(f"{page.relative_to(ROOT)} ~ {source.relative_to(ROOT)}: {run}"
                                  for (page, source), run in copies.items())


# -- code quoted from the repository --

def quoted(page: Path) -> list[tuple[str, str]]:
    """The page's Python blocks that open with ``# <a path in the repository>``: (path, code)."""
    return re.findall(r"^```python\n# (\S+/\S+\.py)\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL)


def test_code_a_page_quotes_from_a_file_stands_in_that_file_as_written() -> None:
    """A block headed by a file's path is a run of that file's lines (indented as a whole or not): the page
    shows code that the file's own tests run, and cannot drift from it."""
    missing = []
    for page in PAGES:
        for path, code in quoted(page):
            lines = textwrap.dedent(code).splitlines()
            source = (ROOT / path).read_text().splitlines()
            runs = (textwrap.dedent("\n".join(source[i:i + len(lines)])).splitlines() for i in range(len(source)))
            if lines not in runs:
                missing.append(f"{page.relative_to(ROOT)}: a block quoted from {path} is not in it as written")
    assert missing == []
    assert {path for path, _ in quoted(ROOT / "docs" / "agent-tools.md")} == {
        "examples/agent_mcp.py", "examples/agent_langgraph.py"}  # run by tests/integration/test_examples_agent.py


def test_the_django_page_quotes_every_file_of_the_example_project_whole() -> None:
    """docs/django.md's blocks are examples/django_shop's files (each opens with its own path), run by
    tests/integration/test_django.py."""
    shown = dict(quoted(ROOT / "docs" / "django.md"))
    project = ROOT / "examples" / "django_shop"
    for path in sorted(project.glob("*.py")):
        name = str(path.relative_to(ROOT))
        head, _, body = path.read_text().partition("\n")
        if path.name != "__init__.py":
            assert head == f"# {name}" and shown.get(name) == body, f"docs/django.md does not quote {name} whole"
