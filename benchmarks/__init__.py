"""Benchmarks of pgq against the other Celery brokers (run on request, never in CI).

``python -m benchmarks.brokers --help`` for the broker comparison.
"""
