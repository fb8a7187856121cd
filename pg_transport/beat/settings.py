"""The scheduler's settings: ``app.conf`` keys, each overridable by environment.

| app.conf key          | environment          | default |
|-----------------------|----------------------|---------|
| ``pgq_beat_catch_up`` | ``PGQ_BEAT_CATCH_UP``| 60 s    |

``pgq_beat_catch_up``: slots missed (every beat down, or a leader being replaced) are
still sent when they fell due at most this long ago; of older ones only the latest is
sent. The tick is Celery's own ``beat_max_loop_interval``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pg_transport.config import MAX_SECONDS
from pg_transport.errors import ConfigurationError

__all__ = ["BeatSettings"]


@dataclass(frozen=True)
class BeatSettings:
    catch_up: float = 60.0

    @classmethod
    def from_sources(cls, conf: Mapping[str, Any], environ: Mapping[str, str]) -> BeatSettings:
        key, raw = "pgq_beat_catch_up", conf.get("pgq_beat_catch_up")
        if "PGQ_BEAT_CATCH_UP" in environ:
            key, raw = "PGQ_BEAT_CATCH_UP", environ["PGQ_BEAT_CATCH_UP"]
        if raw is None:
            return cls()
        try:
            number = float(raw)
        except (TypeError, ValueError):
            raise ConfigurationError(f"{key}={raw!r} is not a number of seconds") from None
        if isinstance(raw, bool) or not math.isfinite(number) or not 0 <= number <= MAX_SECONDS:
            raise ConfigurationError(
                f"{key}={raw!r} must be a number of seconds >= 0 and <= {MAX_SECONDS}"
            )
        return cls(catch_up=number)

    @classmethod
    def from_app(cls, app: Any) -> BeatSettings:
        return cls.from_sources(app.conf, os.environ)
