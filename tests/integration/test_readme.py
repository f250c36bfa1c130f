"""The README's quickstart runs as pasted: its first Python block, its worker and provider lines.

The same run CI makes with the wheel in a clean venv and with the Dockerfile's install line
(``tests/readme_quickstart.py``), here with the test venv's Python.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ..conftest import service_missing
from ..readme_quickstart import README, expected, run


def test_readme_quickstart_prints_what_it_says_and_sends_one_email(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        service_missing("redis-server (the quickstart runs a private one)", FileNotFoundError("redis-server"))
    printed, deliveries = run(sys.executable, tmp_path)
    assert printed == expected(README.read_text()) == "['duplicate', 'duplicate', 'sent']"
    assert deliveries == 1
