"""Transport options: ``broker_transport_options`` merged with ``PGQ_*`` environment.

Every option can be overridden by ``PGQ_<KEY>``; per-queue visibility timeouts and
attempt limits also by ``PGQ_VISIBILITY_TIMEOUT_<QUEUE>`` / ``PGQ_MAX_ATTEMPTS_<QUEUE>``,
where ``<QUEUE>`` is the queue name upper-cased with every non-alphanumeric character
replaced by ``_``. Bad values are refused at start-up, naming key and value.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from pg_transport.db.retry import FENCED_RETRY_SECONDS
from pg_transport.errors import ConfigurationError, LimitError
from pg_transport.message.limits import Limit, Rate, limit_name, parse_burst, parse_rate

__all__ = [
    "DEFAULT_FOLLOWS_RETENTION",
    "DEFAULT_FOLLOWS_TIMEOUT",
    "Options",
    "env_queue_key",
    "unknown_environment",
    "warn_unknown_environment",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Options kombu or Celery themselves read from broker_transport_options; accepted
# and ignored here so an app moving from Redis or RabbitMQ keeps working.
KOMBU_KEYS = frozenset(
    {
        "max_retries",
        "interval_start",
        "interval_step",
        "interval_max",
        "body_encoding",
        "deadletter_queue",
        "confirm_publish",
        "client_properties",
        "connect_timeout",
    }
)

_QUEUE_CHARS = re.compile(r"[^A-Za-z0-9]")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def env_queue_key(queue: str) -> str:
    """The ``<QUEUE>`` part of a per-queue environment variable."""
    return _QUEUE_CHARS.sub("_", queue).upper()


# Upper bound of every duration: longer ones overflow Postgres timestamps
# (now() + vt) or the platform's timer limit long before they mean anything.
MAX_SECONDS = 10 * 365 * 24 * 3600
# read_ct, which max_attempts is compared with, is a Postgres integer.
MAX_ATTEMPTS = 2**31 - 1


def _number(
    key: str,
    value: Any,
    *,
    integer: bool,
    minimum: float,
    allow_zero: bool,
    maximum: float | None = None,
) -> Any:
    if isinstance(value, bool):
        raise ConfigurationError(f"pgq option {key}={value!r} is not a number")
    try:
        number = value if isinstance(value, int) else float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigurationError(f"pgq option {key}={value!r} is not a number") from None
    if isinstance(number, float) and not math.isfinite(number):
        raise ConfigurationError(f"pgq option {key}={value!r} is not a finite number")
    if integer and isinstance(number, float):
        if not number.is_integer():
            raise ConfigurationError(f"pgq option {key}={value!r} is not a whole number")
        number = int(number)
    if number < minimum or (not allow_zero and number == 0):
        bound = f">= {minimum}" if allow_zero else f"> {minimum}"
        raise ConfigurationError(f"pgq option {key}={value!r} must be {bound}")
    if maximum is not None and number > maximum:
        raise ConfigurationError(f"pgq option {key}={value!r} must be <= {maximum}")
    return number


def _seconds(key: str, value: Any) -> float:
    return float(
        _number(key, value, integer=False, minimum=0, allow_zero=False, maximum=MAX_SECONDS)
    )


def _attempts(key: str, value: Any) -> int:
    return int(_number(key, value, integer=True, minimum=1, allow_zero=True, maximum=MAX_ATTEMPTS))


def _interval(key: str, value: Any) -> float:
    return float(
        _number(key, value, integer=False, minimum=0, allow_zero=True, maximum=MAX_SECONDS)
    )


#: Seconds a unique publish waits for a transaction holding its key, unless set.
DEFAULT_UNIQUE_WAIT = 5.0
#: Postgres' lock_timeout, which the wait is, holds at most 2^31 - 1 milliseconds; less
#: than a millisecond would be written as 0, which is no limit at all.
MAX_UNIQUE_WAIT = (2**31 - 1) / 1000
MIN_UNIQUE_WAIT = 0.001


def _unique_wait(key: str, value: Any) -> float:
    return float(
        _number(
            key,
            value,
            integer=False,
            minimum=MIN_UNIQUE_WAIT,
            allow_zero=True,
            maximum=MAX_UNIQUE_WAIT,
        )
    )


# Postgres keeps at most 1 GB in one value; a JSON payload a little less than that.
#: Seconds a follower waits for its predecessor when neither it nor the transport says.
DEFAULT_FOLLOWS_TIMEOUT = 300.0
#: Seconds the end of a followed task is remembered, unless the transport says.
DEFAULT_FOLLOWS_RETENTION = 86400.0

MAX_MESSAGE_BYTES = 1024**3 - 1024
# Below this a Celery message with a few arguments does not fit.
MIN_MESSAGE_BYTES = 1024


def _message_bytes(key: str, value: Any) -> int:
    return int(
        _number(
            key,
            value,
            integer=True,
            minimum=MIN_MESSAGE_BYTES,
            allow_zero=False,
            maximum=MAX_MESSAGE_BYTES,
        )
    )


def _pool_size(key: str, value: Any) -> int:
    # Sessions one pool of a process may hold at once (in use and idle).
    return int(_number(key, value, integer=True, minimum=1, allow_zero=False, maximum=1000))


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _vacuum_threshold(key: str, value: Any) -> int:
    # Dead rows; 0 turns pgq's own vacuuming off.
    return int(_number(key, value, integer=True, minimum=0, allow_zero=True, maximum=MAX_ATTEMPTS))


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigurationError(f"pgq option {key}={value!r} is not a boolean (true/false)")


#: ``durable_acks`` values: the consumer's commits (claims, acks, releases, renewals).
DURABLE_ACKS = ("auto", "on", "off")


def _durable_acks(key: str, value: Any) -> str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return "on" if _flag(key, value) else "off"
    except ConfigurationError:
        raise ConfigurationError(
            f"pgq option {key}={value!r} must be auto, true or false"
        ) from None


def _listen_url(key: str, value: Any) -> str | None:
    """A ``pgq://`` URL of Postgres itself (not the pooler), or nothing."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        raise ConfigurationError(f"pgq option {key} must be a pgq:// URL, not {type(value)}")
    from pg_transport.db.url import parse_url  # (db.url needs nothing of this module)

    try:
        parse_url(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"pgq option {key}: {exc}") from None
    return value.strip()


