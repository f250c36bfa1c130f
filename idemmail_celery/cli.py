"""The operator CLI: look at the ledger and resolve what a person must decide.

As a Celery subcommand (the ``celery.commands`` entry point), with the app's settings::

    celery -A proj idemmail ledger list --state review
    celery -A proj idemmail ledger show KEY
    celery -A proj idemmail ledger resolve KEY --sent --message-id MSG --note "seen in provider log"
    celery -A proj idemmail ledger resolve KEY --release --note "provider says not delivered"
    celery -A proj idemmail ledger purge --expired
    celery -A proj idemmail ledger forget KEY
    celery -A proj idemmail ledger stats
    celery -A proj idemmail ledger init
    celery -A proj idemmail ledger ack-loss --note "Redis restarted without AOF at 02:10; checked"

or without Celery's loader: ``python -m idemmail_celery --ledger-url redis://... ledger stats``
(``--release`` then needs ``-A``/``--app`` to re-enqueue).

Keys are hashes; payloads (personal data) are printed only with ``show --payload``.
``init`` and ``ack-loss`` concern the Redis ledger's epoch markers (loss detection, see the
README's "Ledger loss"); SQL ledgers are durable stores and keep none. They are the only
commands that write markers: the others build the ledger ``passive``, so that looking at an
emptied store never starts a new epoch on it (``auto_init``) nor flags it lost.

Exit codes: 0 done, 2 unknown key, 3 illegal transition, 4 ledger unreachable,
5 (``stats``) the ledger is lost and waits for ``ack-loss``, 6 a record is sealed with a
payload key this process does not hold (``idemmail_payload_keys``).
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import socket
import sys
from collections.abc import Callable
from typing import Any

import click

from .config import Settings
from .errors import (
    ConfigurationError,
    IllegalTransitionError,
    LedgerUnavailableError,
    PayloadKeyError,
    RecordNotFoundError,
)
from .keys import Payload
from .ledger import Ledger, Record, State, backend_for, from_url
from .task import KEY_HEADER

EXIT_UNKNOWN_KEY, EXIT_ILLEGAL, EXIT_UNREACHABLE, EXIT_LOST, EXIT_PAYLOAD_KEY = 2, 3, 4, 5, 6


class _Ctx:
    def __init__(self, app: Any, ledger_url: str | None, overrides: dict[str, str]) -> None:
        self.app = app
        self.ledger_url = ledger_url
        self.overrides = overrides
        self._ledger: Ledger | None = None

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            conf = self.app.conf if self.app is not None else {}
            url = self.ledger_url or conf.get("idemmail_ledger_url")
            if not url:
                raise click.UsageError("no ledger: pass --ledger-url or use -A with idemmail_ledger_url set")
            # The app's retention, keep_payload and payload keys (to open sealed records), then --prefix/--table.
            options = {**Settings.resolve(conf, None).ledger_kwargs(), **self.overrides, **passive_options(url)}
            self._ledger = from_url(url, **options)
        return self._ledger


def passive_options(url: str) -> dict[str, Any]:
    """Options that keep a ledger from writing epoch markers (Redis: ``passive``), for reads and metrics.

    An operator's look at the ledger must not start a new epoch on an emptied store, nor flag
    one lost: only ``ledger init`` and ``ledger ack-loss`` write markers.
    """
    return {"passive": True} if callable(getattr(backend_for(url), "loss_status", None)) else {}


def _fail(code: int, message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _when(ts: float | None) -> str:
    return "-" if not ts else dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _line(r: Record) -> str:
    reason = (r.error or {}).get("reason", "")
    msgid = (r.result or {}).get("message_id") or ""
    return f"{r.key}  {r.state.value:<8}  {r.task_name:<36}  {_when(r.updated_at)}  {reason or msgid}"


def _actor() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no login name in a container: still say where from
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@click.group(name="idemmail")
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
        except PayloadKeyError as exc:
            _fail(EXIT_PAYLOAD_KEY, f"{exc} (add the key it was sealed with to idemmail_payload_keys)")
        except LedgerUnavailableError as exc:
            _fail(EXIT_UNREACHABLE, str(exc))
        return None


@idemmail.group(cls=_LedgerCommands)
def ledger() -> None:
    """Inspect and resolve ledger records."""


@ledger.command("list")
@click.option("--state", type=click.Choice([s.value for s in State]), default=None)
@click.option("--limit", type=int, default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_obj
def list_records(obj: _Ctx, state: str | None, limit: int, as_json: bool) -> None:
    """List records, newest first is not guaranteed; filter by state."""
    try:
        for n, record in enumerate(obj.ledger.iter_records(State(state) if state else None)):
            if n >= limit:
                click.echo("... (more; raise --limit)", err=True)
                break
            click.echo(json.dumps(record.to_dict(), sort_keys=True) if as_json else _line(record))
    except LedgerUnavailableError as exc:
        _fail(EXIT_UNREACHABLE, str(exc))


@ledger.command("show")
@click.argument("key")
@click.option("--payload", "with_payload", is_flag=True, help="Also print the stored first payload (personal data).")
@click.pass_obj
def show(obj: _Ctx, key: str, with_payload: bool) -> None:
    """Show one record as JSON."""
    try:
        record = obj.ledger.get(key)
    except LedgerUnavailableError as exc:
        _fail(EXIT_UNREACHABLE, str(exc))
        return
    if record is None:
        _fail(EXIT_UNKNOWN_KEY, f"no ledger record for key {key}")
        return
    out = record.to_dict()
    out["has_payload"] = bool(record.payload)
    if with_payload and record.payload:
        payload = Payload.from_json(record.payload)
        out["payload"] = {"args": payload.args, "kwargs": payload.kwargs}
    click.echo(json.dumps(out, sort_keys=True, indent=2, default=str))


@ledger.command("resolve")
@click.argument("key")
@click.option("--sent", "outcome", flag_value="sent", help="It did go out.")
@click.option("--failed", "outcome", flag_value="failed", help="It did not, and must not.")
@click.option("--release", "outcome", flag_value="released", help="It did not: send the stored first payload now.")
@click.option("--message-id", default=None, help="With --sent: the provider's message id.")
@click.option("--note", required=True, help="Why (kept with the record).")
@click.option("--actor", default=None, help="Who (default: login@host).")
@click.pass_obj
def resolve(obj: _Ctx, key: str, outcome: str | None, message_id: str | None, note: str, actor: str | None) -> None:
    """Decide a record that is not live: review, failed, released, or an expired claim."""
    if outcome is None:
        raise click.UsageError("say what happened: --sent, --failed or --release")
    if message_id and outcome != "sent":
        raise click.UsageError("--message-id goes with --sent")
    if outcome == "released" and obj.app is None:
        raise click.UsageError("--release re-enqueues the stored payload: run it as `celery -A proj idemmail ...`")
    try:
        if outcome == "released":  # check first: never leave a record released with nothing queued
            current = obj.ledger.get(key)
            problem = _requeue_problem(obj, current) if current is not None else None
            if current is not None and problem:
                raise IllegalTransitionError(f"record {key} ({current.state.value}): {problem}, "
                                             "nothing to re-enqueue; left unchanged")
        result = {"message_id": message_id, "resolved_by_operator": True} if outcome == "sent" else None
        record = obj.ledger.resolve(key, outcome, result=result, note=note, actor=actor or _actor())
        if outcome == "released":
            _requeue(obj, record)
    except RecordNotFoundError as exc:
        _fail(EXIT_UNKNOWN_KEY, str(exc))
        return
    except IllegalTransitionError as exc:
        _fail(EXIT_ILLEGAL, str(exc))
        return
    except LedgerUnavailableError as exc:
        _fail(EXIT_UNREACHABLE, str(exc))
        return
    click.echo(f"{key}: {record.state.value}" + (" (re-enqueued)" if outcome == "released" else ""))


def _requeue_problem(obj: _Ctx, record: Record) -> str | None:
    """Why ``record``'s first payload cannot be re-enqueued from here, or None."""
    if obj.app.tasks.get(record.task_name) is None:
        return f"its task {record.task_name} is not registered on this app"
    if not record.payload:
        return "its stored payload is gone (erased by `ledger forget`, or when it was sent)"
    return None


