"""``make upgrade-check`` without its workers: which release it installs, what it refuses, its arguments and how it
counts duplicates, lost and stranded intents (upgrade/check.py, upgrade/release.py)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from upgrade import check, release
from upgrade.release import Release, ReleaseError

ROOT = Path(__file__).resolve().parent.parent
RECORD = {"0.1.0": {"commit": "a" * 40, "date": "2026-11-29"},
          "0.9.0": {"commit": "b" * 40, "date": "2026-12-01"},
          "0.10.0": {"commit": "c" * 40, "date": "2026-12-02"}}


# -- which release --

@pytest.mark.parametrize(("current", "expected"), [
    ("0.1.1.dev0", "0.1.0"),
    ("0.9.0", "0.1.0"),  # the release itself is not older than the code it is
    ("0.10.0.dev0", "0.9.0"),  # a development version comes before its release
    ("0.10.1.dev0", "0.10.0"),  # versions, not strings: 0.10.0 is newer than 0.9.0
    ("1.0.0", "0.10.0"),
])
def test_the_release_is_the_newest_one_older_than_the_code(current: str, expected: str, tmp_path: Path) -> None:
    found = release.previous(RECORD, current, cache=tmp_path)
    assert found is not None
    assert (found.version, found.commit) == (expected, RECORD[expected]["commit"])
    assert found.home == tmp_path / expected
    assert found.python == tmp_path / expected / "venv" / "bin" / "python"
    assert found.env()["PYTHONPATH"] == str(tmp_path / expected / "src")


@pytest.mark.parametrize("current", ["0.1.0", "0.1.0.dev0", "0.0.1"])
def test_no_release_older_than_the_code_is_none(current: str) -> None:
    assert release.previous(RECORD, current) is None
    assert release.previous({}, "0.1.1.dev0") is None


def test_the_recorded_release_is_the_one_before_this_code() -> None:
    found = release.previous(release.recorded(), release.current_version())
    assert found is not None and found.version == "0.1.0"
    assert found.home == ROOT / ".upgrade" / "0.1.0"


def test_without_an_older_release_both_runs_the_fixtures_alone_and_release_refuses() -> None:
    assert check.modes("both", RECORD, "0.1.0") == (
        True, None, "upgrade-check: no release older than 0.1.0 in upgrade/releases.json: the golden fixtures alone")
    with pytest.raises(ReleaseError, match=r"no release older than 0\.1\.0"):
        check.modes("release", RECORD, "0.1.0")
    assert check.modes("fixtures", RECORD, "0.1.0") == (True, None, "")


def test_with_an_older_release_the_modes_are_as_asked() -> None:
    both = check.modes("both", RECORD, "0.1.1.dev0")
    assert both[0] is True and both[1] is not None and both[1].version == "0.1.0" and both[2] == ""
    only = check.modes("release", RECORD, "0.1.1.dev0")
    assert only[0] is False and only[1] is not None and only[1].version == "0.1.0"
    assert check.modes("fixtures", RECORD, "0.1.1.dev0") == (True, None, "")


def test_main_without_an_older_release_and_release_only_exits_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(check, "current_version", lambda: "0.0.1")
    assert check.main(["--against", "release"]) == 2
    assert "no release older than 0.0.1" in capsys.readouterr().err


# -- its commit --

def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout


def test_a_commit_missing_from_the_clone_is_a_clear_error(tmp_path: Path) -> None:
    missing = Release("0.1.0", "0123456789" * 4, tmp_path / "0.1.0")
    with pytest.raises(ReleaseError, match=r"release 0\.1\.0: its commit 0123456789.* is not in this clone;"
                                           r" fetch the history and tags first \(git fetch --unshallow --tags\)"):
        release.install(missing, repo=ROOT)
    assert not missing.home.exists()  # nothing made before the commit was found missing


def test_a_shallow_clone_says_so(tmp_path: Path) -> None:
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(shallow)], check=True)
    found = release.previous(release.recorded(), release.current_version(), cache=tmp_path / "cache")
    assert found is not None
    if git(shallow, "rev-parse", "HEAD").strip() == found.commit:
        pytest.skip("HEAD is the release itself: a shallow clone holds it")
    with pytest.raises(ReleaseError, match=r"is not in this clone \(a shallow clone\)"):
        release.check_commit(found, repo=shallow)


def test_main_with_a_missing_commit_exits_2_before_any_worker(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr(check, "recorded", lambda: {"0.0.9": {"commit": "f" * 40, "date": "2026-01-01"}})
    monkeypatch.setattr(check, "run_fixtures", lambda *a: pytest.fail("no run after a failed install"))
    assert check.main(["--against", "both"]) == 2
    assert f"its commit {'f' * 40} is not in this clone" in capsys.readouterr().err


def test_the_release_is_taken_out_of_the_history_at_its_commit(tmp_path: Path) -> None:
    found = release.previous(release.recorded(), release.current_version(), cache=tmp_path)
    assert found is not None
    release.extract(found)
    assert '__version__ = "0.1.0"' in (found.src / "idemmail_celery" / "_version.py").read_text()
    assert (found.src / "constraints.txt").read_text() == git(ROOT, "show", f"{found.commit}:constraints.txt")
    assert (found.src / "upgrade" / "workerapp.py").exists()  # what its workers and its caller import
    assert not (found.src / ".git").exists()


def test_a_complete_install_is_reused_and_an_other_commits_is_not(tmp_path: Path) -> None:
    cached = Release("0.1.0", "9" * 40, tmp_path / "0.1.0")  # a commit no clone holds: looking for it fails
    cached.python.parent.mkdir(parents=True)
    cached.python.write_text("")
    cached.marker.write_text("9" * 40 + "\n")
    assert cached.installed()
    assert release.install(cached) is cached  # neither git nor pip asked
    cached.marker.write_text("8" * 40 + "\n")  # the marker of another commit: installed again, from its commit
    assert not cached.installed()
    with pytest.raises(ReleaseError, match="not in this clone"):
        release.install(cached)
    cached.marker.unlink()
    assert not cached.installed()  # no marker (an install that died half way): made again


# -- arguments --

def test_the_defaults() -> None:
    args = check.parse([])
    assert (args.against, args.intents, args.copies, args.kills, args.phase_kills, args.ledgers) == (
        "both", 24, 3, 3, 2, "redis,postgresql")


def test_arguments_are_read() -> None:
    args = check.parse(["--against", "release", "--intents", "6", "--phase-kills", "0", "--ledgers", "redis"])
    assert (args.against, args.intents, args.phase_kills, args.ledgers) == ("release", 6, 0, "redis")


@pytest.mark.parametrize("argv", [
    ["--against", "latest"],
    ["--ledgers", "redis,mysql"],
    ["--intents", "2"],  # fewer intents than phases
    ["--intents", "0", "--against", "fixtures"],
    ["--copies", "0"],
    ["--phase-kills", "-1"],
    ["--kills", "-1"],
])
def test_arguments_out_of_bounds_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        check.parse(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_batches_cover_every_call_once_in_order() -> None:
    calls = check.calls_for(10, "ns")
    parts = check.batches(calls)
    assert [len(p) for p in parts] == [3, 3, 4]
    assert [c for p in parts for c in p] == calls
    assert [len(p) for p in check.batches(check.calls_for(24, "ns"))] == [8, 8, 8]
    assert len({check.intent_of(c["to"], c["subject"]) for c in calls}) == 10  # one intent each


# -- the counting --

@dataclass
class Sent:
    recipients: tuple[str, ...]
    subject: str


@dataclass
class Rec:
    key: str
    state: str


ANN, BOB_CY = check.intent_of("ann@example.com", "Hi"), check.intent_of(["bob@example.org", "cy@example.net"], "Yo")


def test_every_intent_once_counts_nothing() -> None:
    out = check.count({ANN, BOB_CY}, {"k1", "k2"},
                      [Sent(("ann@example.com",), "Hi"), Sent(("cy@example.net", "bob@example.org"), "Yo")],
                      [Rec("k1", "sent"), Rec("k2", "sent")])
    assert out == {"deliveries": 2, "duplicates": 0, "lost": 0, "stranded": 0, "states": {"sent": 2}}


def test_a_second_delivery_of_an_intent_is_a_duplicate_however_its_addresses_are_written() -> None:
    out = check.count({ANN, BOB_CY}, {"k1", "k2"},
                      [Sent(("ann@example.com",), "Hi"), Sent(("Ann <ANN@example.com>",), "Hi"),
                       Sent(("ann@example.com",), "Hi"), Sent(("bob@example.org", "Cy <cy@example.net>"), "Yo")],
                      [Rec("k1", "sent"), Rec("k2", "sent")])
    assert (out["deliveries"], out["duplicates"], out["lost"], out["stranded"]) == (4, 2, 0, 0)


def test_an_intent_never_delivered_is_lost() -> None:
    out = check.count({ANN, BOB_CY}, {"k1", "k2"}, [Sent(("ann@example.com",), "Hi")],
                      [Rec("k1", "sent"), Rec("k2", "failed")])
    assert (out["duplicates"], out["lost"], out["stranded"]) == (0, 1, 0)
    assert out["states"] == {"failed": 1, "sent": 1}


def test_a_claim_left_or_a_record_under_a_key_the_release_did_not_derive_is_stranded() -> None:
    from idemmail_celery.ledger import State

    out = check.count({ANN, BOB_CY}, {"k1", "k2"},
                      [Sent(("ann@example.com",), "Hi"), Sent(("bob@example.org", "cy@example.net"), "Yo"),
                       Sent(("bob@example.org", "cy@example.net"), "Yo")],
                      [Rec("k1", State.SENT), Rec("k2", State.CLAIMED), Rec("k2-new-namespace", State.SENT)])
    # What a changed key derivation leaves: a second key for one intent, sent twice.
    assert (out["duplicates"], out["lost"], out["stranded"]) == (1, 0, 2)
    assert out["states"] == {"claimed": 1, "sent": 2}


def test_the_table_has_a_row_per_ledger_and_mode() -> None:
    row = {"ledger": "redis", "mode": "release 0.1.0", "intents": 24, "messages": 144, "kills": 6, "deliveries": 24,
           "duplicates": 0, "lost": 0, "stranded": 0, "states": {"sent": 24}, "seconds": 40}
    lines = check.table([row, {**row, "ledger": "postgresql", "mode": "fixtures v1"}]).splitlines()
    assert lines[0].startswith("| ledger | mode | intents | messages | kills |")
    assert lines[2] == "| redis | release 0.1.0 | 24 | 144 | 6 | 24 | 0 | 0 | 0 | {'sent': 24} | 40 |"
    assert lines[3].startswith("| postgresql | fixtures v1 |")