def _schema(key: str, value: Any) -> str:
    if not isinstance(value, str) or not _IDENT.match(value) or len(value) > 48:
        raise ConfigurationError(
            f"pgq option {key}={value!r} must be a plain identifier "
            "(letters, digits, underscore; at most 48 characters)"
        )
    if value.startswith("pg_"):
        raise ConfigurationError(
            f"pgq option {key}={value!r}: schema names starting with pg_ are reserved by PostgreSQL"
        )
    return value


ORDERING_MODES = ("strict", "relaxed")


def _ordering(key: str, value: Any) -> str:
    if not isinstance(value, str) or value.strip().lower() not in ORDERING_MODES:
        raise ConfigurationError(
            f"pgq option {key}={value!r} must be one of {', '.join(ORDERING_MODES)}"
        )
    return value.strip().lower()


def _queue_rate(key: str, value: Any) -> tuple[Rate, int]:
    """A queue's own rate limit (``queue:<name>``, docs/flow-control.md): ``"200/s"``,
    or ``{"rate": "200/s", "burst": 20}``. Bad values are refused naming the option."""
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in ("rate", "burst"))
        if unknown:
            raise LimitError(
                f"pgq option {key}={dict(value)!r}: a queue's rate limit takes 'rate' and "
                f"'burst' only, not {', '.join(unknown)} (a queue's concurrency is set with "
                "`pgq limit set queue:<name> --concurrency N`)"
            )
        if "rate" not in value:
            raise LimitError(f"pgq option {key}={dict(value)!r}: give a 'rate', such as '200/s'")
        burst = parse_burst(f"pgq option {key}['burst']", value.get("burst", 1))
        return parse_rate(f"pgq option {key}['rate']", value["rate"]), burst
    return parse_rate(f"pgq option {key}", value), 1


def _per_queue(key: str, value: Any, parse: Callable[[str, Any], T]) -> dict[str, T]:
    if key == "queue_fair_share" and isinstance(value, (list, tuple, set, frozenset)):
        value = dict.fromkeys(value, True)  # the queues named are fair
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"pgq option {key}={value!r} must be a mapping of queue to value")
    return {str(q): parse(f"{key}[{q!r}]", v) for q, v in value.items()}


