"""Runnable examples (``make demo`` runs ``examples/demo.py``)."""
