"""Migration of a Redis ledger written by the real older versions (record layouts 2 and 3) to layout 4.

The older versions are this repository's own code at the commits before each layout changed
(``git archive``), run as separate processes against the shared Redis: they write records as their
workers did, keep writing while the migration is tried (it must refuse), and one of them sleeps through
the migration and wakes up after it (it must write nothing: its next claim fails closed).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from idemmail_celery.errors import LedgerLostError, UnsafeLedgerError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, State, from_url
from idemmail_celery.ledger.redis import RedisLedger

from .conftest import REDIS_URL, drop_ledger, unique, wait_for

pytestmark = pytest.mark.worker  # runs processes of its own (an older version's workers)

ROOT = Path(__file__).resolve().parent.parent

#: An older version's worker, reduced to its ledger moves. ``write N``: N sends, one claim left held, their
#: keys printed; ``loop``: sends until killed, each key printed; ``idle``: one send, then a claim per key
#: read from stdin, printing the claim's status or the error's type.
WRITER = r"""
import os, sys
from idemmail_celery.ledger import ClaimRequest, from_url

url, prefix, mode = sys.argv[1:4]
led = from_url(url, prefix=prefix)

def req(key):
    return ClaimRequest(key=key, task_name="idemmail_celery.send_email", payload="{}", fingerprint="ab" * 32)

def send(key):
    claim = led.claim(req(key))
    led.complete(key, claim.token, {"message_id": "m-" + key[:8]})
    print("sent", key, flush=True)

if mode == "write":
    for _ in range(int(sys.argv[4])):
        send(os.urandom(32).hex())
    held = os.urandom(32).hex()
    led.claim(req(held))
    print("held", held, flush=True)
elif mode == "loop":
    while True:
        send(os.urandom(32).hex())
else:
    send(os.urandom(32).hex())
    for line in sys.stdin:
        try:
            print("claim", led.claim(req(line.strip())).status.value, flush=True)
        except Exception as exc:
            print("claim", type(exc).__name__, flush=True)