def _env_queue(name: str, prefix: str) -> str:
    """The ``<QUEUE>`` of a per-queue variable; one no queue can match is refused."""
    queue = name.removeprefix(prefix)
    if not queue or env_queue_key(queue) != queue:
        raise ConfigurationError(
            f"environment variable {name} matches no queue: the part after {prefix} must be "
            f"the queue name upper-cased with every other character as _ "
            f"(e.g. {prefix}{env_queue_key(queue) or 'CELERY'})"
        )
    return queue


_SCALARS: dict[str, Callable[[str, Any], Any]] = {
    "schema": _schema,
    "visibility_timeout": _seconds,
    "max_attempts": _attempts,
    "use_notify": _flag,
    "polling_interval": _interval,
    "lease_renewal": _flag,
    "native_delayed_delivery": _flag,
    "auto_migrate": _flag,
    "durable_publish": _flag,
    "durable_acks": _durable_acks,
    "listen_url": _listen_url,
    "vacuum_threshold": _vacuum_threshold,
    "max_message_bytes": _message_bytes,
    "pool_size": _pool_size,
    "pool_idle_timeout": _seconds,
    "follows_timeout": _interval,
    "follows_retention": _seconds,
    "unique_wait": _unique_wait,
    "fenced_retry_window": _seconds,
}
_MAPPINGS: dict[str, Callable[[str, Any], Any]] = {
    "queue_visibility_timeouts": _seconds,
    "queue_max_attempts": _attempts,
    "queue_ordering": _ordering,
    "queue_fair_share": _flag,
    "queue_rate_limits": _queue_rate,
}


