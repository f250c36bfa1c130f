"""The scheduler: one schedule from a list of choices, exhaustive search for small bounds, seeded
random walks for larger worlds, and shrinking of a schedule that breaks an invariant.

A schedule is the list of indices chosen into :meth:`World.options` at each step; beyond the end of
the list index 0 is taken (go on with the actor that ran last, no fault), and an index past the
options is taken as 0 too, so any list replays, and a shrunk one still means something.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from greenlet import getcurrent

from .world import Config, World, installed

Chooser = Callable[[list[tuple[Any, ...]], int], int]

_current: list[World | None] = [None]


@contextmanager
def simulating() -> Iterator[None]:
    """The library's clock, keeper and backoff replaced for the block (see :func:`world.installed`)."""
    logging.disable(logging.CRITICAL)  # the library's warnings, thousands of times over
    try:
        with installed(lambda: _current[0]):
            yield
    finally:
        logging.disable(logging.NOTSET)


@dataclass
class Run:
    """What one schedule came to."""

    choices: list[int]
    sizes: list[int]
    violations: list[str]
    log: list[str] = field(default_factory=list)
    world: World | None = None


def run(cfg: Config, choose: Chooser, *, keep: bool = False) -> Run:
    """Run one schedule of ``cfg``'s world (inside :func:`simulating`), then drain it and check it."""
    world = World(cfg, keep_log=keep)
    world.main = getcurrent()
    _current[0] = world
    choices: list[int] = []
    sizes: list[int] = []
    try:
        for position in range(cfg.steps):
            opts = world.options()
            if not opts:
                break
            i = choose(opts, position)
            if not 0 <= i < len(opts):
                i = 0
            choices.append(i)
            sizes.append(len(opts))
            world.step(opts[i])
        settled = world.drain()
        found = world.violations()
        if not settled:
            found.append("the world did not settle: a delivery or a campaign never ends")
    finally:
        for actor in list(world.actors):
            world.kill(actor)
        _current[0] = None
        close = getattr(world.store, "close", None)
        if close is not None:
            close()
    return Run(choices, sizes, found, world.log if keep else [], world if keep else None)


def replay(cfg: Config, choices: list[int], *, keep: bool = False) -> Run:
    """Run the schedule ``choices`` again (index 0 past its end)."""
    return run(cfg, lambda opts, p: choices[p] if p < len(choices) else 0, keep=keep)


def exhaustive(cfg: Config, *, limit: int | None = None, stop_on_violation: bool = False) -> Iterator[Run]:
    """Every schedule of ``cfg`` (depth-first over the choices; ``limit``: at most that many)."""
    prefix: list[int] = []
    count = 0
    while True:
        out = replay(cfg, prefix)
        count += 1
        yield out
        if (stop_on_violation and out.violations) or (limit is not None and count >= limit):
            return
        p = len(out.choices) - 1
        while p >= 0 and out.choices[p] + 1 >= out.sizes[p]:
            p -= 1
        if p < 0:
            return
        prefix = [*out.choices[:p], out.choices[p] + 1]


def walker(seed: int, fault_rate: float = 0.25) -> Chooser:
    """A seeded random walk: mostly progress (index 0 or a delivery), now and then anything."""
    rng = random.Random(seed)

    def choose(opts: list[tuple[Any, ...]], position: int) -> int:
        if rng.random() < fault_rate:
            return rng.randrange(len(opts))
        progress = [n for n, o in enumerate(opts) if (o[0] == "run" and o[2] == "ok") or o[0] == "deliver"]
        return rng.choice(progress) if progress else rng.randrange(len(opts))

    return choose


def shrink(cfg: Config, choices: list[int], *, budget: int = 400) -> list[int]:
    """A shorter schedule that still breaks an invariant: truncated, steps dropped, choices set to 0."""
    def bad(c: list[int]) -> bool:
        return bool(replay(cfg, c).violations)

    best = list(choices)
    tries = 0
    # The schedule's end: everything past the last step that matters is index 0 anyway.
    while best and best[-1] == 0:
        best.pop()
    changed = True
    while changed and tries < budget:
        changed = False
        for p in range(len(best) - 1, -1, -1):
            if p >= len(best):
                continue
            for candidate in (best[:p] + best[p + 1:], [*best[:p], 0, *best[p + 1:]]):
                if candidate == best or tries >= budget:
                    continue
                tries += 1
                if bad(candidate):
                    best = candidate
                    while best and best[-1] == 0:
                        best.pop()
                    changed = True
                    break
    return best


def save(cfg: Config, choices: list[int], violations: list[str], path: Path, *, seed: int | None = None) -> None:
    """Write a replayable trace: the world's bounds, the choices, what broke."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": asdict(cfg), "seed": seed, "choices": choices,
                                "violations": violations}, indent=1) + "\n")


def load(path: Path) -> tuple[Config, list[int], dict[str, Any]]:
    data = json.loads(path.read_text())
    return Config(**data["config"]), list(data["choices"]), data


def hunt(worlds: tuple[Config, ...], *, seconds: float, seed: int = 0) -> tuple[Config, Run, int] | None:
    """Look for a violation in ``worlds``: every schedule of the first (for up to half the time), then
    seeded random walks over all of them in turn until ``seconds`` pass. Returns the world, the failing
    run and the number of schedules tried, or None."""
    import time

    started = time.monotonic()
    tried = 0
    for out in exhaustive(worlds[0]):
        tried += 1
        if out.violations:
            return worlds[0], out, tried
        if time.monotonic() - started > seconds / 2:
            break
    n = seed
    while time.monotonic() - started < seconds:
        for cfg in worlds:
            out = run(cfg, walker(n))
            tried += 1
            if out.violations:
                return cfg, out, tried
        n += 1
    return None
