"""Key-secret rotation in one deploy: the roster of the secrets each live worker holds (docs/security.md).

Every worker announces the ids of its secrets (:meth:`Ledger.announce`) at start, in the background, then
every :data:`ANNOUNCE_SECONDS` (an entry lapses :data:`ENTRY_SECONDS` after the last), and leaves at a warm
shutdown; no process claims before its announcement landed (:meth:`Announcer.ensure`). Keys and seals are
made under the newest secret every live worker holds (:func:`active_order`), the roster read at most every
:data:`REFRESH_SECONDS` (:class:`RosterView`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence

from ._common import after_fork
from .errors import LedgerError, LedgerUnavailableError
from .keys import secret_ids
from .ledger import Ledger
from .ledger.base import RosterEntry

log = logging.getLogger("idemmail_celery")

#: How often a process reads the roster again (the cost: one read per ledger and process in this time).
REFRESH_SECONDS = 5.0
#: How often a worker announces itself; its entry lapses this long after the last announcement.
ANNOUNCE_SECONDS = 5.0
ENTRY_SECONDS = 45.0
#: How soon the heartbeat tries again while its first announcement has not landed (the ledger down at start).
FIRST_RETRY_SECONDS = 1.0

Secrets = tuple[bytes | None, ...]


def active_order(secrets: Secrets, entries: Sequence[RosterEntry] | None) -> Secrets:
    """``secrets`` (newest first) with the newest one every live worker in ``entries`` holds moved first (the
    others follow in order). No roster (None), or none held by all: the oldest; an empty roster: the newest."""
    if len(secrets) < 2:
        return secrets
    held = [set(e.secret_ids) for e in entries] if entries is not None else None
    chosen = len(secrets) - 1
    if held is not None:
        for n, sid in enumerate(secret_ids(secrets)):
            if all(sid in h for h in held):
                chosen = n
                break
    return (secrets[chosen], *secrets[:chosen], *secrets[chosen + 1:])


class RosterView:
    """One ledger's roster as this process last read it, read again once :data:`REFRESH_SECONDS` have
    passed (by one thread; the others use what was read before). Thread-safe; forgotten after a fork."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._lock = threading.Lock()
        self._entries: list[RosterEntry] | None = None
        self._read_at: float | None = None  # monotonic; None: never read
        self._said = False
        self.kept = True  # False: this ledger keeps no roster
        self._memo: tuple[list[RosterEntry] | None, Secrets, bool, Secrets] | None = None

    def entries(self) -> list[RosterEntry] | None:
        """The live entries; None when this ledger has no roster or it has never been read."""
        read_at = self._read_at
        if read_at is not None and time.monotonic() - read_at < REFRESH_SECONDS:
            return self._entries
        # The first read is waited for (a choice made without it would be the oldest secret's); later ones
        # are made by one thread while the others go on with the last answer.
        if not self._lock.acquire(blocking=read_at is None):
            return self._entries
        try:
            if self._read_at is None or time.monotonic() - self._read_at >= REFRESH_SECONDS:
                self._refresh()
            return self._entries
        finally:
            self._lock.release()

    def _refresh(self) -> None:
        try:
            self._entries = self.ledger.roster()
            self._said = False
        except NotImplementedError:
            self._entries, self.kept = None, False
        except Exception as exc:  # the ledger, its driver: the last answer stands until it answers
            if not self._said:
                self._said = True
                log.warning("idemmail: the key-secret roster could not be read (%s); keys are made as "
                            "last decided", type(exc).__name__)
        self._read_at = time.monotonic()

    @property
    def known(self) -> bool:
        """Has a read answered: the entries (a list, maybe empty), or that the ledger keeps no roster?"""
        return self._entries is not None or not self.kept

    def ensure_read(self) -> None:
        """Return once this process has read the roster (or learnt that the ledger keeps none), reading it now if
        no read has answered yet; :class:`LedgerUnavailableError` if it cannot. A worker calls it before it makes a
        key: until a read answers, :meth:`order` can only take the last secret configured, and in the first step
        of a two-step rotation (``[old, new]``) that is ``new``, which a worker still on ``[old]`` cannot find."""
        if self.known:
            return
        with self._lock:
            if not self.known:
                self._refresh()
        if not self.known:
            raise LedgerUnavailableError("the ledger's key-secret roster could not be read: no key is made before it "
                                         "is (docs/security.md, rotation)")

    def order(self, secrets: Secrets) -> Secrets:
        """:func:`active_order` of ``secrets`` by this roster (no read at all with one secret); as configured
        when the ledger keeps no roster."""
        if len(secrets) < 2:
            return secrets
        entries = self.entries()
        memo = self._memo  # worked out again only when the roster was read again (every few seconds)
        if memo is not None and memo[0] is entries and memo[1] == secrets and memo[2] is self.kept:
            return memo[3]
        kept = self.kept
        order = active_order(secrets, entries) if kept else secrets
        self._memo = (entries, secrets, kept, order)
        return order