def _requeue(obj: _Ctx, record: Record) -> None:
    """Send the stored first payload again under the same key: no retry is waiting in any queue."""
    problem = _requeue_problem(obj, record)  # checked before resolving: only a concurrent change gets here
    if problem or not record.payload:
        raise IllegalTransitionError(f"record {record.key}: {problem or 'no payload'}; released only")
    task = obj.app.tasks[record.task_name]
    payload = Payload.from_json(record.payload)
    # The key travels as the header, so the task claims this very record again.
    task.apply_async(payload.args, payload.kwargs, headers={KEY_HEADER: record.key})


@ledger.command("purge")
@click.option("--expired", is_flag=True, required=True, help="Delete sent/failed records past retention.")
@click.pass_obj
def purge(obj: _Ctx, expired: bool) -> None:
    """Delete records past their retention."""
    try:
        click.echo(f"purged {obj.ledger.purge_expired()} expired records")
    except LedgerUnavailableError as exc:
        _fail(EXIT_UNREACHABLE, str(exc))


@ledger.command("forget")
@click.argument("key")
@click.pass_obj
def forget(obj: _Ctx, key: str) -> None:
    """Erase a record's stored payload (personal data); the key keeps protecting against resends.

    Idempotent: a payload already gone (erased on sent, or forgotten before) exits 0 with "nothing to erase".
    """
    try:
        try:
            record = obj.ledger.get(key)
            had = record is None or record.payload is not None  # None: expired, but the row may be there
        except PayloadKeyError:  # sealed with a key this process lacks: erasing needs no key
            had = True
        if not obj.ledger.forget(key):
            _fail(EXIT_UNKNOWN_KEY, f"no ledger record for key {key}")
    except LedgerUnavailableError as exc:
        _fail(EXIT_UNREACHABLE, str(exc))
    click.echo(f"{key}: payload erased" if had else f"{key}: nothing to erase (no payload stored)")


