"""The documentation's generated part: the configuration reference is rendered from ``config.SETTINGS``.

(The whole site is built with ``mkdocs build --strict`` by ``make docs`` in CI.)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
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


def rows(table: str) -> dict[str, list[str]]:
    """setting (or task option) -> its cells, from the Markdown table."""
    out = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        out[(cells[0] or cells[1]).strip("`")] = cells
    return out


def test_every_setting_is_a_row_with_its_option_environment_default_and_doc() -> None:
    table = rows(load_hooks().settings_table())
    assert list(table) == [s.conf for s in config.SETTINGS]
    lease = table["idemmail_lease_seconds"]
    default = next(s.default for s in config.SETTINGS if s.conf == "idemmail_lease_seconds")
    assert lease[:4] == ["`idemmail_lease_seconds`", "`idempotency_lease_seconds`", "", f"`{default:g}`"]
    assert lease[4].startswith("How long a claim holds")
    for setting in config.SETTINGS:
        cells = table[setting.conf]
        option, env = (f"`{name}`" if name else "" for name in (setting.option, setting.env))
        assert cells[1:3] == [option, env]
        assert cells[4], f"{setting.conf} has no doc"


def test_a_secret_default_is_never_shown_and_a_pipe_cannot_break_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    first = config.SETTINGS[0]
    secret = dataclasses.replace(first, conf="idemmail_x", default="s3cr3t", secret=True, doc="a | b")
    monkeypatch.setattr(config, "SETTINGS", (first, secret))
    text = load_hooks().settings_table()
    assert "s3cr3t" not in text
    assert rows(text)["idemmail_x"][3:] == ["(not shown)", "a \\| b"]


def test_links_to_repository_files_keep_their_text_and_others_stay() -> None:
    hooks = load_hooks()
    page = "See [`handler.py`](../idemmail_celery/handler.py), [gone](../nothing.py) and [Ledgers](ledgers.md)."
    assert hooks._unlink_repository_files(page, ROOT / "docs") == (
        "See `handler.py`, [gone](../nothing.py) and [Ledgers](ledgers.md).")
