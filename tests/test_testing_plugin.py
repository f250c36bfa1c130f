"""The pytest plugin users get on install: loaded by the entry point, usable beside Celery's own.

Each test runs pytest in a subprocess, in a directory of its own, on files taken from
docs/testing.md as they are written there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .conftest import require_module

pytestmark = pytest.mark.worker  # runs a script or worker process of its own


DOCS = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def files_in_docs() -> dict[str, str]:
    """The page's code blocks that start with a ``# <file name>`` line, by file name."""
    blocks = re.findall(r"^```(?:python|ini)\n# (\S+\.(?:py|ini))\n(.*?)^```", DOCS.read_text(),
                        re.MULTILINE | re.DOTALL)
    return dict(blocks)


def run_pytest(where: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(where)],
                          cwd=where, capture_output=True, text=True, timeout=240)


def run_pytest_in_each(*wheres: Path) -> list[subprocess.CompletedProcess[str]]:
    """Each directory's run in a process of its own, side by side (each is mostly import time)."""
    with ThreadPoolExecutor(max_workers=len(wheres)) as pool:
        return list(pool.map(run_pytest, wheres))


def test_the_documented_example_passes_with_celerys_embedded_worker_beside_pytest_celery(tmp_path: Path) -> None:
    require_module("pytest_celery")  # the test extra installs it: its plugin loads in every run that allows it
    files = files_in_docs()
    assert set(files) == {"pytest.ini", "conftest.py", "test_receipts.py"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    done = run_pytest(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^1 passed in ", done.stdout, re.MULTILINE), done.stdout  # and no ", 1 warning"


def test_fixtures_load_from_the_entry_point_and_an_old_conftest_adds_no_second_copy(tmp_path: Path) -> None:
    test = ("def test_fake_provider_is_there(fake_provider, request):\n"
            "    assert fake_provider.delivery_count() == 0\n"
            "    plugins = [p for p in request.config.pluginmanager.get_plugins()\n"
            "               if getattr(p, '__name__', '') == 'idemmail_celery.testing.fixtures']\n"
            "    assert len(plugins) == 1\n")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "test_plugin.py").write_text(test)
    old = tmp_path / "old"
    old.mkdir()
    (old / "conftest.py").write_text('pytest_plugins = ["idemmail_celery.testing.fixtures"]\n')
    (old / "test_plugin.py").write_text(test)
    for done in run_pytest_in_each(bare, old):
        assert done.returncode == 0, done.stdout + done.stderr
        assert "1 passed" in done.stdout
