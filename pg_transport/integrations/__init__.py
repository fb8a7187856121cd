"""Integrations with application frameworks, each opt-in and imported only when used:
:mod:`~pg_transport.integrations.django` (``transaction.atomic()`` joined)."""