@ledger.command("stats")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def stats(obj: _Ctx, as_json: bool) -> None:
    """Records per state, and (Redis) whether the store lost records."""
    try:
        counts = obj.ledger.stats()
        markers = _markers(obj.ledger)
        status = markers.loss_status() if markers is not None else None
    except (LedgerUnavailableError, ConfigurationError) as exc:
        _fail(EXIT_UNREACHABLE, str(exc))
        return
    if as_json:
        click.echo(json.dumps({**counts, "epoch": status}, sort_keys=True))
    else:
        for state, n in counts.items():
            click.echo(f"{state:<9} {n}")
        if status is not None:
            click.echo(_epoch_line(status))
    if status is not None and status["state"] == "lost":
        sys.exit(EXIT_LOST)


def _markers(led: Ledger) -> Any | None:
    """The ledger if it keeps epoch markers (Redis), else None (SQL: a durable store keeps none)."""
    return led if callable(getattr(led, "loss_status", None)) else None


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


def _marker_op(op: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run an epoch-marker operation; exit 3 when the markers forbid it, 4 when the store cannot say."""
    try:
        return op()
    except IllegalTransitionError as exc:
        _fail(EXIT_ILLEGAL, str(exc))
    except (LedgerUnavailableError, ConfigurationError) as exc:
        _fail(EXIT_UNREACHABLE, str(exc))
    raise AssertionError("unreachable: _fail exits")


@ledger.command("ack-loss")
@click.option("--note", required=True, help="What happened and what was checked (kept in the markers).")
@click.option("--actor", default=None, help="Who (default: login@host).")
@click.pass_obj
def ack_loss(obj: _Ctx, note: str, actor: str | None) -> None:
    """Accept a detected loss: a new epoch, and workers claim again.

    Intents recorded before the loss are forgotten. Copies enqueued before this moment
    are sent only with their key carried downstream, else parked in review
    (``ledger_lost``); copies enqueued later send as usual.
    """
    markers = _markers(obj.ledger)
    if markers is None:
        _fail(EXIT_ILLEGAL, "this ledger is a durable SQL store: it keeps no epoch marker, no loss to acknowledge")
        return
    click.echo(_epoch_line(_marker_op(lambda: markers.acknowledge_loss(note=note, actor=actor or _actor()))))
    click.echo("workers adopt the new epoch at their next claim; intents recorded before the loss are forgotten: "
               "keyless copies enqueued before now go to review (ledger_lost), keyed ones send with their key")


def main() -> None:
    """``python -m idemmail_celery``: the same commands; ``--app`` loads a Celery app for its settings."""

    @click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.option("-A", "--app", "app_path", default=None, help="Celery app (module:attr), for its settings.")
    @click.pass_context
    def entry(ctx: click.Context, app_path: str | None) -> None:
        app = None
        if app_path:
            from celery.app.utils import find_app

            app = find_app(app_path)
        holder = type("Obj", (), {"app": app})()
        idemmail.main(args=ctx.args, obj=holder, prog_name="python -m idemmail_celery", standalone_mode=True)

    entry()
