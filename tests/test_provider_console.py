"""ConsoleProvider (prints) and FileProvider (one .eml per key, never overwritten)."""

from __future__ import annotations

import email
import email.policy
import errno
import hashlib
import io
import logging
import os
import sys
import threading
from pathlib import Path

import pytest

from idemmail_celery.email import EmailMessage
from idemmail_celery.errors import ConfigurationError, TransientSendError
from idemmail_celery.providers import from_url
from idemmail_celery.providers.base import SendResult
from idemmail_celery.providers.console import ConsoleProvider, FileProvider


def key_for(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def make_message(text: str = "Thanks for order 4821.\n") -> EmailMessage:
    return EmailMessage.build(sender="Shop <shop@example.com>", to="Ann <ann@example.com>", cc="bob@example.net",
                              bcc="audit@example.org", subject="Your receipt", text=text)


def eml_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# -- console --


def test_console_prints_summary_and_mime_text_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    provider = from_url("console://")
    assert isinstance(provider, ConsoleProvider)
    assert provider.accepts_idempotency_key is False
    key = key_for("console")

    result = provider.send(make_message(), key=key)

    out = capsys.readouterr().out
    assert result.message_id == f"<{key}@example.com>"
    assert result.provider == "console"
    assert key in out
    assert "recipients: 3" in out  # to, cc and bcc
    assert "subject:    Your receipt" in out
    assert f"Message-ID: {result.message_id}" in out
    assert "Thanks for order 4821." in out
    assert "Bcc" not in out and "audit@example.org" not in out


def test_console_writes_to_a_given_stream_and_does_not_deduplicate() -> None:
    stream = io.StringIO()
    provider = from_url("console://?domain=mail.example.org", stream=stream)
    key = key_for("stream")
    first = provider.send(make_message(), key=key)
    second = provider.send(make_message(), key=key)
    assert first.message_id == second.message_id == f"<{key}@mail.example.org>"
    assert stream.getvalue().count(f"Message-ID: {first.message_id}") == 2


def test_in_a_worker_each_message_is_logged_at_info_not_at_the_redirected_stdouts_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from celery.utils.log import LoggingProxy

    redirected = logging.getLogger("celery.redirected")
    monkeypatch.setattr(sys, "stdout", LoggingProxy(redirected, logging.WARNING))  # as a worker sets it
    key = key_for("worker")
    with caplog.at_level(logging.INFO):
        result = from_url("console://").send(make_message(), key=key)
    mine = [r for r in caplog.records if key in r.getMessage()]
    assert [(r.name, r.levelname) for r in mine] == [("idemmail_celery.providers.console", "INFO")]
    assert f"Message-ID: {result.message_id}" in mine[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_console_rejects_unknown_options() -> None:
    with pytest.raises(ConfigurationError):
        from_url("console://?colour=1")


# -- file --


def test_file_provider_writes_one_eml_per_key_with_the_message_id_from_the_key(tmp_path: Path) -> None:
    provider = from_url(f"file://{tmp_path}/out")
    assert isinstance(provider, FileProvider)
    assert provider.accepts_idempotency_key is True
    key = key_for("file")

    result = provider.send(make_message(), key=key)

    assert eml_files(tmp_path / "out") == [f"{key}.eml"]
    assert result.message_id == f"<{key}@example.com>"
    assert result.extra == {"path": str(tmp_path / "out" / f"{key}.eml"), "created": True}
    parsed = email.message_from_bytes((tmp_path / "out" / f"{key}.eml").read_bytes(), policy=email.policy.default)
    assert parsed["Message-ID"] == result.message_id
    assert parsed["Bcc"] is None
    assert provider.send(make_message(), key=key_for("other")).extra["created"] is True
    assert len(eml_files(tmp_path / "out")) == 2


def test_second_send_with_the_same_key_writes_nothing_and_returns_the_same_id(tmp_path: Path) -> None:
    provider = from_url(f"file://{tmp_path}")
    key = key_for("twice")
    first = provider.send(make_message("first text\n"), key=key)
    path = tmp_path / f"{key}.eml"
    before = (path.read_bytes(), path.stat().st_mtime_ns, path.stat().st_ino)

    second = provider.send(make_message("a rewritten text\n"), key=key)

    assert second.message_id == first.message_id
    assert second.extra["created"] is False
    assert (path.read_bytes(), path.stat().st_mtime_ns, path.stat().st_ino) == before
    assert eml_files(tmp_path) == [f"{key}.eml"]  # and no temporary file left behind


def test_two_threads_sending_the_same_key_at_once_produce_exactly_one_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    provider = from_url(f"file://{tmp_path}")
    key = key_for("race")
    # Hold both writers at the publishing step until both have their own complete temporary file.
    both_ready = threading.Barrier(2, timeout=10)
    real_link = os.link

    def link_when_both_ready(src: str, dst: str) -> None:
        both_ready.wait()
        real_link(src, dst)

    monkeypatch.setattr(os, "link", link_when_both_ready)
    results: list[SendResult] = []
    failures: list[BaseException] = []

    def send(text: str) -> None:
        try:
            results.append(provider.send(make_message(text), key=key))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=send, args=(f"writer {n}\n",)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)

    assert not failures
    assert len(results) == 2
    assert eml_files(tmp_path) == [f"{key}.eml"]
    assert {r.message_id for r in results} == {f"<{key}@example.com>"}
    assert sorted(r.extra["created"] for r in results) == [False, True]
    winner = next(r for r in results if r.extra["created"])
    assert winner.message_id in (tmp_path / f"{key}.eml").read_text()


def test_without_hard_links_the_exclusive_create_still_never_overwrites(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(src: str, dst: str) -> None:
        raise OSError(errno.EPERM, "hard links not supported here")

    monkeypatch.setattr(os, "link", no_links)
    provider = from_url(f"file://{tmp_path}")
    key = key_for("nolink")
    assert provider.send(make_message("first\n"), key=key).extra["created"] is True
    assert provider.send(make_message("second\n"), key=key).extra["created"] is False
    assert "first" in (tmp_path / f"{key}.eml").read_text()
    assert eml_files(tmp_path) == [f"{key}.eml"]


def test_find_sent_reports_a_written_key_only(tmp_path: Path) -> None:
    provider = from_url(f"file://{tmp_path}")
    key = key_for("find")
    assert provider.find_sent(key) is None
    sent = provider.send(make_message(), key=key)
    found = provider.find_sent(key)
    assert found is not None and found.message_id == sent.message_id


def test_a_key_with_path_characters_stays_inside_the_directory(tmp_path: Path) -> None:
    provider = from_url(f"file://{tmp_path}/out")
    provider.send(make_message(), key="../../etc/passwd")
    provider.send(make_message(), key="x" * 300)
    assert len(eml_files(tmp_path / "out")) == 2
    assert eml_files(tmp_path) == ["out"]


def test_a_failed_write_is_transient(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_text("")
    with pytest.raises(TransientSendError) as caught:
        from_url(f"file://{tmp_path}/not-a-dir/out").send(make_message(), key=key_for("io"))
    assert caught.value.reason == "io"


@pytest.mark.parametrize("url", ["file://relative/dir", "file:", "file:///tmp/x?colour=1"])
def test_file_url_must_be_an_absolute_path(url: str) -> None:
    with pytest.raises(ConfigurationError):
        from_url(url)