_views: dict[int, RosterView] = {}
_views_lock = threading.Lock()


def view(ledger: Ledger) -> RosterView:
    """The process's :class:`RosterView` of ``ledger``."""
    found = _views.get(id(ledger))
    if found is None or found.ledger is not ledger:
        with _views_lock:
            found = _views.get(id(ledger))
            if found is None or found.ledger is not ledger:
                found = _views[id(ledger)] = RosterView(ledger)
    return found


@after_fork
def _forget_views() -> None:
    global _views_lock
    _views_lock = threading.Lock()
    _views.clear()  # a pool child reads for itself (the parent's lock may have been held at the fork)


class Announcer:
    """A worker's heartbeat into its ledgers' rosters: a daemon thread announcing ``member`` every
    :data:`ANNOUNCE_SECONDS`; :meth:`stop` takes it out. Nothing waits for it at start; :meth:`ensure` keeps
    any process of the worker from claiming in a ledger before its roster holds the worker."""

    def __init__(self, member: str, ledgers: Sequence[tuple[Ledger, Sequence[str]]]) -> None:
        self.member, self.ledgers = member, list(ledgers)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: ``id()`` of each ledger whose roster holds this worker (or that keeps none); a forked pool child
        #: inherits what had landed by then.
        self._landed: set[int] = set()
        self._said = False

    def announce(self) -> None:
        """Announce once, now, in every ledger (a ledger that cannot be reached is tried again soon)."""
        for ledger, ids in self.ledgers:
            try:
                self._announce(ledger, ids)
            except LedgerError as exc:
                if not self._said:  # once, until an announcement lands again
                    self._said = True
                    log.warning("idemmail: could not announce this worker's key secrets (%s); its deliveries "
                                "claim nothing until it has", type(exc).__name__)

    def _announce(self, ledger: Ledger, ids: Sequence[str]) -> None:
        with contextlib.suppress(NotImplementedError):  # no roster: nothing to wait for (two-deploy rotations)
            ledger.announce(self.member, ids, ENTRY_SECONDS)
        self._landed.add(id(ledger))
        self._said = False

    def landed(self) -> bool:
        """Has every ledger's roster taken this worker (since it started)?"""
        return all(id(ledger) in self._landed for ledger, _ in self.ledgers)

    def ensure(self, ledger: Ledger) -> None:
        """Return once ``ledger``'s roster holds this worker (announcing now, in this thread, unless one landed
    here or in the parent before the fork). Raises :class:`LedgerError` like :meth:`Ledger.announce`."""
        if id(ledger) in self._landed:
            return
        for known, ids in self.ledgers:
            if known is ledger:
                self._announce(known, ids)
                return

    def start(self) -> Announcer:
        """Start the heartbeat (every :data:`FIRST_RETRY_SECONDS` until the first announcement lands)."""
        self._thread = threading.Thread(target=self._beat, name="idemmail-roster", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        wait = 0.0
        while not self._stop.wait(wait):
            self.announce()
            wait = ANNOUNCE_SECONDS if self.landed() else FIRST_RETRY_SECONDS

    def stop(self) -> None:
        """Stop the heartbeat and leave every roster (a warm shutdown)."""
        self._stop.set()
        for ledger, ids in self.ledgers:
            try:
                ledger.announce(self.member, ids, 0)
            except (NotImplementedError, LedgerError):
                continue


#: The announcer of each app whose worker runs in this process (``worker.py`` starts and stops them; a claim
#: waits on its app's, :meth:`Announcer.ensure`), by ``id(app)``.
running: dict[int, Announcer] = {}
