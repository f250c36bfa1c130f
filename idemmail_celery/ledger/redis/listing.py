"""The Redis ledger's reads of many records: ``iter_records``, ``stats``, and the review queue's pages and tallies.

Indexed states are read from their per-bucket indexes (sorted sets by the time a record entered the state), walked
in order across buckets (:class:`_Walk`), a filter checked in the store by ``listing.lua``. ``sent`` records are
found by one SCAN and an HSCAN of each shelf, and counted by the per-bucket counters."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ..base import Record, State
from ..listing import Counts, Position, RecordQuery, Selection
from .layout import _INDEXED, _unfield
from .plumbing import RedisBase

#: The stretch of an index a listing reads per bucket and call (Redis runs nothing else meanwhile: a few ms).
LISTING_STRETCH = 500

_Scored = tuple[float, str]  # an index entry: (score, member)
_Command = tuple[str, tuple[Any, ...]]


class Listing(RedisBase):
    """Reads of many records (see the module docstring), a mixin of ``RedisLedger``."""

    def iter_records(self, state: State | None = None) -> Iterator[Record]:
        """Indexed states from their indexes; ``sent`` and all records by SCAN (records) and HSCAN (shelves)."""
        self._check_store()
        scanned = None if state in _INDEXED else self._names_by_bucket()
        for b in range(self.buckets):
            if scanned is None:
                assert state is not None
                keys = list(self._call(self.client.zrange, self.names.index(b, state), 0, -1))
            else:
                keys = [self.names.key_of(name) for name in scanned[b]["record"]]
            for i in range(0, len(keys), 500):
                chunk = keys[i:i + 500]
                for key, (h, payload) in zip(chunk, self._read_hashes(chunk), strict=True):
                    if h and (state is None or h.get("s") == state.value):
                        yield self._record(key, h, payload)
            if scanned is not None and state in (None, State.SENT):
                yield from self._shelved(scanned[b]["shelf"])

    def _read_hashes(self, keys: list[str]) -> list[tuple[dict[str, str], str | None]]:
        """Each key's record hash (empty if none) and payload, in one pipeline."""
        read = self._pipeline([(c, (name,)) for k in keys
                               for c, name in (("hgetall", self.names.record(k)), ("get", self.names.payload(k)))])
        return list(zip(read[::2], read[1::2], strict=True))

    def _names_by_bucket(self) -> list[dict[str, list[str]]]:
        """Every bucket's record and shelf names, from one SCAN of the keyspace (not two per bucket)."""
        found: list[dict[str, list[str]]] = [{"record": [], "shelf": []} for _ in range(self.buckets)]
        for name in self._call(self._scan, self.names.everything()):
            sorted_ = self.names.sort(name)
            if sorted_ is not None:
                found[sorted_[0]][sorted_[1]].append(name)
        return found

    def _shelved(self, names: list[str]) -> Iterator[Record]:
        """The ``sent`` records on the shelves ``names``, not yet expired by this process's clock."""
        for name in names:
            cursor = "0"
            while True:
                cursor, items = self._call(self.scripts["page"], keys=[name], args=[cursor, 500])
                chunk = [(_unfield(f), v) for f, v in zip(items[::2], items[1::2], strict=True)]
                payloads = self._pipeline([("get", (self.names.payload(key),)) for key, _ in chunk]) if chunk else []
                now = time.time()
                for (key, value), payload in zip(chunk, payloads, strict=True):
                    record = self._entry_record(key, value, payload)
                    if (record.expires_at or 0) > now:
                        yield record
                if str(cursor) == "0":
                    break

    def stats(self) -> dict[str, int]:
        """Records per state from the indexes and sent counters (one pipeline); expired ones excluded (a ``sent``
        record counts until its expiry's granule ends: at most 1% of the retention, or a minute, late)."""
        self._check_store()
        now_us = time.time() * 1_000_000
        commands: list[_Command] = []
        states: list[str] = []
        for b in range(self.buckets):
            for s in _INDEXED:
                commands.append(("zcount", (self.names.index(b, s), now_us if s.expires else "-inf", "+inf")))
                states.append(s.value)
            commands.append(("hgetall", (self.names.counter(b),)))
            states.append(State.SENT.value)
        counts = {s.value: 0 for s in State}
        for state, n in zip(states, self._pipeline(commands), strict=True):
            if isinstance(n, dict):
                counts[state] += sum(int(v) for k, v in n.items() if int(k) > now_us)
            else:
                counts[state] += int(n)
        return counts

    # -- the review queue (see ``ledger.listing``) --

    def _listing_window(self, query: RecordQuery, position: Position | None, want: int, skip: int) -> Selection:
        """The state's indexes walked across buckets (:class:`_Walk`); ``sent`` and all states: the base class's."""
        if query.state not in _INDEXED:
            return super()._listing_window(query, position, want, skip)
        self._check_store()
        failed_by_time = query.state is State.FAILED and (query.since is not None or query.until is not None)
        skip = skip if not (query.words or failed_by_time) else 0  # the store's matches are exact: skip there
        walk = _Walk(self, query, position)
        found = walk.take(skip + want)
        skipped = min(skip, len(found))
        taken = found[skipped:]
        items = [(at, self._record(at.key, h, payload))
                 for at, (h, payload) in zip(taken, self._read_hashes([at.key for at in taken]), strict=True) if h]
        return Selection(items, None if walk.ended else walk.last, skipped)

    def _listing_call(self, mode: str, query: RecordQuery, bucket: int, keys: list[str],
                      words: tuple[str, ...]) -> tuple[list[str], list[Any]]:
        assert query.state is not None
        names = self.names.listed(bucket, keys, payloads=bool(words))
        if not words:  # the keys themselves are for words only
            return names, [mode, query.state.value, query.task, query.reason, 0]
        # Which words each key starts with, found here: the script is spared a copy of every key.
        starts = "".join("1" if k.lower().startswith(w) else "0" for k in keys for w in words)
        return names, [mode, query.state.value, query.task, query.reason, len(words), *words, starts]

    def count(self, query: RecordQuery | None = None) -> Counts:
        """The listing script's tally of the state's index; ``sent``, all states, ``failed`` by time: base scan."""
        query = query or RecordQuery()
        if query.state not in _INDEXED or (query.state is State.FAILED and (query.since, query.until) != (None, None)):
            return super().count(query)
        self._check_store()
        state = query.state
        assert state is not None
        plain = RecordQuery(state=state, since=query.since, until=query.until)
        cells = Counter[tuple[str, str, int]]()
        lo, hi = _Walk.bounds(plain)
        stretch = LISTING_STRETCH * 2
        starts = dict.fromkeys(range(self.buckets), 0)
        while starts:
            ranges = self._pipeline([("execute_command", ("ZRANGE", self.names.index(b, state), lo, hi, "BYSCORE",
                                                          "LIMIT", at, stretch, "WITHSCORES"))
                                     for b, at in starts.items()])
            calls, scores = [], []
            for (b, at), reply in zip(list(starts.items()), ranges, strict=True):
                found = _scored(reply)
                if found:
                    calls.append(self._listing_call("tally", plain, b, [k for _, k in found], ()))
                    scores.append([s for s, _ in found])
                if len(found) < stretch:
                    del starts[b]
                else:
                    starts[b] = at + len(found)
            self._tally(state, calls, scores, cells)
        return Counts(dict(cells))

    def _tally(self, state: State, calls: list[tuple[list[str], list[Any]]], scores: list[list[float]],
               cells: Counter[tuple[str, str, int]]) -> None:
        """Run the listing script's tallies (``scores``: the records' index scores) into ``cells``."""
        # A failed record is scored by its expiry: its day is the score less the ledger's retention.
        shift = self._retention_ms * 1000 if state is State.FAILED else 0
        for (pairs, numbers), stretch in zip(self._run_scripts(self.scripts["listing"], calls), scores, strict=True):
            named = [(str(pairs[i]), str(pairs[i + 1])) for i in range(0, len(pairs), 2)]
            cells.update((*named[number - 1], int((score - shift) // 86_400_000_000))
                         for number, score in zip(numbers, stretch, strict=True) if number)


class _Walk:
    """The matches of one query in one state, in the listing's order, across every bucket's index: each read a stretch
    at a time (one pipeline), filtered by the listing script; a match is handed out once every bucket still being read
    is past it, so none comes before an earlier one of another bucket."""

    def __init__(self, ledger: Listing, query: RecordQuery, position: Position | None) -> None:
        assert query.state is not None
        self.ledger, self.query, self.newest = ledger, query, query.newest_first
        self.filtered = bool(query.task or query.reason or query.plain_words)
        self.index = [ledger.names.index(b, query.state) for b in range(ledger.buckets)]
        self.lo, self.hi = self.bounds(query)
        start = None if position is None else (position.at, position.key)
        #: Per bucket still being read: how far ((score, key); None: from the start).
        self.read: dict[int, _Scored | None] = dict.fromkeys(range(ledger.buckets), start)
        #: Per bucket: its matches read and not handed out yet, in order.
        self.pending: dict[int, list[_Scored]] = {b: [] for b in range(ledger.buckets)}
        #: Where the walk stands: the last handed out, or where every bucket has been read to.
        self.last: Position | None = position
        self._batch = 0  # entries a bucket is read by at least (grows while a filter keeps too few)

    @staticmethod
    def bounds(query: RecordQuery) -> tuple[str, str]:
        """The index's score range (microseconds) for the query's times; ``failed`` is scored by its expiry."""
        us = 1_000_000
        if query.state is State.FAILED:
            return f"({time.time() * us:.17g}", "+inf"
        return ("-inf" if query.since is None else f"{query.since * us:.17g}",
                "+inf" if query.until is None else f"({query.until * us:.17g}")

    @property
    def ended(self) -> bool:
        return not self.read and not any(self.pending.values())

    def take(self, n: int) -> list[Position]:
        """The next ``n`` matches (fewer at the end)."""
        out: list[Position] = []
        while len(out) < n and not self.ended:
            missing = n - len(out)
            self._top_up(missing)
            frontier = self._frontier()
            taken = self._hand_out(frontier, missing)
            out += taken
            if taken:
                self.last = taken[-1]
            elif frontier is not None and self.filtered:
                self.last = Position(*frontier)  # read this far, nothing found: a later call starts here
        return out

    def _top_up(self, missing: int) -> None:
        """Read on in every bucket with fewer than ``missing`` matches pending."""
        short = [b for b in self.read if len(self.pending[b]) < missing]
        if not short:
            return
        per_bucket = max(32, 2 * -(-missing // len(self.read)))
        kept = sum(len(p) for p in self.pending.values())
        self._fill(short, max(per_bucket, self._batch))
        if self.filtered and sum(len(p) for p in self.pending.values()) - kept < missing:
            # The filter kept too few: read twice as much next time.
            self._batch = min(max(self._batch, per_bucket) * 2, LISTING_STRETCH)

    def _frontier(self) -> _Scored | None:
        """The least far any bucket still being read has got (None: each is read to its end)."""
        live = [p for p in self.read.values() if p is not None]
        if not live:
            return None
        return max(live) if self.newest else min(live)

    def _hand_out(self, frontier: _Scored | None, n: int) -> list[Position]:
        """Up to ``n`` pending matches, in order, none beyond ``frontier``; taken off their bucket's pending."""
        ready = heapq.merge(*([p for p in pending if frontier is None or not _beyond(p, frontier, self.newest)]
                              for pending in self.pending.values()), reverse=self.newest)
        taken = list(itertools.islice(ready, n))
        gone = set(taken)
        for b in self.pending:  # what each bucket gave is the front of its pending
            while self.pending[b] and self.pending[b][0] in gone:
                self.pending[b].pop(0)
        return [Position(*p) for p in taken]

    def _fill(self, buckets: list[int], batch: int) -> None:
        """Read the next ``batch`` entries of ``buckets``' indexes, keeping only matches."""
        replies = iter(self.ledger._pipeline([c for b in buckets for c in self._reads(b, batch)]))
        read = {b: self._advance(b, batch, replies) for b in buckets}
        if self.filtered:
            self._keep_matches(read)
        for b, found in read.items():
            self.pending[b] += found

    def _reads(self, b: int, batch: int) -> list[_Command]:
        """Bucket ``b``'s next stretch, then the entries tied with where it stands."""
        at = self.read[b]
        start = None if at is None else f"({at[0]:.17g}"
        span = (start or self.hi, self.lo, "BYSCORE", "REV") if self.newest else (start or self.lo, self.hi, "BYSCORE")
        out: list[_Command] = [("execute_command", ("ZRANGE", self.index[b], *span, "LIMIT", 0, batch, "WITHSCORES"))]
        if at is not None:  # the entries with the very same score that follow its key
            score = f"{at[0]:.17g}"
            out.append(("execute_command", ("ZRANGE", self.index[b], score, score, "BYSCORE", "WITHSCORES")))
        return out

    def _advance(self, b: int, batch: int, replies: Iterator[Any]) -> list[_Scored]:
        """Bucket ``b``'s entries from its replies (:meth:`_reads`); moves where it stands past them."""
        at = self.read[b]
        found = _scored(next(replies))
        ended = len(found) < batch
        if at is not None:
            ties = sorted(_scored(next(replies)), reverse=self.newest)
            found = [p for p in ties if _beyond(p, at, self.newest)] + found
        if ended:
            del self.read[b]  # its index ends here
        elif found:
            self.read[b] = found[-1]
        return found

    def _keep_matches(self, read: dict[int, list[_Scored]]) -> None:
        """Keep the entries of ``read`` the listing script finds match (one pipeline)."""
        checked = [b for b in read if read[b]]
        verdicts = self.ledger._run_scripts(self.ledger.scripts["listing"], [
            self.ledger._listing_call("check", self.query, b, [key for _, key in read[b]], self.query.plain_words)
            for b in checked])
        for b, flags in zip(checked, verdicts, strict=True):
            read[b] = [p for p, flag in zip(read[b], str(flags), strict=True) if flag == "1"]


def _scored(reply: list[Any]) -> list[_Scored]:
    """A ZRANGE ... WITHSCORES reply (flat, or in pairs as redis-py may hand it) as (score, member) pairs."""
    if reply and isinstance(reply[0], (list, tuple)):
        return [(float(score), str(member)) for member, score in reply]
    return [(float(reply[i + 1]), str(reply[i])) for i in range(0, len(reply), 2)]


def _beyond(p: _Scored, bound: _Scored, newest_first: bool) -> bool:
    """Does ``p`` come after ``bound`` in the order?"""
    return p < bound if newest_first else p > bound
