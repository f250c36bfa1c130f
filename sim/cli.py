"""The command line of the simulator: ``explore`` (the default; ``make sim``) and ``replay``."""

from __future__ import annotations

import argparse
from pathlib import Path

from .explore import load, replay, shrink, simulating


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    rep = sub.add_parser("replay", help="replay a saved trace and print its steps")
    rep.add_argument("trace", type=Path)
    rep.add_argument("--shrink", action="store_true", help="shrink it first (and write it back)")
    args = parser.parse_args(argv)
    if args.command == "replay":
        cfg, choices, data = load(args.trace)
        with simulating():
            if args.shrink:
                choices = shrink(cfg, choices)
            out = replay(cfg, choices, keep=True)
        for n, line in enumerate(out.log):
            print(f"{n:4d} {line}")
        print("violations:", out.violations or "none")
        return 1 if out.violations else 0
    return 0
