"""What a provider stores of an accepted send (its result's ``extra``) and what it raises on a 2xx
it cannot trust hold none of the message's subject, names or addresses, even quoted at the cut.

The result is stored in the ledger and replayed to every duplicate; the errors reach logs,
Flower and the result backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any

import pytest
from aiosmtpd.smtp import SMTP, Envelope, Session

from idemmail_celery.email import EmailMessage
from idemmail_celery.errors import AmbiguousSendError
from idemmail_celery.providers import from_url
from idemmail_celery.providers._http import MAX_ERROR_TEXT
from idemmail_celery.testing import smtp_sink
from idemmail_celery.testing.smtp_sink import SMTPSink

SUBJECT = "Your  lab\tresults are ready, Annabel"
WORDS = ("lab", "results", "ready", "Annabel", "annabel@example.com")
#: The subject right where a provider's text is cut to MAX_ERROR_TEXT: cut first, it would no longer match.
AT_THE_CUT = "p" * (MAX_ERROR_TEXT - 21) + " " + SUBJECT


def message() -> EmailMessage:
    return EmailMessage.build(sender="Clinic <clinic@example.com>", to="Annabel <annabel@example.com>",
                              subject=SUBJECT, text="See your portal.")


def assert_nothing_personal(shown: str) -> None:
    for word in WORDS:
        assert word not in shown, shown


@pytest.fixture
def answering() -> Iterator[Callable[[int, dict[str, Any]], str]]:
    """An HTTP server that answers every request with one canned status and JSON body."""
    servers: list[ThreadingHTTPServer] = []

    def start(status: int, payload: dict[str, Any]) -> str:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                return None

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("quoted", [SUBJECT, AT_THE_CUT])
def test_a_postmark_2xx_with_an_error_code_quoting_the_subject_shows_none_of_it(
        answering: Callable[[int, dict[str, Any]], str], quoted: str) -> None:
    url = answering(200, {"ErrorCode": 406, "Message": f"{quoted} to annabel@example.com was not sent"})
    provider = from_url("postmark://", api_key="pm-token", base_url=url, timeout=2.0)
    with pytest.raises(AmbiguousSendError) as info:
        provider.send(message(), key="k" * 64)
    provider.close()
    assert "ErrorCode 406" in str(info.value)
    assert_nothing_personal(f"{info.value} {info.value.args!r}")


@pytest.mark.parametrize("name", ["postmark", "ses"])
def test_an_accepted_answer_without_an_id_quoting_the_subject_is_stored_without_it(
        answering: Callable[[int, dict[str, Any]], str], name: str) -> None:
    # The raw answer is kept: the subject's first 15 characters fall before the cut, the rest after it.
    prefix = len(json.dumps({"ErrorCode": 0, "Message": ""})) - 2
    url = answering(200, {"ErrorCode": 0, "Message": "p" * (MAX_ERROR_TEXT - 15 - prefix - 1) + " " + SUBJECT})
    provider = from_url(f"{name}://" if name == "postmark" else "ses://eu-west-1", base_url=url, timeout=2.0,
                        api_key="pm-token" if name == "postmark" else "AKIDEXAMPLE:secret0123456789")
    result = provider.send(message(), key="k" * 64)
    provider.close()
    assert result.message_id == "" and "<redacted>" in result.extra["response"]
    assert_nothing_personal(json.dumps(result.to_dict()))


def test_an_smtp_reply_quoting_the_subject_is_stored_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Some servers echo the Subject (or the recipient) in their final "250 queued" line.
    async def echoing(self: Any, server: SMTP, session: Session, envelope: Envelope) -> str:
        self.sink._record(envelope, session, acknowledged=True)
        return f"250 2.0.0 queued: {' '.join(SUBJECT.split())} for <annabel@example.com>"

    monkeypatch.setattr(smtp_sink._Handler, "handle_DATA", echoing)
    with SMTPSink() as sink:
        provider = from_url(sink.url, timeout=2)
        result = provider.send(message(), key="k" * 64)
        assert sink.count() == 1
    assert result.extra["smtp_reply"].startswith("250 2.0.0 queued: <redacted>")
    assert_nothing_personal(json.dumps(result.to_dict()))
