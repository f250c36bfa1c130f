"""A ledger that wraps another: the base of :class:`~.sealed.SealedLedger` and :class:`~.metered.MeteredLedger`.

Every operation goes to ``inner`` unless the subclass overrides it; any other attribute is the inner backend's,
read through. Wrappers compose: ``MeteredLedger(SealedLedger(RedisLedger(...)))``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Ledger


def forwarded(name: str, around: Callable[[Any, str, Callable[[], Any]], Any] | None = None) -> Any:
    """A wrapper's method calling the same one of ``inner``, through ``around(wrapper, name, call)`` if given."""
    def forward(self: LedgerWrapper, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.inner, name)
        if around is None:
            return method(*args, **kwargs)
        return around(self, name, lambda: method(*args, **kwargs))

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = getattr(Ledger, name).__doc__
    return forward


class LedgerWrapper(Ledger):
    """Forwards every :class:`Ledger` operation to ``inner`` (:func:`forwarded`), and any other attribute."""

    # No Ledger.__init__: retention_seconds and the rest are the backend's, read through __getattr__.
    def __init__(self, inner: Ledger) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling, a failed __init__)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def marks_takeovers(self) -> bool:  # type: ignore[override]
        return self.inner.marks_takeovers

    @property
    def backend(self) -> Ledger:
        """The innermost ledger: the store itself."""
        inner = self.inner
        return inner.backend if isinstance(inner, LedgerWrapper) else inner

    # The store's own moves and reads; Ledger's derived operations (complete, forget, ...) run through these.
    claim = forwarded("claim")
    claim_many = forwarded("claim_many")
    _finish = forwarded("_finish")
    renew = forwarded("renew")
    withdraw = forwarded("withdraw")
    write_ahead = forwarded("write_ahead")
    mark_hop = forwarded("mark_hop")
    hop_marked = forwarded("hop_marked")
    announce = forwarded("announce")
    roster = forwarded("roster")
    get = forwarded("get")
    iter_records = forwarded("iter_records")
    _force = forwarded("_force")
    _erase = forwarded("_erase")
    stats = forwarded("stats")
    purge_expired = forwarded("purge_expired")
    ping = forwarded("ping")
    close = forwarded("close")
    prepare = forwarded("prepare")
    count = forwarded("count")
    _listing_window = forwarded("_listing_window")
