"""Barrier settings: ``app.conf`` keys, each overridable by environment.

| app.conf key                 | environment                  | default |
|------------------------------|------------------------------|---------|
| ``pgq_barrier_ttl``          | ``PGQ_BARRIER_TTL``          | 86400 s |
| ``pgq_barrier_stuck_timeout``| ``PGQ_BARRIER_STUCK_TIMEOUT``| 3600 s  |
| ``pgq_barrier_sweep_interval``| ``PGQ_BARRIER_SWEEP_INTERVAL``| 30 s (0 = workers never sweep) |

They are not transport options: the transport refuses keys it does not know, and
these belong to the barrier, not to delivering messages.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pg_transport.config import MAX_SECONDS
from pg_transport.errors import ConfigurationError

__all__ = ["BarrierSettings", "seconds"]


def seconds(key: str, value: Any, *, allow_zero: bool = False) -> float:
    """A duration in seconds, or a :class:`ConfigurationError` naming key and value."""
    if isinstance(value, bool):
        raise ConfigurationError(f"{key}={value!r} is not a number of seconds")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{key}={value!r} is not a number of seconds") from None
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigurationError(f"{key}={value!r} must be a finite number of seconds {bound}")
    if number > MAX_SECONDS:
        raise ConfigurationError(f"{key}={value!r} must be <= {MAX_SECONDS} seconds")
    return number


@dataclass(frozen=True)
class BarrierSettings:
    ttl: float = 86400.0
    stuck_timeout: float = 3600.0
    sweep_interval: float = 30.0

    @classmethod
    def from_sources(cls, conf: Mapping[str, Any], environ: Mapping[str, str]) -> BarrierSettings:
        values: dict[str, float] = {}
        for field in ("ttl", "stuck_timeout", "sweep_interval"):
            key, env = f"pgq_barrier_{field}", f"PGQ_BARRIER_{field.upper()}"
            raw, name = conf.get(key), key
            if env in environ:
                raw, name = environ[env], env
            if raw is not None:
                values[field] = seconds(name, raw, allow_zero=field == "sweep_interval")
        return cls(**values)

    @classmethod
    def from_app(cls, app: Any) -> BarrierSettings:
        return cls.from_sources(app.conf, os.environ)
