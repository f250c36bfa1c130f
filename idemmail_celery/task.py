"""``IdempotentTask``: the Celery adapter of the state machine in :mod:`idemmail_celery.handler`.

``apply_async`` validates the call and sends its intent key in a sealed header (see docs/security.md);
``__call__`` (worker) hands the delivery to the :class:`~idemmail_celery.handler.Handler` and carries out its
answer, every countdown below the broker's visibility timeout (see docs/deployment.md)."""

from __future__ import annotations

import datetime
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn

from celery import Task
from celery import _state as _celery_state
from celery.exceptions import Ignore, Retry
from celery.signals import before_task_publish
from celery.utils.time import maybe_make_aware
from kombu.exceptions import KombuError
from kombu.serialization import dumps as kombu_dumps
from kombu.serialization import loads as kombu_loads

from . import keys as keys_mod
from . import outcomes, redaction, roster
from ._common import logsafe, transport_visibility_timeout
from ._request import RequestState, state_of
from .chain import (
    KEY_HEADER,
    KEY_MARK_HEADER,
    READ_FORMATS,
    SEALED_HEADERS,
    Carry,
    ChainState,
    key_headers,
    next_headers,
)
from .config import Settings
from .encoding import RoundTrip, arguments_problem, is_json_plain
from .errors import (
    ConfigurationError,
    IdemmailError,
    LedgerError,
    PermanentSendError,
    TransientSendError,
    UnserializableArgumentsError,
)
from .handler import Action, Delivery, Handler, Outcome, Policy, Step, say_unreachable_once, wait_out
from .keys import IntentKeyBuilder, KeySpec, Payload, Seal, untrusted_removed
from .ledger import Ledger, backend_for, shared
from .ledger.base import new_owner
from .republish import Republisher

log = logging.getLogger("idemmail_celery")


_warned_no_secret = False
_warned_lock = threading.Lock()


def serializer_round_trip(serializer: str) -> RoundTrip:
    """What Celery's ``serializer`` makes of a value by the worker; ``UnserializableArgumentsError`` if it cannot."""

    def through(value: Any) -> Any:
        if serializer == "json" and is_json_plain(value):
            return value  # the round trip would be the identity: skip two encodings per delay()
        try:
            content_type, encoding, data = kombu_dumps(value, serializer=serializer)  # type: ignore[no-untyped-call]
            return kombu_loads(data, content_type, encoding, accept={content_type})  # type: ignore[no-untyped-call]
        except (KombuError, TypeError, ValueError) as exc:
            message = f"task arguments cannot be serialized with {serializer!r}: {exc}"
            raise UnserializableArgumentsError(message) from exc

    return through


def get_ledger(url: str, options: dict[str, Any] | None = None) -> Ledger:
    """The process-wide ledger for ``url`` (see :func:`idemmail_celery.ledger.shared`)."""
    return shared(url, options)


