"""The operator CLI: look at the ledger and resolve what a person must decide.

``celery -A proj idemmail ledger ...`` (the ``celery.commands`` entry point) or ``python -m idemmail_celery``:
every command, and why ``resolve --release`` publishes before it releases, is in docs/operations.md and
docs/security.md ("Operator commands"). Only ``init`` and ``ack-loss`` build the ledger non-``passive``.
Exit codes: :data:`EXIT_CODES`, the one table of them (``--help`` and docs/operations.md are made from it).
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import socket
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
from sqlalchemy.exc import SQLAlchemyError

from ._common import transport_visibility_timeout
from .config import Settings
from .errors import (
    ConfigurationError,
    IdemmailError,
    IllegalTransitionError,
    LedgerUnavailableError,
    PayloadKeyError,
    RecordNotFoundError,
)
from .keys import Payload, secret_ids
from .ledger import DetectsLoss, Ledger, Record, State, from_url, passive_options
from .ledger.listing import RecordQuery, label_of, message_id_of, reason_of
from .ledger.sealed import is_sealed
from .redaction import scrub
from .republish import VISIBILITY_SHARE
from .roster import active_order
from .task import IdempotentTask

EXIT_OK, EXIT_UNEXPECTED, EXIT_USAGE, EXIT_ILLEGAL, EXIT_UNREACHABLE, EXIT_LOST = 0, 1, 2, 3, 4, 5
EXIT_PAYLOAD_KEY, EXIT_UNKNOWN_KEY, EXIT_BROKER = 6, 7, 8

#: Every exit code and what it means: the one table (``--help`` and docs/operations.md are made from it).
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "done",
    EXIT_UNEXPECTED: "an unexpected error (a bug: please report it with the traceback)",
    EXIT_USAGE: "usage error: a wrong option or argument, or settings that do not parse (click's code)",
    EXIT_ILLEGAL: "illegal: the move is not allowed from the record's state, or cannot be done from here (no "
                  "payload to re-enqueue, task not registered, the task refuses the stored payload); the record "
                  "is unchanged",
    EXIT_UNREACHABLE: "the ledger is unreachable",
    EXIT_LOST: "(stats) the ledger lost records and waits for `ledger ack-loss`",
    EXIT_PAYLOAD_KEY: "a record is sealed with a payload key this process does not hold (idemmail_payload_keys); "
                      "nothing printed or changed",
    EXIT_UNKNOWN_KEY: "no record for that key",
    EXIT_BROKER: "(resolve --release) the broker did not take the copy in time; the record is unchanged",
}

#: Seconds a copy re-enqueued by ``resolve --release`` waits before a worker may run it: time for the
#: record to be released after the publish (see :func:`release_countdown`).
RELEASE_COUNTDOWN = 5.0


def release_countdown(app: Any) -> float:
    """The countdown of a released copy: :data:`RELEASE_COUNTDOWN`, capped at a share of the broker's
    visibility timeout (Redis, SQS), so the copy is never handed out again while a worker holds it waiting."""
    vt = transport_visibility_timeout(app)
    return RELEASE_COUNTDOWN if vt is None else min(RELEASE_COUNTDOWN, vt * VISIBILITY_SHARE)


def _exit_help() -> str:
    lines = ["\b", "Exit codes:"]
    for code, meaning in EXIT_CODES.items():
        wrapped = textwrap.wrap(meaning, 76)
        lines.append(f"  {code}  {wrapped[0]}")
        lines += [f"     {more}" for more in wrapped[1:]]
    return "\n".join(lines)


_EXIT_HELP = _exit_help()


class _Ctx:
    def __init__(self, app: Any, ledger_url: str | None, overrides: dict[str, str]) -> None:
        self.app = app
        self.ledger_url = ledger_url
        self.overrides = overrides
        self._ledger: Ledger | None = None

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            if not self.ledger_url and self.app is None:
                raise click.UsageError("no ledger: pass --ledger-url, or -A for the app's")
            settings = _settings(self.app)  # as the app's workers read them (the default ledger URL included)
            url = self.ledger_url or settings.ledger_url
            # The app's retention, keep_payload and payload keys (to open sealed records), then --prefix/--table.
            options = {**settings.ledger_kwargs(), **self.overrides, **passive_options(url)}
            self._ledger = from_url(url, **options)
        return self._ledger


def _settings(app: Any) -> Settings:
    try:
        return Settings.resolve(app.conf if app is not None else {}, None)
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc


def _fail(code: int, message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


class OperatorError(Exception):
    """An operator action refused or cut short (by :func:`decide`, :func:`erase`): :attr:`code` is its exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _when(ts: float | None) -> str:
    return "-" if not ts else dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _line(r: Record) -> str:
    said = message_id_of(r) if r.state is State.SENT else reason_of(r) or message_id_of(r)
    task = r.task_name or "-"
    return f"{r.key}  {r.state.value:<8}  {task:<36}  {_when(r.updated_at)}  {said or '-':<20}  {label_of(r)}"


