"""Run the README's quickstart as a newcomer would, with any Python that has the package installed.

The README's first ``python`` block is saved, unchanged, as ``quickstart.py``; the worker is
started with the README's own ``celery -A quickstart worker ...`` line; the fake provider with
its ``python -m idemmail_celery.testing ...`` line; then ``python quickstart.py`` enqueues one
intent three times. The run passes when the script prints what the README says it prints and the
provider (which does not de-duplicate) received exactly one email.

The snippet reads ``REDIS_URL`` and ``PROVIDER_URL`` with local defaults; the run points them at
a private ``redis-server`` and a free port on loopback, so it never meets another run's queue or
ledger. Stdlib only: CI runs it against a wheel installed in a clean venv, and against the
Dockerfile's install line (``python tests/readme_quickstart.py --python VENV/bin/python``);
``tests/integration/test_readme.py`` runs it against the test venv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(text: str, lang: str) -> list[str]:
    """The fenced code blocks of ``text`` in language ``lang``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def snippet(text: str) -> str:
    """The first Python block: the quickstart module."""
    return blocks(text, "python")[0]


def command(text: str, starts: str) -> list[str]:
    """The README's shell line that starts with ``starts``, as argv (comments and a trailing ``&`` dropped)."""
    for block in blocks(text, "sh"):
        for line in block.splitlines():
            if line.startswith(starts):
                return [word for word in shlex.split(line, comments=True) if word != "&"]
    raise LookupError(f"no line starting {starts!r} in the README's sh blocks")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout:.0f} s")
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group; SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


def run(python: str, workdir: Path, *, readme: Path = README, timeout: float = 120.0) -> tuple[str, int]:
    """Run the quickstart with ``python``; (what it printed, emails the provider received)."""
    python = os.path.abspath(python)  # not resolve(): a venv's python is a symlink that must stay one
    text = readme.read_text()
    (workdir / "quickstart.py").write_text(snippet(text))
    redis_port, provider_port = free_port(), free_port()
    env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{redis_port}",
           "PROVIDER_URL": f"http://127.0.0.1:{provider_port}", "PYTHONPATH": str(workdir)}
    env.pop("CELERY_BROKER_URL", None)
    env.pop("CELERY_RESULT_BACKEND", None)
    provider = command(text, "python -m idemmail_celery.testing")
    provider[provider.index("--port") + 1] = str(provider_port)
    worker = command(text, "celery -A quickstart worker")
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child holds it
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        log.close()
        started.append(proc)
        return proc

    try:
        start(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no"], "redis")
        wait(lambda: listening(redis_port), 20, "redis-server")
        start([python, *provider[1:]], "provider")
        wait(lambda: listening(provider_port), 30, "the fake provider")
        proc = start([python, "-m", *worker], "worker")

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {proc.returncode} at start-up (worker.log)")
            return b"ready." in (workdir / "worker.log").read_bytes()

        wait(ready, 60, "the worker")
        done = subprocess.run([python, "quickstart.py"], cwd=workdir, env=env, capture_output=True,
                              timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"quickstart.py failed:\n{done.stderr.decode(errors='replace')}")
        with urllib.request.urlopen(f"http://127.0.0.1:{provider_port}/_fake/deliveries", timeout=10) as reply:
            deliveries = len(json.load(reply))
        return done.stdout.decode().strip(), deliveries
    finally:
        for proc in reversed(started):
            stop(proc)


def expected(text: str) -> str:
    """What the snippet's last ``print`` says it prints (the comment after it)."""
    line = [ln for ln in snippet(text).splitlines() if "print(" in ln][-1]
    return line.split("#", 1)[1].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter that has the package installed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="quickstart-") as tmp:
        try:
            printed, deliveries = run(args.python, Path(tmp))
        except Exception as exc:
            for log in sorted(Path(tmp).glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
            print(f"quickstart: FAILED: {exc}", file=sys.stderr)
            return 1
    want = expected(README.read_text())
    ok = printed == want and deliveries == 1
    print(f"quickstart with {args.python}: printed {printed}, provider received {deliveries} email(s): "
          f"{'OK' if ok else f'FAILED (expected {want} and 1)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
