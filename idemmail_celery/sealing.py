"""Fernet keys as ``idemmail_payload_keys`` uses them (:mod:`idemmail_celery.ledger.sealed`): the first seals,
every one opens. Apart from the ledger, so that settings can check the keys in the caller, as they are read.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ConfigurationError, PayloadKeyError

INSTALL_HINT = "pip install 'idemmail-celery[crypto]'"
#: As the first of the payload keys: write plaintext, open with the keys that follow.
PLAIN = "plain"


class Keyring:
    """Seals and opens text with a list of Fernet keys: the first seals (a first ``"plain"``: none), all open.

    Raises :class:`ConfigurationError` without ``cryptography`` or for a bad key (never echoed).
    """

    def __init__(self, keys: Sequence[str | bytes]) -> None:
        try:
            from cryptography.fernet import Fernet, InvalidToken, MultiFernet
        except ImportError as exc:
            raise ConfigurationError(f"idemmail_payload_keys is set but the cryptography package is missing: "
                                     f"{INSTALL_HINT}") from exc
        first = keys[0] if keys else ""
        self.sealing = (first.decode("ascii", "replace") if isinstance(first, bytes) else first) != PLAIN
        keys = list(keys if self.sealing else keys[1:])
        if not keys:
            raise ConfigurationError("idemmail_payload_keys names no key: give at least one Fernet key")
        fernets = []
        for n, key in enumerate(keys, start=1):
            try:
                fernets.append(Fernet(key))
            except (ValueError, TypeError):  # never echo the key: it would end up in logs
                raise ConfigurationError(
                    f"idemmail_payload_keys: key {n} of {len(keys)} is not a Fernet key "
                    "(32 url-safe base64-encoded bytes; make one with "
                    "`python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'`)"
                ) from None
        self._fernet = MultiFernet(fernets)
        self._invalid = InvalidToken

    def seal(self, text: str) -> str:
        """The Fernet token of ``text`` under the first key."""
        return self._fernet.encrypt(text.encode("utf-8")).decode("ascii")

    def open(self, token: str) -> str:
        """The text sealed in ``token``; :class:`PayloadKeyError` if no configured key opens it."""
        try:
            return self._fernet.decrypt(token.encode("ascii")).decode("utf-8")
        except (self._invalid, UnicodeError):
            raise PayloadKeyError(
                "a ledger record was sealed with a key that is not in idemmail_payload_keys "
                "(removed too early?); put the old key back after the current one"
            ) from None