class _ToldOf(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        try:
            return instance in _told
        except TypeError:  # not weak-referenceable: never one of ours
            return False


class Reported(metaclass=_ToldOf):
    """Matches an error the library logged (but ``ledger_unavailable_gave_up``): in ``throws``, so no traceback."""


_told: weakref.WeakSet[BaseException] = weakref.WeakSet()


class IdempotentTask(Task):  # type: ignore[misc]
    """Base class for tasks whose side effect must happen once per intent: ``@app.task(base=IdempotentTask,
    idempotency_key=("to", "order_id"))``. Task options (all optional; see docs/guarantee.md):

    * ``idempotency_key``: argument names making up the intent, or a function ``(args, kwargs) -> str`` (default:
      every bound argument); ``idempotency_tenant``: the argument namespacing the key (or ``apply_async(...,
      idempotency_tenant=)``); ``idempotency_version`` (1): bump it to send every intent again;
    * ``idempotency_must_match``: arguments a duplicate must repeat exactly (else ``IdempotencyKeyReuseError``);
      ``idempotency_address_fields``: arguments normalised as addresses (default ``to``, ``cc``, ``bcc``,
      ``reply_to``, ``from_``, ``sender``);
    * ``idempotency_carries_key``: the body passes ``self.request.idempotency_key`` to a service that de-duplicates
      on it, so a crashed or ambiguous attempt is retried, not parked; ``idempotency_redact_args`` (True): task
      events, Flower and logs show the key instead of the arguments;
    * the settings in :data:`idemmail_celery.config.SETTINGS` (a transient failure is retried until
      ``idempotency_retry_deadline_seconds``, not ``max_retries``) and Celery's ``retry_backoff``,
      ``retry_backoff_max`` and ``retry_jitter``.

    Callers may pass their own key (``apply_async(..., idempotency_key="order-4821:confirm")``); calling the task
    directly (``task(...)``) runs it without the ledger."""

    abstract = True
    acks_late = True
    reject_on_worker_lost = True
    throws: tuple[type, ...] = (Reported,)
    #: Refuses, in the worker's main process, a message the pool could not take (:mod:`idemmail_celery._request`).
    Request = "idemmail_celery._request:CheckedRequest"

    idempotency_key: KeySpec = None
    idempotency_tenant: str | None = None
    idempotency_version: int = 1
    idempotency_must_match: Sequence[str] = ()
    idempotency_address_fields: Sequence[str] | None = None
    idempotency_carries_key: bool | None = None
    idempotency_ledger_url: str | None = None
    idempotency_lease_seconds: float | None = None
    idempotency_max_reclaims: int | None = None
    idempotency_inflight_max_retries: int | None = None
    idempotency_retry_deadline_seconds: float | None = None
    idempotency_fail_open: bool | None = None
    idempotency_redact_args: bool | None = None

    _idem_settings: Settings | None = None
    _idem_builder: IntentKeyBuilder | None = None
    _idem_ledger: Ledger | None = None
    _idem_handler: Handler | None = None

    # -- configuration, resolved once per task --

    @property
    def idem_settings(self) -> Settings:
        """This task's resolved :class:`~idemmail_celery.config.Settings`."""
        if self._idem_settings is None:
            self._idem_settings = Settings.resolve(self.app.conf, self)
        return self._idem_settings

    @property
    def key_builder(self) -> IntentKeyBuilder:
        """This task's key builder; its first secret is the newest every live worker holds (see ``roster``)."""
        builder = self._idem_builder
        secrets = self.idem_settings.key_secrets
        if len(secrets) > 1:
            secrets = roster.view(self.ledger).order(secrets)
            if builder is not None and builder.secret != secrets:
                builder = None
        if builder is None:
            builder = self._idem_builder = self._new_builder(secrets)
        return builder

    @property
    def seal_checker(self) -> IntentKeyBuilder:
        """A builder checking seals under every configured secret, never reading the roster (the main process)."""
        builder = self._idem_builder
        if builder is None:
            builder = self._idem_builder = self._new_builder(self.idem_settings.key_secrets)
        return builder

    def _new_builder(self, secrets: Sequence[bytes | None]) -> IntentKeyBuilder:
        self._check_options()
        signature = inspect.signature(self.run)
        spec = self.idempotency_key
        if isinstance(spec, list):
            spec = tuple(spec)
        serializer = self.serializer or self.app.conf.task_serializer or "json"
        return IntentKeyBuilder(
            task_name=self.name, signature=signature, spec=spec, tenant_field=self.idempotency_tenant,
            version=self.idempotency_version,
            address_fields=keys_mod.address_fields_for(signature, self.idempotency_address_fields),
            must_match=tuple(self.idempotency_must_match or ()), serializer=serializer,
            secret=tuple(secrets) or None,  # keys are made with the first, found under all
            round_trip=serializer_round_trip(serializer))

    def _check_options(self) -> None:
        global _warned_no_secret
        settings = self.idem_settings
        backend_for(settings.ledger_url)  # unknown scheme: raise now, in the caller
        unsafe = [exc for exc in (getattr(self, "autoretry_for", None) or ())
                  if not (isinstance(exc, type) and issubclass(exc, TransientSendError))]
        if unsafe:
            raise ConfigurationError(f"{self.name}: autoretry_for={unsafe!r} would retry sends that may have gone out; "
                                     "raise TransientSendError (retried) or AmbiguousSendError (made safe) instead")
        if settings.key_secrets:
            return
        if not (settings.allow_plain_keys or settings.ledger_url.startswith("sqlite")):
            raise ConfigurationError(
                f"{self.name}: idemmail_key_secret is not set. Without it intent keys are plain SHA-256, which can "
                "be brute-forced back to guessable arguments (addresses, order ids). Set idemmail_key_secret "
                "(or IDEMMAIL_KEY_SECRET); idemmail_allow_plain_keys=True accepts plain keys on purpose")
        with _warned_lock:
            if not _warned_no_secret:
                _warned_no_secret = True
                log.warning("idemmail: no idemmail_key_secret set; intent keys are plain SHA-256 and can be "
                            "brute-forced back to guessable arguments. Fine for development (the embedded SQLite "
                            "ledger); set idemmail_key_secret in production.")

    @property
    def ledger(self) -> Ledger:
        """The ledger this task claims in (one per process and URL; backends survive forks)."""
        if self._idem_ledger is None:
            s = self.idem_settings
            self._idem_ledger = get_ledger(s.ledger_url, s.ledger_kwargs())
        return self._idem_ledger

    @property
    def policy(self) -> Policy:
        """The state machine's numbers: this task's settings, and Celery's own retry attributes."""
        s = self.idem_settings
        celery_backoff = getattr(self, "retry_backoff", False)
        if celery_backoff:  # the task asked for Celery's curve: honour all three attributes
            factor = 1.0 if celery_backoff is True else float(celery_backoff)
            maximum = float(getattr(self, "retry_backoff_max", 600) or 600)
        else:
            factor, maximum = s.retry_backoff, s.retry_backoff_max
        return Policy(lease_seconds=s.lease_seconds, max_reclaims=s.max_reclaims, fail_open=s.fail_open,
                      inflight_max_retries=s.inflight_max_retries, inflight_backoff=s.inflight_backoff,
                      inflight_backoff_max=s.inflight_backoff_max, retry_backoff=factor, retry_backoff_max=maximum,
                      retry_jitter=bool(getattr(self, "retry_jitter", True)), outage_max_retries=s.outage_max_retries,
                      retry_deadline_seconds=s.retry_deadline_seconds, hop_ttl_seconds=self._hop_ttl())

    def _hop_ttl(self) -> float:
        """How long a reschedule's mark must last: until a copy of the message can no longer come back; 1 h at least."""
        vt = transport_visibility_timeout(self.app)
        return 3600.0 if vt is None else max(3600.0, 2 * vt + 600.0)

    @property
    def handler(self) -> Handler:
        """This task's :class:`~idemmail_celery.handler.Handler` (the task lends it the side effect)."""
        builder = self.key_builder
        if self._idem_handler is None or self._idem_handler.builder is not builder:  # a rotation moved on
            self._idem_handler = Handler(self.ledger, builder, self.policy, self, passthrough=(Retry,))
        return self._idem_handler

    # -- the caller's side --

    def intent_key(self, *args: Any, **kwargs: Any) -> str:
        """The key ``apply_async(args, kwargs)`` would derive (for tests and operators)."""
        return self.key_builder.derive(self.key_builder.payload(args, kwargs))

    def check_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Hook: raise a typed error for a call not to accept, before enqueueing and again before the claim."""

    def intent_headers(self, args: Any = None, kwargs: Any = None, *, explicit: str | None = None,
                       tenant: str | None = None, due: float | None = None) -> dict[str, Any]:
        """Validate a call and derive the headers ``apply_async`` sends (the outbox stores them); ``due``: when a
        countdown or ETA lets it run (epoch seconds). Raises as :meth:`validate_call`."""
        payload = self.validate_call(args, kwargs)
        return self.key_builder.intent_headers(payload, explicit=explicit, tenant=tenant, due=due)

    def key_headers(self, key: str, payload: Payload, older: Sequence[str] = ()) -> dict[str, Any]:
        """Sealed headers putting a derived ``key`` (``older``: under older secrets) on a message for ``payload``."""
        return self.sealed(key_headers(key, older), payload)

    def sealed(self, headers: dict[str, Any], payload: Payload) -> dict[str, Any]:
        """``headers`` sealed for the call ``payload`` (in place; returned): publish points call it last."""
        return self.key_builder.sealed(headers, payload)

    def _received(self, args: Any = None, kwargs: Any = None) -> Payload:
        """The arguments a republished copy of this delivery carries (its own, unless given)."""
        request = self.request
        return Payload(list(request.args or () if args is None else args),
                       dict(request.kwargs or {} if kwargs is None else kwargs))

    def validate_call(self, args: Any, kwargs: Any) -> Payload:
        """Validate a call as ``apply_async`` does and return its arguments as the worker will see them. Raises
        :class:`~idemmail_celery.errors.IdemmailError` subclasses (and ``TypeError`` from ``check_call``)."""
        if type(self).check_call is not IdempotentTask.check_call:  # the base's accepts everything
            self.check_call(tuple(args or ()), dict(kwargs or {}))
        payload = self.key_builder.payload(args, kwargs)
        plain = is_json_plain([payload.args, payload.kwargs])
        self._check_arguments(payload.args, payload.kwargs, plain)
        if not plain:
            payload.to_json()  # the ledger stores JSON in kombu's typed form: fail now if it cannot
        return payload

    def max_argument_size(self) -> int | None:
        """Bound on a call's arguments (about their JSON length; None: none), checked at ``delay()`` and pre-pool."""
        return None

    def accepted_delivery(self) -> bool:
        """Is this worker running a message the library sealed (held to the bounds in force when it was accepted)?"""
        request = self.request
        state = state_of(request, create=False)
        return not request.called_directly and state is not None and KEY_MARK_HEADER in (state.trusted or {})

    def _check_arguments(self, args: Any, kwargs: Any, plain: bool) -> None:
        """Raise :class:`UnserializableArgumentsError` for arguments the worker's main process would refuse."""
        limit = self.max_argument_size()
        if limit is None and plain:
            return  # JSON-plain arguments nest at most 20 levels (keys.is_json_plain)
        problem = arguments_problem(args, kwargs, limit)
        if problem is not None:
            raise UnserializableArgumentsError(problem)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Register the task for redaction on every publish path, and keep :class:`Reported` in its ``throws``."""
        super().on_bound(app)
        if Reported not in cls.throws:  # a task's own throws=(...) adds to the library's
            cls.throws = (*cls.throws, Reported)
        if name := cls.name:
            def redacts() -> bool:
                task = app.tasks.get(name)
                return True if task is None else bool(task.idem_settings.redact_args)

            redaction.register(name, redacts)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Enqueue like Celery, the call validated and its key sent as a header; extra options ``idempotency_key``
        (explicit, hashed) and ``idempotency_tenant``; IdempotencyKeyError or ConfigurationError before enqueueing."""
        headers = self.key_builder.call_headers(
            args, kwargs, options.get("headers") or {}, validate=self.validate_call,
            explicit=options.pop("idempotency_key", None), tenant=options.pop("idempotency_tenant", None),
            due=first_run_time(self.app, options.get("countdown"), options.get("eta")))
        options["headers"] = headers
        if self.idem_settings.redact_args:  # the task option, else idemmail_redact_args, parsed strictly
            options.setdefault("argsrepr", "<redacted>")
            options.setdefault("kwargsrepr", f"<redacted: idempotency key {headers[KEY_HEADER]}>")
        return super().apply_async(args, kwargs, **options)

    # -- the worker's side --

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            return self.run(*args, **kwargs)
        try:
            return self._deliver(request, args, kwargs)
        except BaseException as exc:
            # Printed with its chain wherever it goes: a link quoting an address is cut off.
            redaction.cut_leaking_chain(exc)
            raise

    def _deliver(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        received = dict(request.headers or {})
        payload = Payload(list(args), dict(kwargs))
        headers: dict[str, Any] | None = None  # until the seal is checked: nothing it vouches for is acted on
        try:
            state = state_of(request)
            assert state is not None
            headers = state.trusted = self._trusted(received, payload)
            chain = ChainState.from_headers(headers)
            if not chain.readable:  # written by a newer release: left, as it came, for a worker that reads it
                Republisher(self).wait_as_received(ConfigurationError(
                    f"message header format {chain.format!r} is newer than this worker reads "
                    f"({', '.join(READ_FORMATS)}): upgrade this worker"), self)
            state.rescheduled = chain.rescheduled or bool(request.retries)
            self.ensure_announced()  # before a key is made: a key made on an unread roster may be one not all hold
            key, older = self._claim_key(payload, headers.get(KEY_HEADER), chain)
            # Whatever it publishes next carries this key; not sealed here: every publish point seals last.
            state.key_headers = key_headers(key, older)
            headers.update(state.key_headers)
            Republisher(self).wait_until_due(headers, chain.not_before)
            handler = self.handler
        except (PermanentSendError, Retry, Ignore):
            raise  # a key that cannot be made of the call (refused by name), or the next hop of a wait
        except Exception as exc:
            # Nothing claimed, nothing sent: a set-up error waits on the outage budget rather than end in FAILURE.
            if headers is None:
                headers = untrusted_removed(received)
            if isinstance(exc, LedgerError):  # the roster's check before the claim: said once, as a claim says it
                say_unreachable_once(self.ledger, exc)
            waiting = ChainState.from_headers(headers)
            step = wait_out(self.policy_or_default(), self, Delivery(
                key=waiting.key, task_name=self.name, payload=payload, attempt_id=request.id or "",
                inflight=waiting.inflight, outage=waiting.outage, resume_owners=waiting.owners,
                verdict=waiting.verdict), exc)
            return self._carry_out(step, headers)
        request.idempotency_key = key
        state.owner = owner = new_owner(request.id or "")
        dated = chain.retry_from
        step = handler.handle(Delivery(
            key=key, task_name=self.name, payload=payload, attempt_id=request.id or "", older_keys=older,
            inflight=chain.inflight, outage=chain.outage, resume_owners=chain.owners, verdict=chain.verdict,
            retries=request.retries or 0, max_retries=self.max_retries, enqueued_at=chain.enqueued_at,
            due_at=chain.due_at, retry_from=time.time() if dated is None else dated,
            hop=chain.hop or str(request.id or ""), owner=owner))
        return self._carry_out(step, headers)

    def ensure_announced(self) -> None:
        """In a worker: return once the ledger's key-secret roster holds this worker and, with several key secrets,
        this process has read it (raises :class:`LedgerError`): no key is made or claimed on a guess."""
        found = roster.running.get(id(self.app))
        if found is not None:
            found.ensure(self.ledger)
            if len(self.idem_settings.key_secrets) > 1:
                roster.view(self.ledger).ensure_read()

    def policy_or_default(self) -> Policy:
        """:attr:`policy`, or the defaults when the settings cannot be read (for paths that must go on anyway)."""
        try:
            return self.policy
        except Exception:
            return Policy()

    def _trusted(self, headers: dict[str, Any], payload: Payload) -> dict[str, Any]:
        """All headers under a valid seal, else less those it vouches for (one WARNING); an unknown secret's waits."""
        check = self.key_builder.check_seal(headers, payload)
        if check is Seal.VALID:
            return headers
        if check is Seal.UNKNOWN_SECRET:
            self.wait_for_key_secret(headers)
        ignored = sorted(k for k in headers if k != KEY_HEADER and (k in SEALED_HEADERS or k == KEY_MARK_HEADER))
        if ignored:
            log.warning("idemmail: task %s[%s] carries headers the library did not seal for it (%s: %s); they are "
                        "ignored", logsafe(self.name), logsafe(self.request.id), check.value, ", ".join(ignored))
        return untrusted_removed(headers)

    def _claim_key(self, payload: Payload, carried: Any, chain: ChainState) -> tuple[str, tuple[str, ...]]:
        """The key to claim under and older keys to look for first: a sealed key as is, else hashed, else derived."""
        carried = carried or getattr(self.request, KEY_HEADER, None)
        if carried and chain.sealed:
            return self._rotated(str(carried), payload, chain)
        if carried:
            return self._raw_key(carried, chain.tenant)
        try:
            key = self.key_builder.derive(payload, tenant=chain.tenant)
        except IdemmailError as exc:
            raise PermanentSendError(f"cannot derive an intent key: {exc}", reason="invalid_arguments") from exc
        return self._rotated(key, payload, chain)

    def _rotated(self, key: str, payload: Payload, chain: ChainState) -> tuple[str, tuple[str, ...]]:
        """During a key-secret rotation: the key to claim under and the older keys to look for first."""
        if chain.older_keys is not None:  # sealed; at most one per older secret a rotation can have
            return key, tuple(k for k in chain.older_keys if keys_mod.is_derived_key(k))
        builder, tenant = self.key_builder, chain.tenant
        older = builder.older_keys(payload, tenant=tenant)  # () without a rotation: no work
        if not older:
            return key, ()
        newest = builder.derive(payload, tenant=tenant)
        if key == newest or key in older:
            return newest, older
        return key, ()

    def _raw_key(self, raw: Any, tenant: str | None) -> tuple[str, tuple[str, ...]]:
        """A raw ``idempotency_key`` header's ledger key (hashed: never the raw text) and its older forms."""
        builder = self.key_builder
        try:
            key = builder.explicit_key(raw, tenant=tenant)
        except IdemmailError as exc:
            raise PermanentSendError(f"bad idempotency_key header: {exc}", reason="invalid_arguments") from exc
        return key, builder.older_explicit_keys(raw, tenant=tenant)

    def _carry_out(self, step: Step, headers: dict[str, Any]) -> Any:
        action = step.action
        if action is Action.RETURN:
            return step.value
        if action is Action.DROP:
            raise Ignore()  # acknowledged, no result stored: the copy that published the next hop carries on
        if action is Action.RETRY and step.counted:
            raise self.retry(exc=step.error, countdown=step.countdown,
                             headers=next_headers(headers, step.carry, keep=False))
        if action is Action.RETRY:  # on the time budget the handler checked: Celery's max_retries must not refuse it
            assert isinstance(step.error, Exception)
            Republisher(self).publish_again(step.countdown, next_headers(headers, step.carry, keep=False),
                                            f"retry: {step.error}", step.error, retries=(self.request.retries or 0) + 1)
        if action is Action.RESCHEDULE:
            why = f"{step.outcome.value}: {step.error}" if step.error is not None else step.outcome.value
            assert isinstance(step.error, Exception)
            # A copy of a reschedule whose first copy has not said it published comes back as the same hop.
            Republisher(self).publish_again(
                step.countdown, next_headers(headers, step.carry, keep=True), why, step.error, hop=step.carry.hop,
                published=(lambda: self.handler.published(step)) if step.confirms_hop else None)
        assert step.error is not None
        if step.outcome is not Outcome.LEDGER_GAVE_UP:  # reported by the handler: see Reported
            _told.add(step.error)
        raise step.error

    def retry(self, args: Any = None, kwargs: Any = None, exc: Any = None, throw: bool = True,
              eta: Any = None, countdown: Any = None, max_retries: Any = None, **options: Any) -> Any:
        """Celery's ``retry()``, for a body's own call too: a new reschedule chain, a long countdown split into hops."""
        headers = options.pop("headers", None)
        if headers is None:
            # A body asking to retry: should its claim's release fail, the retry takes it back (its owner travels).
            state = state_of(self.request, create=False) or RequestState()
            owner, trusted = state.owner, state.trusted  # trusted: never what the message carried unsealed
            if trusted is None:
                trusted = untrusted_removed(self.request.headers or {})
            headers = next_headers(trusted, Carry(owners=(owner,) if owner else ()), keep=False)
            headers.update(state.key_headers or {})  # the key claimed (sealed below)
        if countdown is None and eta is None:
            countdown = self.default_retry_delay
        if eta is not None:
            countdown, eta = max(0.0, eta.timestamp() - time.time()), None
        countdown = Republisher(self).split(float(countdown), headers)
        self.sealed(headers, self._received(args, kwargs))  # last: every header the next delivery acts on is set
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, headers=headers, **options)

    def wait_for_key_secret(self, headers: dict[str, Any], running: Task | None = None) -> NoReturn:
        """:meth:`Republisher.wait_for_key_secret` for the message ``running`` (default: this task) runs."""
        Republisher(self).wait_for_key_secret(headers, self if running is None else running)

    def wait_as_received(self, exc: Exception, running: Task) -> NoReturn:
        """:meth:`Republisher.wait_as_received` for the message ``running`` (a campaign) runs."""
        Republisher(self).wait_as_received(exc, running)

    # -- what the task lends the handler (handler.SideEffect) --

    def check(self, payload: Payload) -> None:
        """At the worker, before the claim: the call must fit the task (see :meth:`check_call`)."""
        self.key_builder.bound(payload)  # wrong argument names or count: refused, never stored
        if type(self).check_call is not IdempotentTask.check_call:
            self.check_call(tuple(payload.args), dict(payload.kwargs))

    def perform(self, payload: Payload, key: str) -> Any:
        """Run the body (it reads its key as ``self.request.idempotency_key``)."""
        self.request.idempotency_key = key  # an older key, when the intent was recorded before a rotation
        return self.run(*payload.args, **payload.kwargs)

    def carries_key(self) -> bool:
        """Does the side effect pass the key to a de-duplicating service (a crashed attempt is retried, not parked)?"""
        return self.idem_settings.carries_key

    def writes_ahead(self) -> bool:
        """Does the body call :func:`~idemmail_celery.providers.base.about_to_send` first (docs/guarantee.md)?"""
        return False

    def reconcile(self, key: str, payload: Payload) -> Any | None:
        """Before parking: the service's result if this intent already happened, else None (not proof); default None."""
        return None

    def report(self, outcome: Outcome, key: str, **fields: Any) -> None:
        """One outcome to the log, Flower and metrics (:mod:`idemmail_celery.outcomes`)."""
        outcomes.report(self, outcome, key, **fields)


def first_run_time(app: Any, countdown: Any = None, eta: Any = None) -> float | None:
    """When a message with Celery's ``countdown`` or ``eta`` (naive: app timezone) may run; None without or if bad."""
    try:
        if countdown is not None:
            return time.time() + float(countdown)
        if isinstance(eta, str):
            eta = datetime.datetime.fromisoformat(eta)
        if isinstance(eta, datetime.datetime):
            return float(maybe_make_aware(eta, app.timezone).timestamp())
    except (TypeError, ValueError, OverflowError):
        pass
    return None


def _redact_on_publish(sender: str | None = None, headers: dict[str, Any] | None = None, **rest: Any) -> None:
    """Redact every message of an idempotent task, one still pending in an app not finalized included."""
    unsure = bool(headers) and not redaction.known(sender) and _pending_idempotent(sender)
    redaction.on_before_publish(sender=sender, headers=headers, unsure=unsure, **rest)


def _pending_idempotent(name: str | None) -> bool:
    """Is an idempotent task ``name`` pending in an app not finalized yet? Reads Celery's private ``app._pending``."""
    try:
        for app in list(_celery_state._get_active_apps()):
            if app.finalized:
                continue
            for promise in list(app._pending):
                if promise.__evaluated__():
                    continue
                fun, = object.__getattribute__(promise, "_Proxy__args")
                options = object.__getattribute__(promise, "_Proxy__kwargs")
                base = options.get("base")
                if isinstance(base, type) and issubclass(base, IdempotentTask) and name == (
                        options.get("name") or app.gen_task_name(fun.__name__, fun.__module__)):
                    return True
        return False
    except Exception:  # Celery's internals changed: hide what cannot be told apart
        return True


# Every publish path passes this signal; redaction's rules stay Celery-free, the hook belongs to the adapter.
before_task_publish.connect(_redact_on_publish, weak=False)
