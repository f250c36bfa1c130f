"""Backends chosen by URL scheme, as kombu chooses transports: shared by ledgers and providers."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import ConfigurationError


def scheme_of(url: str, what: str) -> str:
    """``"postgresql+psycopg://..."`` -> ``"postgresql"``; a clear error for anything that is not a URL."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigurationError(f"{what} URL must look like scheme://...; got {url!r}")
    return url.split("://", 1)[0].split("+", 1)[0].lower()


def load(target: str, base: type) -> Any:
    """Import ``"module:Class"`` and check it is a subclass of ``base``."""
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigurationError(f"{target} is not a {base.__name__} subclass")
    return cls
