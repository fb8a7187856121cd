"""Schedule entries: what ``beat_schedule`` and ``pgq schedule add`` may say, checked, and
the slots (the times an entry falls due) each schedule has.

A slot is a function of the entry's schedule and of its anchor (a time the database
chose), never of a host's clock or of when a beat last ran: every beat computes the same
slots, so "was this slot sent" is a question with one answer, the ``beat_slot`` row.

Two kinds of schedule: an interval (a number of seconds, a ``timedelta`` or Celery's
``schedule``; its slots are anchor + k x interval, or multiples of the interval since
the Unix epoch with ``relative=True``) and a crontab (Celery's ``crontab``; its slots
are the crontab's minutes in the app's timezone).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta, tzinfo
from typing import Any

from celery.schedules import crontab, schedule
from kombu.utils import json as _kombu_json

from pg_transport.config import MAX_SECONDS
from pg_transport.errors import ConfigurationError

__all__ = [
    "ENTRY_KEYS",
    "Cron",
    "Entry",
    "Every",
    "Schedule",
    "due_slots",
    "entry_from_config",
    "schedule_from_json",
    "schedule_from_value",
]

#: The keys a ``beat_schedule`` entry may have (Celery's ScheduleEntry arguments).
ENTRY_KEYS = ("task", "schedule", "args", "kwargs", "options", "relative")

#: Options the scheduler sets itself on every message it sends.
RESERVED_OPTIONS = ("task_id",)

#: The ``apply_async`` options an entry may have (Celery's and kombu's publishing
#: options and message properties): a misspelt one would otherwise be sent as a message
#: property and do nothing.
KNOWN_OPTIONS = frozenset(
    {
        "add_to_parent", "app_id", "argsrepr", "chain", "chord", "compression",
        "confirm_timeout", "content_encoding", "content_type", "correlation_id", "countdown",
        "declare", "delivery_mode", "eta", "exchange", "exchange_type", "expiration", "expires",
        "group_id", "group_index", "headers", "ignore_result", "immediate", "kwargsrepr",
        "link", "link_error", "mandatory", "parent_id", "priority", "queue", "reply_to",
        "retries", "retry", "retry_policy", "root_id", "route_name", "routing_key",
        "serializer", "shadow", "soft_time_limit", "stamped_headers", "task_type",
        "time_limit", "timeout", "type", "user_id",
    }
)  # fmt: skip

# kombu ships these without annotations; the names here give them their types (JSON as
# kombu writes it: datetimes, UUIDs and decimals in arguments round-trip).
_dumps: Callable[[Any], str] = _kombu_json.dumps
_loads: Callable[[str], Any] = _kombu_json.loads

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A crontab's next (or previous) minute is found within this many days (a 29 February
# on a given weekday recurs within 28 years).
_CRON_DAYS = 366 * 29


def _micros(moment: datetime) -> int:
    delta = moment - _EPOCH
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def _at_micros(micros: int) -> datetime:
    return _EPOCH + timedelta(microseconds=micros)


@dataclass(frozen=True)
class Every:
    """Every ``seconds``: slots at anchor + k x seconds (k >= 1), or at multiples of
    ``seconds`` since the Unix epoch when ``aligned`` (Celery's ``relative=True``)."""

    seconds: float
    aligned: bool = False

    @property
    def micros(self) -> int:
        return max(round(self.seconds * 1_000_000), 1)

    def as_json(self) -> dict[str, Any]:
        return {"every": self.seconds, "aligned": self.aligned}

    def describe(self) -> str:
        text = f"every {self.seconds:g}s"
        return text + " (aligned)" if self.aligned else text

    def next_slot(self, anchor: datetime, after: datetime, tz: tzinfo) -> datetime:
        base = 0 if self.aligned else _micros(anchor)
        since = max(_micros(after), _micros(anchor)) - base
        return _at_micros(base + (since // self.micros + 1) * self.micros)

    def last_slot(self, anchor: datetime, until: datetime, tz: tzinfo) -> datetime | None:
        base = 0 if self.aligned else _micros(anchor)
        slot = base + ((_micros(until) - base) // self.micros) * self.micros
        return _at_micros(slot) if slot > _micros(anchor) else None

    def celery(self) -> Any:
        return schedule(timedelta(seconds=self.seconds), relative=self.aligned)


@dataclass(frozen=True)
class Cron:
    """A crontab, ``minute hour day-of-month month day-of-week`` (cron's order), whose
    minutes are taken in the timezone the scheduler is given (the Celery app's)."""

    spec: str
    compiled: crontab = field(compare=False, repr=False)

    @classmethod
    def parse(cls, spec: str) -> Cron:
        fields = spec.split()
        if len(fields) != 5:
            raise ValueError(
                f"{spec!r} has {len(fields)} fields, a crontab has 5: "
                "minute hour day-of-month month day-of-week"
            )
        text = " ".join(fields)
        try:
            compiled = crontab.from_string(text)
        except Exception as exc:  # celery raises ValueError or its ParseException
            raise ValueError(f"{spec!r} is not a valid crontab: {exc}") from None
        return cls(text, compiled)

    def as_json(self) -> dict[str, Any]:
        return {"crontab": self.spec}

    def describe(self) -> str:
        return f"crontab {self.spec}"

    def _days(self, start: date, step: int) -> Iterator[date]:
        day = start
        for _ in range(_CRON_DAYS):
            if (
                day.month in self.compiled.month_of_year
                and day.day in self.compiled.day_of_month
                and day.isoweekday() % 7 in self.compiled.day_of_week
            ):
                yield day
            day += timedelta(days=step)

    def _times(self, day: date, tz: tzinfo, reverse: bool) -> Iterator[datetime]:
        for hour in sorted(self.compiled.hour, reverse=reverse):
            for minute in sorted(self.compiled.minute, reverse=reverse):
                local = datetime(day.year, day.month, day.day, hour, minute, tzinfo=tz)
                yield local.astimezone(UTC)

    def next_slot(self, anchor: datetime, after: datetime, tz: tzinfo) -> datetime:
        after = max(after, anchor)
        # A day before, for local days that start before ``after`` in UTC.
        for day in self._days(after.astimezone(tz).date() - timedelta(days=1), 1):
            for moment in self._times(day, tz, reverse=False):
                if moment > after:
                    return moment
        raise ValueError(f"crontab {self.spec!r} never falls due")

    def last_slot(self, anchor: datetime, until: datetime, tz: tzinfo) -> datetime | None:
        for day in self._days(until.astimezone(tz).date() + timedelta(days=1), -1):
            for moment in self._times(day, tz, reverse=True):
                if moment <= until:
                    return moment if moment > anchor else None
        return None

    def celery(self) -> Any:
        return self.compiled


Schedule = Every | Cron


def due_slots(
    sched: Schedule,
    anchor: datetime,
    last_due: datetime | None,
    now: datetime,
    tz: tzinfo,
    catch_up: float,
    limit: int = 1000,
) -> list[datetime]:
    """The slots to send at ``now``, oldest first: every slot after ``last_due`` (and the
    anchor) that fell due within the last ``catch_up`` seconds, or when none did, the
    latest one that fell due (a beat that was down sends what it missed once, as
    Celery's beat does). Older missed slots are passed over: sending a later slot moves
    ``last_due`` past them. At most ``limit`` slots, the latest ones."""
    lower = max(last_due or anchor, anchor)
    first = sched.next_slot(anchor, lower, tz)
    if first > now:
        return []
    window = max(lower, now - timedelta(seconds=catch_up))
    slots: list[datetime] = []
    slot = sched.next_slot(anchor, window, tz)
    while slot <= now:
        slots.append(slot)
        if len(slots) > limit:
            del slots[0]
        slot = sched.next_slot(anchor, slot, tz)
    if not slots:
        latest = sched.last_slot(anchor, now, tz)
        if latest is not None and latest > lower:
            slots.append(latest)
    return slots


def schedule_from_value(value: Any, where: str, *, relative: bool = False) -> Schedule:
    """A ``beat_schedule`` entry's ``schedule``: seconds, a timedelta, Celery's
    ``schedule`` or ``crontab``; anything else is a :class:`ConfigurationError`."""
    if isinstance(value, crontab):
        return Cron.parse(_crontab_spec(value))
    if isinstance(value, schedule) and type(value) is schedule:
        return Every(_seconds(value.run_every.total_seconds(), where), value.relative or relative)
    if isinstance(value, timedelta):
        return Every(_seconds(value.total_seconds(), where), relative)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Every(_seconds(value, where), relative)
    raise ConfigurationError(
        f"{where}: schedule {value!r} is not supported; use a number of seconds, a "
        "timedelta, celery.schedules.schedule or celery.schedules.crontab"
    )


def _seconds(value: float, where: str) -> float:
    number = float(value)
    if not math.isfinite(number) or number <= 0 or number > MAX_SECONDS:
        raise ConfigurationError(
            f"{where}: schedule {value!r} must be a number of seconds > 0 and <= {MAX_SECONDS}"
        )
    return number


def _field(value: Any) -> str:
    if isinstance(value, str):
        return value.replace(" ", "")
    if isinstance(value, int):
        return str(value)
    return ",".join(str(part) for part in sorted(value))


def _crontab_spec(value: crontab) -> str:
    return " ".join(
        _field(part)
        for part in (
            value._orig_minute,
            value._orig_hour,
            value._orig_day_of_month,
            value._orig_month_of_year,
            value._orig_day_of_week,
        )
    )


def schedule_from_json(data: Mapping[str, Any]) -> Schedule:
    """A schedule as the ``beat_entry.schedule`` column holds it."""
    if "crontab" in data:
        return Cron.parse(str(data["crontab"]))
    return Every(float(data["every"]), bool(data.get("aligned", False)))


@dataclass(frozen=True)
class Entry:
    """One schedule entry, checked: what a beat stores and sends."""

    name: str
    task: str
    schedule: Schedule
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def params(self) -> dict[str, Any]:
        """The entry as the bound values of the queries that store it."""
        return {
            "name": self.name,
            "task": self.task,
            "schedule": _dumps(self.schedule.as_json()),
            "args": _encode(self.args, f"entry {self.name!r}: args"),
            "kwargs": _encode(self.kwargs, f"entry {self.name!r}: kwargs"),
            "options": _encode(self.options, f"entry {self.name!r}: options"),
        }


def _encode(value: Any, where: str) -> str:
    try:
        return str(_dumps(value))
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"{where} cannot be stored in Postgres ({exc}); use JSON values "
            "(lazy arguments such as BeatLazyFunc are not supported)"
        ) from None


def check_entry(
    name: Any, task: Any, sched: Schedule, args: Any, kwargs: Any, options: Any
) -> Entry:
    """An :class:`Entry`, or a :class:`ConfigurationError` naming what is wrong."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigurationError(f"schedule entry name {name!r} must be a non-empty string")
    where = f"entry {name!r}"
    if not isinstance(task, str) or not task.strip():
        raise ConfigurationError(f"{where}: task {task!r} must be a task name")
    if args is None:
        args = []
    if not isinstance(args, (list, tuple)):
        raise ConfigurationError(f"{where}: args {args!r} must be a list")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigurationError(f"{where}: kwargs {kwargs!r} must be a dict of names")
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ConfigurationError(f"{where}: options {options!r} must be a dict")
    for key in RESERVED_OPTIONS:
        if key in options:
            raise ConfigurationError(
                f"{where}: option {key!r} is set by the scheduler for each slot"
            )
    unknown = sorted(str(key) for key in options if key not in KNOWN_OPTIONS)
    if unknown:
        raise ConfigurationError(
            f"{where}: unknown option {unknown[0]!r} (apply_async's options: "
            f"{', '.join(sorted(KNOWN_OPTIONS))})"
        )
    entry = Entry(name, task, sched, list(args), dict(kwargs), dict(options))
    entry.params()  # every value must be storable
    return entry


def entry_from_config(name: Any, value: Any) -> Entry:
    """A ``beat_schedule`` item as an :class:`Entry`; an unknown key, a missing task or
    schedule, or a bad value is a :class:`ConfigurationError` naming it."""
    where = f"beat_schedule entry {name!r}"
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{where} must be a dict, not {type(value).__name__}")
    unknown = sorted(str(key) for key in value if key not in ENTRY_KEYS)
    if unknown:
        raise ConfigurationError(
            f"{where}: unknown key {unknown[0]!r} (an entry has {', '.join(ENTRY_KEYS)})"
        )
    for key in ("task", "schedule"):
        if key not in value:
            raise ConfigurationError(f"{where}: {key!r} is missing")
    relative = value.get("relative", False)
    if not isinstance(relative, bool):
        raise ConfigurationError(f"{where}: relative {relative!r} must be True or False")
    try:
        sched = schedule_from_value(value["schedule"], where, relative=relative)
    except ValueError as exc:
        if isinstance(exc, ConfigurationError):
            raise
        raise ConfigurationError(f"{where}: {exc}") from None
    try:
        return check_entry(
            name, value["task"], sched, value.get("args"), value.get("kwargs"), value.get("options")
        )
    except ConfigurationError as exc:
        raise ConfigurationError(f"beat_schedule {exc}") from None


def decode(text: str) -> Any:
    """A JSON column read as text, with kombu's tagged values (datetimes…) restored."""
    return _loads(text)
