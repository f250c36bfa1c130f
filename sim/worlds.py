"""The worlds ``make sim`` explores: small ones exhaustively, larger ones by seeded random walks."""

from __future__ import annotations

from .world import Config

PROVIDERS = ("keyed", "keyless", "smtp")

#: Explored exhaustively (every schedule within the bounds), for each provider: two copies with one
#: fault (a ledger call failing before or after its write, or the provider's), two copies with a
#: crash at any point, one copy with two faults and a crash, two copies with a pause; then two
#: copies racing across a key-secret rotation (through all its steps; and during its second step's
#: deploy with a fault), and a two-recipient campaign with a fault or a crash.
EXHAUSTIVE: tuple[Config, ...] = (
    *(Config(provider=p, copies=2, faults=1, crashes=0, ticks=1, preemptions=1, steps=40) for p in PROVIDERS),
    *(Config(provider=p, copies=2, faults=0, crashes=1, ticks=1, preemptions=1, steps=40) for p in PROVIDERS),
    *(Config(provider=p, copies=1, faults=2, crashes=1, ticks=1, preemptions=0, steps=40) for p in PROVIDERS),
    *(Config(provider=p, copies=2, faults=0, crashes=0, stalls=1, ticks=1, preemptions=1, steps=40)
      for p in PROVIDERS),
    Config(provider="keyless", copies=2, faults=0, crashes=0, rotation=True, ticks=0, preemptions=2, steps=40),
    Config(provider="keyless", copies=2, faults=1, crashes=0, rotation=True, rotation_from=3, ticks=1, preemptions=1,
           steps=40),
    Config(provider="keyless", intents=0, campaign=2, batch=2, faults=1, crashes=0, ticks=1, preemptions=0,
           steps=40),
    Config(provider="keyless", intents=0, campaign=2, batch=1, faults=0, crashes=1, ticks=1, preemptions=0,
           steps=40),
)

#: Explored by random walks: 5 copies, 10 faults, a 20-recipient campaign, a rotation, losses of
#: messages and of the store, pauses, visibility-timeout copies, sweeps and operators.
RANDOM: tuple[Config, ...] = (
    Config(provider="keyed", intents=1, copies=5, faults=10, crashes=3, stalls=2, vt_copies=2, lost=1, ticks=4,
           sweeps=1, preemptions=6, steps=100),
    Config(provider="keyless", intents=1, copies=5, faults=10, crashes=3, stalls=2, vt_copies=2, lost=1, ticks=4,
           sweeps=1, operator=1, forget_live=True, preemptions=6, steps=100),
    Config(provider="smtp", intents=1, copies=5, faults=10, crashes=3, stalls=2, vt_copies=2, lost=1, ticks=4,
           sweeps=1, operator=1, forget_live=True, preemptions=6, steps=100),
    Config(provider="keyless", intents=2, copies=3, faults=6, crashes=2, stalls=1, rotation=True, ticks=3,
           preemptions=6, steps=150),
    # Both steps of a rotation side by side from the start, and crashes: a claim left unchecked by a holder
    # that died before its check, beside the other key's that ran.
    *(Config(provider=p, intents=1, copies=2, faults=4, crashes=2, stalls=1, rotation=True, rotation_from=3,
             ticks=2, preemptions=4, steps=80) for p in ("keyed", "keyless")),
    Config(provider="keyless", intents=1, copies=3, campaign=20, campaign_copies=2, batch=5, overlap=True,
           faults=10, crashes=2, stalls=1, vt_copies=1, ticks=4, preemptions=6, steps=250),
    Config(provider="keyed", intents=0, campaign=20, campaign_copies=2, batch=5, faults=10, crashes=2, stalls=1,
           rotation=True, ticks=4, preemptions=6, steps=250),
    Config(provider="smtp", intents=0, campaign=6, campaign_copies=2, batch=2, faults=10, crashes=2, stalls=1,
           lost=1, ticks=4, preemptions=6, steps=200),
    Config(provider="keyless", intents=2, copies=3, faults=6, crashes=2, losses=1, ticks=3, preemptions=4, steps=120),
    Config(provider="keyed", intents=2, copies=3, faults=6, crashes=2, losses=1, ticks=3, preemptions=4, steps=120),
)

#: The real SQLite ledger, on a smaller budget (each schedule opens a database).
SQLITE: tuple[Config, ...] = (
    Config(provider="keyless", intents=1, copies=3, faults=6, crashes=2, stalls=1, ticks=3, preemptions=4, steps=100,
           ledger="sqlite"),
    Config(provider="keyed", intents=0, campaign=5, campaign_copies=2, batch=2, faults=6, crashes=1, ticks=3,
           preemptions=4, steps=120, ledger="sqlite"),
)
