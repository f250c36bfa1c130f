"""Every Python the package claims is the one it is tested on: pyproject.toml's classifiers, its
``requires-python``, the lint and type-check targets, the versions ``.ci/run`` checks, and one pin of
each package per Python in constraints.txt (docs/development.md, "Pythons")."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .conftest import pyproject

ROOT = Path(__file__).resolve().parent.parent


def claimed() -> list[str]:
    prefix = "Programming Language :: Python :: 3."
    return [c.rsplit(" ", 1)[1] for c in pyproject()["project"]["classifiers"] if c.startswith(prefix)]


def test_the_classifiers_claim_every_python_from_the_floor_up_and_lint_and_types_target_the_floor() -> None:
    versions = claimed()
    minors = [int(v.split(".")[1]) for v in versions]
    assert minors == list(range(minors[0], minors[0] + len(minors))), versions  # no gap, in order
    config = pyproject()
    assert config["project"]["requires-python"] == f">={versions[0]}"
    assert config["tool"]["ruff"]["target-version"] == "py" + versions[0].replace(".", "")
    assert config["tool"]["mypy"]["python_version"] == versions[0]


def test_ci_checks_each_python_the_classifiers_claim() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    [line] = [line for line in script.splitlines() if line.startswith("claimed=$(")]
    out = subprocess.run(["bash", "-c", f"{line}; echo \"$claimed\""], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == claimed()
    assert re.search(r'^for version in \$claimed; do$', script, re.MULTILINE)
    assert 'make check PYTHON="$python" VENV=".venv-$version"' in script


def test_constraints_pin_each_package_once_on_each_python() -> None:
    pins = [Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    assert all(len(pin.specifier) == 1 and next(iter(pin.specifier)).operator == "==" for pin in pins)
    for version in claimed():
        environment = {"python_version": version, "python_full_version": f"{version}.0"}
        names = Counter(canonicalize_name(pin.name) for pin in pins
                        if pin.marker is None or pin.marker.evaluate(environment))
        assert [name for name, n in names.items() if n > 1] == [], version


def test_the_django_classifiers_name_exactly_the_series_the_django_tests_run_on() -> None:
    """5.2 from constraints.txt (``make test``), and the series ``.ci/run`` installs beside it for a second run."""
    claimed_django = {c.rsplit(" ", 1)[1] for c in pyproject()["project"]["classifiers"]
                      if c.startswith("Framework :: Django :: ")}
    [pin] = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("Django==")]
    pinned = ".".join(pin.split("==")[1].split(".")[:2])
    second = re.findall(r"'Django>=(\d+\.\d+),<", (ROOT / ".ci" / "run").read_text())
    assert claimed_django == {pinned, *second} and len(second) == 1, (claimed_django, pinned, second)
