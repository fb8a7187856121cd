"""Result backend options: ``result_backend_transport_options`` and ``PGQ_RESULT_*``.

``schema`` defaults to the broker's ``schema`` option (a pgq broker), else
``PGQ_SCHEMA``, else ``pgq``.

| key | default | meaning |
|---|---|---|
| ``schema`` | see above | schema of the result tables |
| ``use_notify`` | true | waiters are woken by LISTEN/NOTIFY; false: one batched poll per interval |
| ``polling_interval`` | 0.5 | seconds between the batched polls when ``use_notify`` is false |
| ``auto_migrate`` | true | create/upgrade the schema on first use |
| ``max_result_bytes`` | 16777216 | largest encoded result stored (``ResultTooLarge`` past it) |
| ``native_chords`` | true | count chord parts in Postgres (broker on the same database, schema) |

Each is overridden by ``PGQ_RESULT_<KEY>``. An unknown key or a bad value is an error
naming it, at the backend's creation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pg_transport.config import (
    _flag,
    _interval,
    _message_bytes,
    _schema,
)
from pg_transport.errors import ConfigurationError

__all__ = ["ResultOptions"]

DEFAULT_SCHEMA = "pgq"


def _positive_interval(key: str, value: Any) -> float:
    number = _interval(key, value)
    if number <= 0:
        raise ConfigurationError(f"pgq option {key}={value!r} must be > 0")
    return number


_SCALARS: dict[str, Callable[[str, Any], Any]] = {
    "schema": _schema,
    "use_notify": _flag,
    "polling_interval": _positive_interval,
    "auto_migrate": _flag,
    "max_result_bytes": _message_bytes,
    "native_chords": _flag,
}


@dataclass(frozen=True)
class ResultOptions:
    schema: str = DEFAULT_SCHEMA
    use_notify: bool = True
    polling_interval: float = 0.5
    auto_migrate: bool = True
    max_result_bytes: int = 16 * 1024 * 1024
    native_chords: bool = True

    @classmethod
    def from_sources(
        cls,
        options: Mapping[str, Any] | None,
        environ: Mapping[str, str],
        *,
        default_schema: str | None = None,
    ) -> ResultOptions:
        """Validate ``options``, then let ``PGQ_RESULT_*`` override them.
        ``default_schema``: the schema when neither names one (the broker's)."""
        if options is not None and not isinstance(options, Mapping):
            raise ConfigurationError(
                f"result_backend_transport_options must be a mapping, not {options!r}"
            )
        values: dict[str, Any] = {}
        if default_schema is not None:
            values["schema"] = _schema("schema", default_schema)
        for key, value in (options or {}).items():
            parse = _SCALARS.get(key)
            if parse is None:
                known = ", ".join(sorted(_SCALARS))
                raise ConfigurationError(
                    f"unknown pgq result backend option {key!r} (value {value!r}); known: {known}"
                )
            values[key] = parse(key, value)
        for key, parse in _SCALARS.items():
            env_name = f"PGQ_RESULT_{key.upper()}"
            if env_name in environ:
                values[key] = parse(env_name, environ[env_name])
        return cls(**values)