@dataclass(frozen=True)
class Options:
    schema: str = "pgq"
    visibility_timeout: float = 30.0
    queue_visibility_timeouts: Mapping[str, float] = field(default_factory=dict)
    max_attempts: int = 5
    queue_max_attempts: Mapping[str, int] = field(default_factory=dict)
    use_notify: bool = True
    polling_interval: float = 1.0
    lease_renewal: bool = True
    native_delayed_delivery: bool = True
    auto_migrate: bool = True
    durable_publish: bool = True
    #: Whether claims, acks and renewals wait as the server's commits do (its WAL flush,
    #: its synchronous standbys): "on", "off", or "auto" (on when the server has
    #: synchronous standbys, as a session finds it when it opens).
    durable_acks: str = "auto"
    #: With use_notify off (behind a pooler): Postgres itself, for one LISTEN-only
    #: session per process, so idle consumers are woken instead of polling.
    listen_url: str | None = None
    vacuum_threshold: int = 10_000
    #: Largest message (its JSON text, bytes) published; also what a claim brings at once.
    max_message_bytes: int = 16 * 1024 * 1024
    #: Sessions each of a process's two pools holds at most (publishing; housekeeping).
    pool_size: int = 16
    #: Seconds a pooled session may stay idle before it is closed.
    pool_idle_timeout: float = 30.0
    #: Seconds a follower waits for the task it follows, unless it says (docs/ordering.md).
    follows_timeout: float = DEFAULT_FOLLOWS_TIMEOUT
    #: Seconds the end of a followed task is remembered for followers published later.
    follows_retention: float = DEFAULT_FOLLOWS_RETENTION
    #: Seconds a unique publish waits for an open transaction that holds its key
    #: (docs/unique-tasks.md), then raises UniqueBusy.
    unique_wait: float = DEFAULT_UNIQUE_WAIT
    #: Seconds an ack, release or renewal keeps trying through an outage (a failover);
    #: never less than the visibility timeouts (docs/high-availability.md).
    fenced_retry_window: float = FENCED_RETRY_SECONDS
    #: Per queue, what a failure does to the rest of an ordering key: strict or relaxed.
    #: A queue not named keeps what the database says (strict unless set).
    queue_ordering: Mapping[str, str] = field(default_factory=dict)
    #: Per queue, whether it is claimed round-robin over its messages' fair keys
    #: (a list of queue names means each is). A queue not named keeps what the database
    #: says (not fair unless set).
    queue_fair_share: Mapping[str, bool] = field(default_factory=dict)
    #: Per queue, its own rate limit and burst (limit ``queue:<name>``), written by every
    #: Celery worker at its start with origin config, as `pgq limit set` would write it
    #: (one set by the command is kept until `pgq limit reset`).
    queue_rate_limits: Mapping[str, tuple[Rate, int]] = field(default_factory=dict)
    # Per-queue values from the environment, keyed by env_queue_key(queue).
    env_queue_visibility_timeouts: Mapping[str, float] = field(default_factory=dict)
    env_queue_max_attempts: Mapping[str, int] = field(default_factory=dict)
    env_queue_ordering: Mapping[str, str] = field(default_factory=dict)
    env_queue_fair_share: Mapping[str, bool] = field(default_factory=dict)

    @property
    def fenced_window(self) -> float:
        """How long fenced statements retry: the option, and at least every lease (a
        promotion within the lease then never costs a duplicate run)."""
        vts = [
            self.visibility_timeout,
            *self.queue_visibility_timeouts.values(),
            *self.env_queue_visibility_timeouts.values(),
        ]
        return max(self.fenced_retry_window, *vts)

    @classmethod
    def from_sources(
        cls, transport_options: Mapping[str, Any] | None, environ: Mapping[str, str]
    ) -> Options:
        """Validate options, then let ``PGQ_*`` environment variables override them."""
        values: dict[str, Any] = {}
        given = dict(transport_options or {})
        unknown = [k for k in given if k not in _SCALARS and k not in _MAPPINGS]
        unknown = [k for k in unknown if k not in KOMBU_KEYS]
        if unknown:
            # Every one at once: a migration removes them in one go, not one per start.
            known = ", ".join(sorted([*_SCALARS, *_MAPPINGS]))
            listed = ", ".join(f"{k!r} (value {given[k]!r})" for k in unknown)
            word = "option" if len(unknown) == 1 else "options"
            raise ConfigurationError(f"unknown pgq transport {word} {listed}; known: {known}")
        for key, value in given.items():
            if key in _SCALARS:
                values[key] = _SCALARS[key](key, value)
            elif key in _MAPPINGS:
                values[key] = _per_queue(key, value, _MAPPINGS[key])
        for key, parse in _SCALARS.items():
            env_name = f"PGQ_{key.upper()}"
            if env_name in environ:
                values[key] = parse(env_name, environ[env_name])
        env_vt: dict[str, float] = {}
        env_attempts: dict[str, int] = {}
        env_ordering: dict[str, str] = {}
        env_fair: dict[str, bool] = {}
        for name, raw in environ.items():
            if name.startswith("PGQ_VISIBILITY_TIMEOUT_"):
                env_vt[_env_queue(name, "PGQ_VISIBILITY_TIMEOUT_")] = _seconds(name, raw)
            elif name.startswith("PGQ_MAX_ATTEMPTS_"):
                env_attempts[_env_queue(name, "PGQ_MAX_ATTEMPTS_")] = _attempts(name, raw)
            elif name.startswith("PGQ_ORDERING_"):
                env_ordering[_env_queue(name, "PGQ_ORDERING_")] = _ordering(name, raw)
            elif name.startswith("PGQ_FAIR_SHARE_"):
                env_fair[_env_queue(name, "PGQ_FAIR_SHARE_")] = _flag(name, raw)
        for queue in values.get("queue_rate_limits", {}):
            limit_name(f"pgq option queue_rate_limits[{queue!r}]", f"queue:{queue}")
        if values.get("listen_url") and values.get("use_notify", True):
            raise ConfigurationError(
                "pgq option listen_url is for use_notify=false (behind a transaction "
                "pooler): with use_notify on, consumers listen on their own sessions"
            )
        return cls(
            **values,
            env_queue_visibility_timeouts=env_vt,
            env_queue_max_attempts=env_attempts,
            env_queue_ordering=env_ordering,
            env_queue_fair_share=env_fair,
        )

    def ordering_for(self, queue: str) -> str | None:
        """The ordering failure mode configured for ``queue`` (None: not configured)."""
        env = self.env_queue_ordering.get(env_queue_key(queue))
        return env if env is not None else self.queue_ordering.get(queue)

    def queue_limits(self) -> list[Limit]:
        """The queues' own rate limits ``queue_rate_limits`` defines."""
        return [
            Limit(f"queue:{queue}", rate=rate, burst=burst)
            for queue, (rate, burst) in sorted(self.queue_rate_limits.items())
        ]

    def fair_share_for(self, queue: str) -> bool | None:
        """Whether ``queue`` is configured fair (None: not configured)."""
        env = self.env_queue_fair_share.get(env_queue_key(queue))
        return env if env is not None else self.queue_fair_share.get(queue)

    @cached_property
    def _per_queue(self) -> dict[str, tuple[float, int]]:
        # The one cache of a queue's visibility timeout and max_attempts, asked for
        # every queue of every claim (an env lookup each otherwise). Not a field: the
        # options compare, show and document as their fields only.
        return {}

    def _queue_settings(self, queue: str) -> tuple[float, int]:
        found = self._per_queue.get(queue)
        if found is None:
            key = env_queue_key(queue)
            vt = self.env_queue_visibility_timeouts.get(key)
            if vt is None:
                vt = self.queue_visibility_timeouts.get(queue, self.visibility_timeout)
            attempts = self.env_queue_max_attempts.get(key)
            if attempts is None:
                attempts = self.queue_max_attempts.get(queue, self.max_attempts)
            found = self._per_queue[queue] = (vt, attempts)
        return found

    def visibility_timeout_for(self, queue: str) -> float:
        return self._queue_settings(queue)[0]

    def max_attempts_for(self, queue: str) -> int:
        return self._queue_settings(queue)[1]