"""


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True, timeout=60).stdout


def older_version(layout: int, into: Path) -> Path:
    """This package as it was just before record layout ``layout + 1`` came in (a directory to put on sys.path)."""
    commits = _git("log", "--reverse", "--format=%H", f"-G^LAYOUT = \"{layout + 1}\"", "--",
                   "idemmail_celery/ledger/redis.py").split()
    commit = commits[0] if commits else ""  # the first that touches it: the one that brought it
    assert commit, f"no commit brings layout {layout + 1}: a shallow clone? (fetch the history)"
    archive = subprocess.run(["git", "archive", f"{commit}^", "idemmail_celery"], cwd=ROOT, check=True,
                             capture_output=True, timeout=60).stdout
    target = into / f"layout{layout}"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    (target / "writer.py").write_text(WRITER)
    return target


class OldWorker:
    def __init__(self, version: Path, prefix: str, mode: str, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(version)}
        self.proc = subprocess.Popen([sys.executable, str(version / "writer.py"), REDIS_URL, prefix, mode, *args],
                                     cwd=version, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def line(self) -> list[str]:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        assert text, self.proc.stderr.read() if self.proc.stderr else "no output"
        return text.split()

    def ask(self, key: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(key + "\n")
        self.proc.stdin.flush()
        return self.line()[1]

    def stop(self) -> list[str]:
        """Kill it; the keys it printed as sent meanwhile (each printed once its send was recorded)."""
        self.proc.kill()
        out, _ = self.proc.communicate(timeout=30)
        return [line.split()[1] for line in out.splitlines() if line.startswith("sent ") and len(line) == 69]


def req(key: str) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="idemmail_celery.send_email", payload="{}", fingerprint="ab" * 32)


@pytest.fixture
def prefix() -> Iterator[str]:
    name = unique("mig")
    yield name
    drop_ledger(RedisLedger(REDIS_URL, prefix=name))


def migrates(prefix: str) -> dict[str, int] | None:
    try:
        return RedisLedger(REDIS_URL, prefix=prefix).migrate_layout(quiet_seconds=2)
    except UnsafeLedgerError as exc:
        assert "older version" in str(exc), exc
        return None


@pytest.mark.parametrize("layout", [2, 3])
def test_a_store_of_an_older_layout_is_migrated_only_once_its_workers_stop_and_every_record_answers(
        layout: int, prefix: str, tmp_path: Path) -> None:
    version = older_version(layout, tmp_path)
    first = OldWorker(version, prefix, "write", "20")
    sent = [first.line()[1] for _ in range(20)]
    held = first.line()[1]
    first.stop()
    sleeper = OldWorker(version, prefix, "idle")  # sleeps through the migration, wakes up after it
    sent.append(sleeper.line()[1])
    busy = OldWorker(version, prefix, "loop")
    try:
        sent += [busy.line()[1] for _ in range(5)]
        new = from_url(REDIS_URL, prefix=prefix)  # a worker of this version refuses the old store
        with pytest.raises(UnsafeLedgerError, match="idemmail ledger migrate"):
            new.claim(req(os.urandom(32).hex()))
        with pytest.raises(UnsafeLedgerError, match="older version"):
            RedisLedger(REDIS_URL, prefix=prefix).migrate_layout(quiet_seconds=30)  # the old worker runs
        assert not RedisLedger(REDIS_URL, prefix=prefix).client.exists(new._marker(0))  # nothing changed
    finally:
        sent += busy.stop()
    done = wait_for(lambda: migrates(prefix), timeout=60)  # quiet for 2 s once it stopped: then it runs
    assert isinstance(done, dict) and done["left"] == 0
    if layout == 3:
        assert done["shelved"] >= len(sent)

    led = from_url(REDIS_URL, prefix=prefix)  # what a worker of this version builds
    for key in sent:
        dup = led.claim(req(key))
        assert dup.status is ClaimStatus.DONE and dup.record.result == {"message_id": "m-" + key[:8]}, key
    assert led.claim(req(held)).status is ClaimStatus.BUSY  # the old worker's claim, lease and all
    assert led.stats()["sent"] >= len(sent) and led.stats()["claimed"] >= 1  # (the loop may have left one)
    assert set(sent) <= {r.key for r in led.iter_records(State.SENT)}
    fresh = os.urandom(32).hex()
    led.complete(fresh, led.claim(req(fresh)).token, {"message_id": "m"})

    # The old worker that slept through it wakes up: its claim of a sent key writes nothing.
    assert sleeper.ask(sent[0]) == "LedgerLostError"
    assert sleeper.ask(fresh) == "LedgerLostError"
    sleeper.stop()
    again = OldWorker(version, prefix, "write", "1")  # and one that starts now refuses the store
    out, _ = again.proc.communicate(timeout=60)
    assert again.proc.returncode != 0 and "sent" not in out
    assert led.claim(req(fresh)).status is ClaimStatus.DONE
    assert RedisLedger(REDIS_URL, prefix=prefix).migrate_layout()["left"] == 0  # idempotent: nothing to do


def test_a_layout_4_store_emptied_keeps_older_workers_out(prefix: str, tmp_path: Path) -> None:
    """Emptied (a restart without persistence, a flush), a store loses the fence too; the first worker of
    this version that sees the loss puts it back, so an older worker started then refuses the store
    instead of starting a ledger of its own beside the lost one."""
    led = from_url(REDIS_URL, prefix=prefix)
    key = os.urandom(32).hex()
    led.complete(key, led.claim(req(key)).token, {"message_id": "m"})
    client = RedisLedger(REDIS_URL, prefix=prefix).client
    for name in client.scan_iter(f"{prefix}:*", count=1000):
        client.delete(name)
    with pytest.raises(LedgerLostError):
        led.claim(req(key))
    assert client.hget(led._old_marker(0), "lost")  # type: ignore[attr-defined]
    old = OldWorker(older_version(3, tmp_path), prefix, "write", "1")
    out, _ = old.proc.communicate(timeout=60)
    assert old.proc.returncode != 0 and "sent" not in out
    led.acknowledge_loss(note="test")  # type: ignore[attr-defined]
    assert led.claim(req(key)).status is ClaimStatus.ACQUIRED  # forgotten, as an acknowledged loss says


def test_a_loss_the_older_version_saw_is_not_migrated_away(prefix: str, tmp_path: Path) -> None:
    """Markers an older worker flagged lost stay that version's operator's call: the migration refuses."""
    version = older_version(3, tmp_path)
    first = OldWorker(version, prefix, "write", "2")
    first.line()
    first.stop()
    client = RedisLedger(REDIS_URL, prefix=prefix).client
    client.hset(f"{prefix}:{{03}}:epoch", mapping={"lost": "bucket 3 emptied", "lost_by": "test"})
    with pytest.raises(UnsafeLedgerError, match="bucket 3 emptied"):
        RedisLedger(REDIS_URL, prefix=prefix).migrate_layout(quiet_seconds=0)
    assert not client.exists(f"{prefix}:{{00}}:epoch4") and not client.hget(f"{prefix}:{{00}}:epoch", "lost")


def migrate_command(prefix: str) -> subprocess.CompletedProcess[str]:
    """``ledger migrate`` as an operator runs it (``python -m idemmail_celery``, no app)."""
    return subprocess.run([sys.executable, "-m", "idemmail_celery", "--ledger-url", REDIS_URL, "--prefix", prefix,
                           "ledger", "migrate", "--quiet-seconds", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_migrate_command_exits_3_while_an_older_worker_runs_then_converts(prefix: str, tmp_path: Path) -> None:
    busy = OldWorker(older_version(3, tmp_path), prefix, "loop")
    sent: list[str] = []
    try:
        sent += [busy.line()[1] for _ in range(3)]
        refused = migrate_command(prefix)
        assert refused.returncode == 3 and "older version" in refused.stderr, (refused.stdout, refused.stderr)
    finally:
        sent += busy.stop()
    done = wait_for(lambda: (lambda r: r if r.returncode == 0 else None)(migrate_command(prefix)), timeout=60)
    assert isinstance(done, subprocess.CompletedProcess) and "shelved" in done.stdout and "left 0" in done.stdout
    led = from_url(REDIS_URL, prefix=prefix)
    assert all(led.claim(req(key)).status is ClaimStatus.DONE for key in sent)