def _actor() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no login name in a container: still say where from
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@click.group(name="idemmail", epilog=_EXIT_HELP)
@click.option("--ledger-url", envvar="IDEMMAIL_LEDGER_URL", default=None, help="Ledger URL (default: the app's).")
@click.option("--prefix", default=None, help="Redis ledger key prefix (default: the app's, else idemmail).")
@click.option("--table", default=None, help="SQL ledger table (default: the app's, else idemmail_ledger).")
@click.option("--master-name", default=None, help="Sentinel master name for a sentinel:// ledger URL.")
@click.pass_context
def idemmail(ctx: click.Context, ledger_url: str | None, prefix: str | None, table: str | None,
             master_name: str | None) -> None:
    """idemmail-celery operator commands."""
    app = getattr(ctx.obj, "app", None)
    overrides = {k: v for k, v in (("prefix", prefix), ("table", table), ("master_name", master_name)) if v}
    ctx.obj = _Ctx(app, ledger_url, overrides)


class _LedgerCommands(click.Group):
    """The ``ledger`` group: a typed ledger error no command handled is an exit code, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OperatorError as exc:
            _fail(exc.code, str(exc))
        except PayloadKeyError as exc:
            _fail(EXIT_PAYLOAD_KEY, f"{exc} (add the key it was sealed with to idemmail_payload_keys)")
        except LedgerUnavailableError as exc:
            _fail(EXIT_UNREACHABLE, str(exc))


@idemmail.group(cls=_LedgerCommands, epilog=_EXIT_HELP)
def ledger() -> None:
    """Inspect and resolve ledger records."""


@ledger.command("list")
@click.option("--state", type=click.Choice([s.value for s in State]), default=None,
              help="Only the records in this state (default: every state).")
@click.option("--task", default="", help="Only the records of this task (its full name).")
@click.option("--reason", default="", help="Only the records whose error has this reason (lease_expired, ...).")
@click.option("--search", default="", help="Words, each in the key's start, task, message id, template, tag, event "
                                           "id or a recipient's domain.")
@click.option("--since", default=None, help="Only records that entered their state at or after this UTC time "
                                            "(ISO 8601: 2026-11-27 or 2026-11-27T17:05).")
@click.option("--until", default=None, help="... and before this one.")
@click.option("--newest-first", is_flag=True, help="The newest first (default: the oldest, as a queue is worked).")
@click.option("--limit", type=int, default=100, show_default=True, help="Print at most this many records.")
@click.option("--cursor", default=None, help="Start after the last record of an earlier listing (it prints the "
                                             "cursor when there is more).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line (with its non-personal label).")
@click.pass_obj
def list_records(obj: _Ctx, state: str | None, task: str, reason: str, search: str, since: str | None,
                 until: str | None, newest_first: bool, limit: int, cursor: str | None, as_json: bool) -> None:
    """List records, one a line, in the order they entered their state, with a label (template, event id,
    tags, recipients' domains: never an address). The Django admin's review queue lists the same way."""
    if limit < 1:
        raise click.UsageError("--limit is 1 or more")
    try:
        query = RecordQuery(state=State(state) if state else None, task=task, reason=reason, search=search,
                            since=_utc(since, "--since"), until=_utc(until, "--until"), newest_first=newest_first)
        page = obj.ledger.list_records(query, cursor=cursor, limit=limit)
    except ValueError as exc:  # a query or cursor that does not parse
        raise click.UsageError(str(exc)) from exc
    for record in page.records:
        click.echo(json.dumps({**record.to_dict(), "label": str(label_of(record))}, sort_keys=True) if as_json
                   else _line(record))
    if page.next_cursor:
        click.echo(f"... more: --cursor {page.next_cursor}", err=True)


def _utc(text: str | None, option: str) -> float | None:
    """An ISO 8601 date or time as epoch seconds (UTC unless it says otherwise)."""
    if not text:
        return None
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError as exc:
        raise click.UsageError(f"{option} {text!r} is not an ISO 8601 date or time (2026-11-27T17:05)") from exc
    return (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).timestamp()


@ledger.command("show")
@click.argument("key")
@click.option("--payload", "with_payload", is_flag=True, help="Also print the stored first payload (personal data).")
@click.pass_obj
def show(obj: _Ctx, key: str, with_payload: bool) -> None:
    """Show one record as JSON."""
    record = obj.ledger.get(key)
    if record is None:
        _fail(EXIT_UNKNOWN_KEY, f"no ledger record for key {key}")
    out = record.to_dict()
    out["has_payload"] = bool(record.payload)
    if with_payload and is_sealed(record.payload):
        _fail(EXIT_PAYLOAD_KEY, f"record {key}'s payload is sealed and this process holds no idemmail_payload_keys "
                                "(run with the app's settings, -A, or set IDEMMAIL_PAYLOAD_KEYS); nothing printed")
    if with_payload and record.payload:
        payload = Payload.from_json(record.payload)
        out["payload"] = {"args": payload.args, "kwargs": payload.kwargs}
    click.echo(json.dumps(out, sort_keys=True, indent=2, default=str))


@ledger.command("resolve")
@click.argument("key")
@click.option("--sent", "outcome", flag_value="sent", help="It did go out.")
@click.option("--failed", "outcome", flag_value="failed", help="It did not, and must not.")
@click.option("--release", "outcome", flag_value="released",
              help="It did not: queue the stored first payload again (published first; see the exit codes).")
@click.option("--message-id", default=None, help="With --sent: the provider's message id.")
@click.option("--note", required=True, help="Why (kept with the record).")
@click.option("--actor", default=None, help="Who (default: login@host).")
@click.pass_obj
def resolve(obj: _Ctx, key: str, outcome: str | None, message_id: str | None, note: str, actor: str | None) -> None:
    """Decide a record that is not live: review, failed, or an expired claim."""
    if outcome is None:
        raise click.UsageError("say what happened: --sent, --failed or --release")
    if message_id and outcome != "sent":
        raise click.UsageError("--message-id goes with --sent")
    if outcome == "released" and obj.app is None:
        raise click.UsageError("--release re-enqueues the stored payload: run it as `celery -A proj idemmail ...`")
    record = decide(obj, key, outcome, note=note, actor=actor or _actor(), message_id=message_id)
    click.echo(f"{key}: {record.state.value}" + (" (re-enqueued)" if outcome == "released" else ""))


def decide(obj: _Ctx, key: str, outcome: str, *, note: str, actor: str, message_id: str | None = None) -> Record:
    """``resolve``: ``outcome`` is ``sent`` (with the provider's ``message_id``), ``failed`` or ``released``
    (the stored first payload queued again); :class:`OperatorError` when refused."""
    try:
        if outcome == "released":
            return _release(obj, key, note, actor)
        result = {"message_id": message_id, "resolved_by_operator": True} if outcome == "sent" else None
        return obj.ledger.resolve(key, outcome, result=result, note=note, actor=actor)
    except RecordNotFoundError as exc:
        raise OperatorError(EXIT_UNKNOWN_KEY, str(exc)) from exc
    except IllegalTransitionError as exc:
        raise OperatorError(EXIT_ILLEGAL, str(exc)) from exc
    except LedgerUnavailableError as exc:
        raise OperatorError(EXIT_UNREACHABLE, str(exc)) from exc


def _release(obj: _Ctx, key: str, note: str, actor: str) -> Record:
    """Queue the stored first payload, then release the record (docs/security.md, "Operator commands")."""
    current = obj.ledger.get(key)
    if current is None:
        raise RecordNotFoundError(f"no ledger record for key {key}")
    problem = _requeue_problem(obj, current)
    if problem:
        raise IllegalTransitionError(f"record {key} ({current.state.value}): {problem}; left unchanged")
    countdown = release_countdown(obj.app)
    published = time.monotonic()
    _requeue(obj, current, countdown)
    try:
        record = obj.ledger.resolve(key, "released", note=note, actor=actor)
    except (IllegalTransitionError, LedgerUnavailableError) as exc:
        code = EXIT_UNREACHABLE if isinstance(exc, LedgerUnavailableError) else EXIT_ILLEGAL
        raise OperatorError(code, f"{exc}; the record was not released, and the copy just queued will find it "
                                  "unchanged and send nothing") from exc
    if time.monotonic() - published >= countdown / 2:
        # The copy may have met the record before it was released, and sent nothing: queue one now.
        _requeue(obj, record, None, released=True)
    return record


def _requeue_problem(obj: _Ctx, record: Record) -> str | None:
    """Why ``record``'s first payload cannot be re-enqueued from here, or None."""
    if record.state is State.SENT:
        return "it was sent"
    if record.state is State.RELEASED:
        return ("it is already released, so a copy is queued (a retry, or an earlier --release); releasing it "
                "again would queue another")
    if record.state is State.CLAIMED and (record.lease_expires_at or 0) > time.time():
        return "a worker holds a live claim on it"
    task = obj.app.tasks.get(record.task_name)
    if task is None:
        return f"its task {record.task_name} is not registered on this app"
    if not isinstance(task, IdempotentTask):
        return f"its task {record.task_name} is not an IdempotentTask on this app"
    if not record.payload:
        return "its stored payload is gone (erased by `ledger forget`, or when it was sent), nothing to re-enqueue"
    if is_sealed(record.payload):
        raise PayloadKeyError(f"record {record.key}'s payload is sealed with a key this process does not hold; "
                              "left unchanged")
    payload = Payload.from_json(record.payload)
    try:
        # What apply_async and the worker check: a payload stored before a rule was tightened would be
        # refused after the release, leaving the record released with nothing queued.
        task.key_builder.bound(task.validate_call(payload.args, payload.kwargs))
    except (IdemmailError, TypeError) as exc:
        return f"the task refuses its stored payload ({type(exc).__name__}: {scrub(str(exc))}), nothing to re-enqueue"
    return None


def _requeue(obj: _Ctx, record: Record, countdown: float | None, *, released: bool = False) -> None:
    """Publish the stored first payload under the same key, to run ``countdown`` seconds from now;
    :class:`OperatorError` (exit 8 or 3) when the broker does not take it or the task refuses it."""
    task = obj.app.tasks[record.task_name]
    payload = Payload.from_json(record.payload or "")
    state = ("released: it may have nothing queued; check `ledger show` and send it again yourself" if released
             else "left as it was")
    try:
        # The record's key travels sealed as the library's own: the task claims this very record again.
        task.apply_async(payload.args, payload.kwargs, headers=task.key_headers(record.key, payload),
                         countdown=countdown, retry=True, retry_policy={
                             "max_retries": 2, "interval_start": 0.5, "interval_step": 0.5, "interval_max": 1.0})
    except (IdemmailError, TypeError) as exc:
        raise OperatorError(EXIT_ILLEGAL, f"record {record.key}: the task refuses its stored payload ({exc}); "
                                          f"{state}") from exc
    except Exception as exc:  # kombu's OperationalError, a socket error, a timeout: the broker did not take it
        raise OperatorError(EXIT_BROKER, f"the broker did not take the copy of {record.key} "
                                         f"({type(exc).__name__}: {exc}); nothing queued, the record is "
                                         f"{state}") from exc


@ledger.command("purge")
@click.option("--expired", is_flag=True, help="Delete the sent and failed records past their retention (needed: "
                                              "purge never deletes anything else).")
@click.pass_obj
def purge(obj: _Ctx, expired: bool) -> None:
    """Delete records past their retention: run it as `purge --expired`."""
    if not expired:
        raise click.UsageError("say what to purge: --expired (the only records purge deletes)")
    click.echo(f"purged {obj.ledger.purge_expired()} expired records")


@ledger.command("forget")
@click.argument("key")
@click.pass_obj
def forget(obj: _Ctx, key: str) -> None:
    """Erase a record's stored payload (personal data); the key keeps protecting against resends.

    Idempotent: a payload already gone (erased on sent, or forgotten before) exits 0 with "nothing to erase".
    """
    had = erase(obj, key)
    click.echo(f"{key}: payload erased" if had else f"{key}: nothing to erase (no payload stored)")


def erase(obj: _Ctx, key: str) -> bool:
    """``forget``: erase the record's personal data; whether it held a payload. :class:`OperatorError`
    when there is no record or the ledger is unreachable."""
    try:
        try:
            record = obj.ledger.get(key)
            had = record is None or record.payload is not None  # None: expired, but the row may be there
        except PayloadKeyError:  # sealed with a key this process lacks: erasing needs no key
            had = True
        if not obj.ledger.forget(key):
            raise OperatorError(EXIT_UNKNOWN_KEY, f"no ledger record for key {key}")
    except LedgerUnavailableError as exc:
        raise OperatorError(EXIT_UNREACHABLE, str(exc)) from exc
    return had


@ledger.command("stats")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: the count per state, and the Redis ledger's epoch (null on SQL).")
@click.pass_obj
def stats(obj: _Ctx, as_json: bool) -> None:
    """Records per state, and (Redis) whether the store lost records."""
    try:
        counts = obj.ledger.stats()
        markers = _markers(obj.ledger)
        status = markers.loss_status() if markers is not None else None
    except (LedgerUnavailableError, ConfigurationError) as exc:
        _fail(EXIT_UNREACHABLE, str(exc))
    if as_json:
        click.echo(json.dumps({**counts, "epoch": status}, sort_keys=True))
    else:
        for state, n in counts.items():
            click.echo(f"{state:<9} {n}")
        if status is not None:
            click.echo(_epoch_line(status))
    if status is not None and status["state"] == "lost":
        sys.exit(EXIT_LOST)


@ledger.command("secrets")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: the live workers, and the secret keys are made under.")
@click.pass_obj
def key_secrets(obj: _Ctx, as_json: bool) -> None:
    """The key-secret roster: each live worker and the ids of the key secrets it holds, and (with -A)
    the secret this app's processes make keys under now (the newest every live worker holds)."""
    try:
        entries = sorted(obj.ledger.roster(), key=lambda e: e.member)
    except NotImplementedError as exc:
        _fail(EXIT_ILLEGAL, f"{exc}: a key-secret rotation takes two deploys here")
    except (LedgerUnavailableError, ConfigurationError) as exc:
        _fail(EXIT_UNREACHABLE, str(exc))
    mine: tuple[str, ...] = ()
    if obj.app is not None:
        configured = _settings(obj.app).key_secrets
        mine = secret_ids(active_order(configured, entries) if configured else None)
    now = time.time()
    if as_json:
        click.echo(json.dumps({"workers": [{"member": e.member, "secret_ids": list(e.secret_ids),
                                            "expires_in": round(e.expires_at - now, 1)} for e in entries],
                               "keys_made_under": mine[0] if mine else None}, sort_keys=True))
        return
    for e in entries:
        click.echo(f"{e.member:<40}  {','.join(e.secret_ids):<40}  lapses in {e.expires_at - now:.0f} s")
    if not entries:
        click.echo("no live worker has announced itself")
    if mine:
        click.echo(f"this app's processes make keys under {mine[0]} (its secrets: {', '.join(mine)})")


def _markers(led: Ledger) -> DetectsLoss | None:
    """The store if it keeps epoch markers (Redis), else None (SQL: a durable store keeps none)."""
    store = led.backend  # past any wrapper: isinstance must see the store
    return store if isinstance(store, DetectsLoss) else None


def _epoch_line(status: dict[str, Any]) -> str:
    if status["state"] == "lost":
        return f"epoch     LOST: {status['reason']}; after checking the store run `ledger ack-loss --note ...`"
    if status["state"] == "new":
        return ("epoch     none yet (a new ledger: `ledger init` creates it, and so does the first worker "
                "unless auto_init=False)")
    acked = (f"; loss acknowledged by {status['acked_by']} at {_when(float(status['acked_at']))}: {status.get('note')}"
             if status.get("acked_at") else "")
    since = _when(float(status["created_at"]))
    return f"epoch     {status['epoch']} ({status['buckets']} buckets, since {since}){acked}"


@ledger.command("init")
@click.option("--actor", default=None, help="Who (default: login@host).")
@click.pass_obj
def init(obj: _Ctx, actor: str | None) -> None:
    """Start a new, empty Redis ledger's epoch (needed first when it runs with auto_init=False)."""
    markers = _markers(obj.ledger)
    if markers is None:
        click.echo("this ledger is a durable SQL store: no epoch marker to create")
        return
    click.echo(_epoch_line(_marker_op(lambda: markers.init_store(actor=actor or _actor()))))


@ledger.command("migrate")
@click.option("--to", "revision", default="head", show_default=True, help="The revision to upgrade to.")
@click.option("--down-to", "down_to", default=None, metavar="REVISION",
              help="Take the schema back to REVISION instead ('base': drop the ledger's tables and their records).")
@click.pass_obj
def migrate(obj: _Ctx, revision: str, down_to: str | None) -> None:
    """Bring a SQL ledger's tables to a revision through Alembic (needs the migrations extra).

    A ledger made before Alembic kept its history is adopted at the revision its schema shows. Prints the
    revision before and after; exits 2 for a Redis ledger (its layout needs no migration) or an unknown
    revision, 4 when the database cannot be reached.
    """
    from .ledger.sql import SQLLedger
    from .ledger.sql import migrate as schema

    store = obj.ledger.backend
    if not isinstance(store, SQLLedger):
        _fail(EXIT_USAGE, "this ledger is not a SQL ledger: nothing to migrate")
    try:
        before = schema.current(store.engine, table=store.table.name)
        if down_to is not None:
            after = schema.downgrade(store.engine, down_to, table=store.table.name)
        else:
            after = schema.upgrade(store.engine, revision, table=store.table.name)
    except ConfigurationError as exc:
        _fail(EXIT_USAGE, str(exc))
    except Exception as exc:  # Alembic's own: an unknown revision, a refused statement
        if type(exc).__module__.startswith("alembic"):
            _fail(EXIT_USAGE, f"{type(exc).__name__}: {exc}")
        if isinstance(exc, SQLAlchemyError):
            _fail(EXIT_UNREACHABLE, f"{type(exc).__name__}: {exc}")
        raise
    click.echo(f"ledger table {store.table.name}: {before or 'no recorded revision'} -> {after}")


def _marker_op(op: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run an epoch-marker operation; exit 3 when the markers forbid it, 4 when the store cannot say."""
    try:
        return op()
    except IllegalTransitionError as exc:
        _fail(EXIT_ILLEGAL, str(exc))
    except (LedgerUnavailableError, ConfigurationError) as exc:
        _fail(EXIT_UNREACHABLE, str(exc))


@ledger.command("ack-loss")
@click.option("--note", required=True, help="What happened and what was checked (kept in the markers).")
@click.option("--actor", default=None, help="Who (default: login@host).")
@click.pass_obj
def ack_loss(obj: _Ctx, note: str, actor: str | None) -> None:
    """Accept a detected loss: a new epoch, and workers claim again.

    Intents recorded before the loss are forgotten. Copies enqueued before this moment
    are sent only with their key carried downstream, else parked in review
    (reason ledger_lost); copies enqueued later send as usual.
    """
    markers = _markers(obj.ledger)
    if markers is None:
        _fail(EXIT_ILLEGAL, "this ledger is a durable SQL store: it keeps no epoch marker, no loss to acknowledge")
    click.echo(_epoch_line(_marker_op(lambda: markers.acknowledge_loss(note=note, actor=actor or _actor()))))
    click.echo("workers adopt the new epoch at their next claim; intents recorded before the loss are forgotten: "
               "keyless copies enqueued before now go to review (ledger_lost), keyed ones send with their key")


@idemmail.command("mcp")
@click.option("--http", is_flag=True, help="Streamable HTTP at http://HOST:PORT/mcp instead of stdio.")
@click.option("--host", default="127.0.0.1", show_default=True, help="With --http: 127.0.0.1, ::1 or localhost.")
@click.option("--port", type=int, default=8000, show_default=True, help="With --http.")
@click.option("--tools", "tools_path", default=None,
              help="module:attribute of a list of tools to serve (or of a function of the app returning one) "
                   "instead of the email tool and every idempotent_tool of the app.")
@click.pass_obj
def mcp(obj: _Ctx, http: bool, host: str, port: int, tools_path: str | None) -> None:
    """Serve the app's agent tools over MCP (the [mcp] extra): stdio, or streamable HTTP on loopback."""
    if obj.app is None:
        raise click.UsageError("the tools are the app's: run it as `celery -A proj idemmail mcp`")
    try:
        from .contrib.mcp import run_http, run_stdio, server  # the optional extra: imported here only
    except ImportError as exc:
        raise click.UsageError(f"the MCP server needs the mcp extra: pip install 'idemmail-celery[mcp]' ({exc})") \
            from exc
    try:
        mcp_server = server(obj.app, _load_tools(obj.app, tools_path) if tools_path else None)
        if http:
            click.echo(f"idemmail: MCP over streamable HTTP at http://{host}:{port}/mcp", err=True)
            run_http(mcp_server, host=host, port=port)
        else:
            run_stdio(mcp_server)  # stdout is the protocol's: nothing else may print there
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from exc


def _load_tools(app: Any, path: str) -> list[Any]:
    """``module:attribute``: a list of tools, or a function of the app that returns one."""
    from celery.utils.imports import symbol_by_name

    # Here, not at the top: importing tools registers send_email, and every `celery` command loads this module.
    from .tools import IdempotentTool

    try:
        found = symbol_by_name(path.replace(":", ".", 1) if ":" in path else path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise click.UsageError(f"--tools {path}: {exc}") from exc
    tools = found(app) if callable(found) else found
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, IdempotentTool) for t in tools):
        raise click.UsageError(f"--tools {path}: not a list of tools made by idempotent_tool or email_tool")
    return list(tools)


@idemmail.command("docs")
@click.option("--path", "path_only", is_flag=True, help="Print only the directory of the pages (for a script).")
def docs(path_only: bool) -> None:
    """Where the documentation is: its pages on this machine (installed with the package, or in the
    source checkout it runs from), one a line with its title."""
    where = docs_dir()
    if where is None:
        _fail(EXIT_UNEXPECTED, "the documentation's pages are not installed here; they are in the source "
                               "distribution (pip download --no-deps --no-binary :all: idemmail-celery), in docs/")
    if path_only:
        click.echo(str(where))
        return
    from ._version import __version__

    click.echo(f"idemmail-celery {__version__}: the documentation's pages (Markdown) are in {where}")
    click.echo(f"start with {where / 'index.md'}")
    for page in sorted(where.glob("*.md")):
        title = next((line[2:].strip() for line in page.read_text().splitlines() if line.startswith("# ")), page.stem)
        click.echo(f"  {page.name:<24} {title}")


def docs_dir() -> Path | None:
    """The directory of the documentation's pages: ``docs/`` of the source checkout this package is imported
    from, else the one installed with the wheel (``<prefix>/share/doc/idemmail-celery``); None if neither."""
    checkout = Path(__file__).resolve().parents[1] / "docs"
    if (checkout / "index.md").is_file() and (checkout.parent / "mkdocs.yml").is_file():
        return checkout
    from importlib import metadata

    try:
        return installed_docs(metadata.distribution("idemmail-celery"))
    except metadata.PackageNotFoundError:
        return None


def installed_docs(dist: Any) -> Path | None:
    """The pages' directory an installed distribution's RECORD lists (``share/doc/idemmail-celery``), or None."""
    for file in dist.files or ():
        if file.name == "index.md" and file.parent.name == "idemmail-celery" and "doc" in file.parts:
            found = Path(str(dist.locate_file(file))).resolve()
            if found.is_file():
                return found.parent
    return None


def standalone() -> click.Group:
    """The commands as ``python -m idemmail_celery`` runs them: ``idemmail``'s, plus ``-A/--app`` (the Celery
    app, for its settings and for ``resolve --release``)."""

    @click.pass_context
    def load_app(ctx: click.Context, /, app_path: str | None, **options: Any) -> None:
        app = None
        if app_path:
            from celery.app.utils import find_app

            app = find_app(app_path)
        ctx.obj = type("Obj", (), {"app": app})()
        ctx.invoke(idemmail.callback, **options)  # type: ignore[arg-type]  # set by the decorator, never None

    app_option = click.Option(["-A", "--app", "app_path"], default=None,
                              help="Celery app (module:attr): its settings, and the tasks --release re-enqueues.")
    return click.Group(name="idemmail", commands=idemmail.commands, params=[app_option, *idemmail.params],
                       callback=load_app, help=idemmail.help, epilog=_EXIT_HELP)


def main() -> None:
    """``python -m idemmail_celery``: see :func:`standalone`."""
    standalone().main(prog_name="python -m idemmail_celery")
