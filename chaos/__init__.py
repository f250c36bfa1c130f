"""Fault injection for idemmail-celery: real brokers, real prefork workers, SIGKILLs and a faulty provider.

``python -m chaos.run --help`` (or ``make chaos``) runs the long suite; the short one is
``tests/integration/test_chaos_short.py``. The verdict always comes from what the provider
recorded and what the ledger holds, never from the workers' return values.
"""
