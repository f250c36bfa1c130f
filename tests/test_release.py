"""A release is written down in three places that must agree: the CHANGELOG's dated section, the commit
recorded in ``upgrade/releases.json`` (what ``make upgrade-check`` installs as the release before this code)
and the version in ``_version.py`` at that commit (docs/development.md, "Releases")."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from packaging.version import Version

from idemmail_celery._version import __version__

ROOT = Path(__file__).resolve().parent.parent


def dated_sections() -> dict[str, str]:
    """The CHANGELOG's released versions -> their dates."""
    text = (ROOT / "CHANGELOG.md").read_text()
    return dict(re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", text, re.MULTILINE))


def recorded() -> dict[str, dict[str, str]]:
    return json.loads((ROOT / "upgrade" / "releases.json").read_text())  # type: ignore[no-any-return]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_every_dated_changelog_section_is_a_recorded_release_and_back() -> None:
    sections = dated_sections()
    assert sections, "no released version in CHANGELOG.md"
    assert {version: entry["date"] for version, entry in recorded().items()} == sections


def test_each_recorded_commit_is_in_the_history_and_carries_its_version() -> None:
    for version, entry in recorded().items():
        commit = entry["commit"]
        assert re.fullmatch(r"[0-9a-f]{40}", commit), (version, commit)
        source = git("show", f"{commit}:idemmail_celery/_version.py")  # fails if the commit is not here
        assert f'__version__ = "{version}"' in source, version
        assert f"## [{version}] - {entry['date']}" in git("show", f"{commit}:CHANGELOG.md"), version


def test_the_version_here_is_the_newest_release_or_a_development_version_past_it() -> None:
    newest = max(Version(v) for v in recorded())
    here = Version(__version__)
    assert here == newest or (here.is_devrelease and here > newest), (here, newest)
    if here.is_devrelease:
        head = (ROOT / "CHANGELOG.md").read_text().split("\n## [", 2)[1]
        assert head.startswith("Unreleased]"), "the newest CHANGELOG section must be Unreleased"
