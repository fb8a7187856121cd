"""Postgres-native fan-in barrier and terminal-status guards (built in a later issue)."""

from __future__ import annotations

__all__: list[str] = []
