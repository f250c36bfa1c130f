"""``python -m sim``: explore (``make sim``), or replay a saved trace (``python -m sim replay FILE``)."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
