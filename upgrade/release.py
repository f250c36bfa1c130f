"""The release before this code, installed for ``make upgrade-check``: its source and a virtualenv of its own.

``upgrade/releases.json`` records every release (``{"0.1.0": {"commit": sha, "date": ...}}``); the release the
check runs beside this code is the newest one older than ``idemmail_celery.__version__``. Its commit is taken out of
this repository's history (``git archive``) into ``.upgrade/<version>/src``, and installed, with that commit's own
``constraints.txt`` and the extras its workers need (Redis, PostgreSQL), into ``.upgrade/<version>/venv``. A marker
file written after a successful install (it names the commit) makes the next run reuse both.

    python -m upgrade.release        # installs (or finds) the release; prints its version, Python and source
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "upgrade" / "releases.json"
CACHE = ROOT / ".upgrade"
#: What the release's workers and callers import beyond its core dependencies: the Redis and PostgreSQL ledgers.
EXTRAS = "redis,postgres"
MARKER = ".installed"


class ReleaseError(RuntimeError):
    """The release cannot be installed (its commit is not in this clone, the install failed)."""


@dataclass(frozen=True)
class Release:
    version: str
    commit: str
    home: Path

    @property
    def src(self) -> Path:
        return self.home / "src"

    @property
    def venv(self) -> Path:
        return self.home / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def marker(self) -> Path:
        return self.venv / MARKER

    def installed(self) -> bool:
        """Is the release's install complete (the marker names this commit)?"""
        try:
            return self.marker.read_text().strip() == self.commit and self.python.exists()
        except OSError:
            return False

    def env(self) -> dict[str, str]:
        """What a process of the release runs with: its own source first on the path, nothing of this code's."""
        return {"PYTHONPATH": str(self.src), "VIRTUAL_ENV": str(self.venv)}


def current_version() -> str:
    from idemmail_celery._version import __version__

    return __version__


def previous(record: dict[str, dict[str, str]], current: str, cache: Path = CACHE) -> Release | None:
    """The newest release in ``record`` older than ``current``; None when there is none."""
    here = Version(current)
    older = sorted((Version(v), v) for v in record if Version(v) < here)
    if not older:
        return None
    version = older[-1][1]
    return Release(version, record[version]["commit"], cache / version)


def recorded(path: Path = RECORD) -> dict[str, dict[str, str]]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def git(*args: str, repo: Path = ROOT) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, check=False)


def check_commit(release: Release, repo: Path = ROOT) -> None:
    """Raise :class:`ReleaseError` unless the release's commit is in ``repo``'s history."""
    if git("cat-file", "-e", f"{release.commit}^{{commit}}", repo=repo).returncode != 0:
        shallow = git("rev-parse", "--is-shallow-repository", repo=repo).stdout.decode().strip() == "true"
        raise ReleaseError(
            f"release {release.version}: its commit {release.commit} is not in this clone"
            + (" (a shallow clone)" if shallow else "")
            + "; fetch the history and tags first (git fetch --unshallow --tags), or run the fixtures alone"
              " (--against fixtures)")


def extract(release: Release, repo: Path = ROOT) -> None:
    """``git archive`` of the release's commit into ``release.src`` (made again from nothing)."""
    check_commit(release, repo)
    shutil.rmtree(release.src, ignore_errors=True)
    release.src.mkdir(parents=True)
    archive = release.home / "src.tar"
    done = git("archive", "--format=tar", "-o", str(archive), release.commit, repo=repo)
    if done.returncode != 0:
        raise ReleaseError(f"release {release.version}: git archive failed: {done.stderr.decode().strip()}")
    unpacked = subprocess.run(["tar", "-xf", str(archive), "-C", str(release.src)], capture_output=True, text=True,
                              check=False)
    archive.unlink()
    if unpacked.returncode != 0:
        raise ReleaseError(f"release {release.version}: tar failed: {unpacked.stderr.strip()}")


def install(release: Release, repo: Path = ROOT, quiet: bool = True) -> Release:
    """The release's source and virtualenv, made unless a complete install is there already."""
    if release.installed():
        return release
    check_commit(release, repo)
    release.marker.unlink(missing_ok=True)
    extract(release, repo)
    shutil.rmtree(release.venv, ignore_errors=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(release.venv)
    constraints = release.src / "constraints.txt"
    cmd = [str(release.python), "-m", "pip", "install", *(["-q"] if quiet else []),
           *(["-c", str(constraints)] if constraints.exists() else []), f"{release.src}[{EXTRAS}]"]
    done = subprocess.run(cmd, cwd=release.src, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ReleaseError(f"release {release.version}: pip install failed:\n{done.stdout}{done.stderr}")
    answer = subprocess.run([str(release.python), "-c", "import idemmail_celery; print(idemmail_celery.__version__)"],
                            cwd=release.src, env={"PATH": "/usr/bin:/bin", **release.env()}, capture_output=True,
                            text=True, check=False)
    if answer.stdout.strip() != release.version:
        raise ReleaseError(f"release {release.version}: its venv imports version {answer.stdout.strip()!r}"
                           f" {answer.stderr.strip()}")
    release.marker.write_text(release.commit + "\n")
    return release


def main() -> int:
    release = previous(recorded(), current_version())
    if release is None:
        print(f"no release older than {current_version()} in {RECORD.relative_to(ROOT)}")
        return 0
    try:
        install(release, quiet=False)
    except ReleaseError as exc:
        print(f"upgrade.release: {exc}", file=sys.stderr)
        return 1
    print(f"{release.version} {release.python} {release.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
