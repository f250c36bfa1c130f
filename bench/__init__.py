"""Benchmarks: what idempotency costs over plain Celery, and how celery-once compares (``make bench``)."""