# PGQ_* names read outside these options: the result backend's, the barrier's, the
# operator commands', beat's and the test suite's. Spelled out (not imported) so the
# transport's configuration depends on neither the result backend nor the barrier;
# tests/unit/test_known_environment.py derives them from what reads them and holds
# this list to them.
_OTHER_ENV = frozenset(
    {
        "PGQ_URL",
        "PGQ_HEALTH_FILE",
        "PGQ_HEALTH_STALE_SECONDS",
        "PGQ_BEAT_CATCH_UP",
        "PGQ_WEB_TOKEN",
        "PGQ_BARRIER_TTL",
        "PGQ_BARRIER_STUCK_TIMEOUT",
        "PGQ_BARRIER_SWEEP_INTERVAL",
        "PGQ_RESULT_SCHEMA",
        "PGQ_RESULT_USE_NOTIFY",
        "PGQ_RESULT_POLLING_INTERVAL",
        "PGQ_RESULT_AUTO_MIGRATE",
        "PGQ_RESULT_MAX_RESULT_BYTES",
        "PGQ_RESULT_NATIVE_CHORDS",
        "PGQ_UPSTREAM_CACHE",
    }
)
# Families whose last part is the user's own (a queue name) or the test suite's.
_ENV_FAMILIES = (
    "PGQ_VISIBILITY_TIMEOUT_",
    "PGQ_MAX_ATTEMPTS_",
    "PGQ_ORDERING_",
    "PGQ_FAIR_SHARE_",
    "PGQ_TEST_",
)
_warned: set[str] = set()


def _known_environment() -> frozenset[str]:
    return _OTHER_ENV | {f"PGQ_{key.upper()}" for key in _SCALARS}


def unknown_environment(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """Every ``PGQ_*`` variable pgq does not read, with the closest name it does read.

    A misspelt setting (``PGQ_VISIBILTY_TIMEOUT``) would otherwise be ignored without a
    word while the default applies.
    """
    known = _known_environment()
    found: list[tuple[str, str | None]] = []
    for name in sorted(environ):
        if not name.startswith("PGQ_") or name in known or name.startswith(_ENV_FAMILIES):
            continue
        close = difflib.get_close_matches(name, [*known, *_ENV_FAMILIES], n=1, cutoff=0.75)
        found.append((name, close[0] if close else None))
    return found


def warn_unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """Log one warning per unknown ``PGQ_*`` variable, once per process; return them."""
    said = []
    for name, close in unknown_environment(environ):
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"; did you mean {close}?" if close else ""
        logger.warning("environment variable %s is not a pgq setting and is ignored%s", name, hint)
        said.append(name)
    return said
