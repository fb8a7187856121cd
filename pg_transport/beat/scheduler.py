"""A Celery beat scheduler backed by Postgres: ``celery beat -S pgq`` (or
``-S pg_transport.beat:Scheduler``), as many beats as you like.

What keeps a slot (an entry's due time) from being sent twice is not which beat leads
but the database: a beat sends a slot by moving the entry's ``last_due`` to it and
inserting its ``beat_slot`` row in the transaction that inserts the task's message (a
``pg_transport.batch()``: Celery routes and builds the message as for any publish). Two
beats sending one slot serialise on the entry's row; the second finds the slot taken and
sends nothing. A slot is marked sent exactly when its message exists. Slots and "due"
are the database's times, so the beats' clocks do not matter.

Leadership only saves work: the beat holding the lease (one row, renewed every half
tick, valid for a tick and a half) reads the entries and sends; the others try to take
the lease every half tick, so a killed leader is replaced within two ticks. A tick is
``beat_max_loop_interval`` (``--max-interval``), 1 second unless set.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from datetime import datetime, tzinfo
from typing import Any

import psycopg
from celery import beat
from celery.schedules import crontab
from psycopg.conninfo import conninfo_to_dict

from pg_transport.beat.entries import Entry, due_slots, entry_from_config
from pg_transport.beat.settings import BeatSettings
from pg_transport.beat.store import BeatStore, Stored
from pg_transport.config import Options
from pg_transport.db.migrate import ensure_schema
from pg_transport.db.pool import Connector, url_to_conninfo
from pg_transport.db.url import mask_url, scheme_of
from pg_transport.errors import ConfigurationError, NotPermitted, PgqError
from pg_transport.publish.batching import batch
from pg_transport.publish.publisher import Publisher

__all__ = ["HEADER_DUE", "HEADER_ENTRY", "CannotStart", "Scheduler"]

logger = logging.getLogger("pg_transport.beat")

#: Message headers naming the entry and the slot (ISO 8601, UTC) a message was sent for.
HEADER_ENTRY = "pgq_beat_entry"
HEADER_DUE = "pgq_beat_due"

#: Sent slots are kept this long (for `pgq schedule` and audits), then deleted.
SLOT_RETENTION = 86400.0
_PRUNE_EVERY = 60.0
# Never sleep less than this between ticks that found nothing to send.
_MIN_SLEEP = 0.005


class CannotStart(SystemExit):
    """A bad schedule or setting, a schema to migrate, a role without the rights, a
    database out of reach: ends ``celery beat`` with its message alone (exit code 1),
    where Celery would log any :class:`Exception` from its scheduler with two tracebacks.
    Raised from the :class:`~pg_transport.errors.PgqError` naming the problem."""


class Scheduler(beat.Scheduler):  # type: ignore[misc]
    """Celery's scheduler with the schedule, the sent slots and the leader in Postgres."""

    #: The tick, in seconds (Celery's ``beat_max_loop_interval`` overrides it).
    max_interval = 1.0

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.db: BeatStore | None = None
        self.settings = BeatSettings()
        self.leading = False
        self.term: int | None = None
        self._renewed = 0.0
        self._pruned = 0.0
        self._stored: dict[str, Stored] = {}
        super().__init__(app, *args, **kwargs)

    # -- Celery's interface ----------------------------------------------------
    def setup_schedule(self) -> None:
        """Connect, migrate if allowed, and store ``beat_schedule`` (checked first: a bad
        entry stops the start with one error naming it, :class:`CannotStart`)."""
        try:
            self.start()
        except PgqError as exc:
            # One line, not Celery's two tracebacks: the error is the whole story.
            raise CannotStart(f"pgq beat cannot start: {exc}") from exc

    def start(self) -> None:
        """What :meth:`setup_schedule` does, raising :class:`~pg_transport.errors.PgqError`."""
        entries = self.config_entries()
        self.settings = BeatSettings.from_app(self.app)
        url = str(self.app.conf.broker_write_url or self.app.conf.broker_url or "")
        if not url.lower().startswith("pgq://"):
            scheme = scheme_of(url)
            uses = f"a {scheme}:// broker" if scheme else "no broker URL"
            raise ConfigurationError(
                f"pgq's beat scheduler keeps the schedule beside the queue: it needs a pgq:// "
                f"broker, app {self.app.main!r} has {uses}"
            )
        options = Options.from_sources(self.app.conf.broker_transport_options, os.environ)
        connector = Connector(
            url_to_conninfo(url), display_url=mask_url(url), application_name="pgq-beat"
        )
        try:
            ensure_schema(connector, options.schema, auto_migrate=options.auto_migrate)
            db = BeatStore(connector, options.schema)
            try:
                result = db.sync(entries)
            except psycopg.errors.InsufficientPrivilege as exc:
                user = conninfo_to_dict(connector.conninfo).get("user") or "of the URL"
                raise NotPermitted(
                    f"role {user!r} may not keep the schedule "
                    f"({exc.diag.message_primary or exc}): run beats as the worker role "
                    "(docs/least-privilege.md)"
                ) from exc
        except BaseException:
            connector.close()  # a beat that cannot start leaves no session behind
            raise
        self.db = db
        logger.info(
            "pgq beat: %d schedule entries from beat_schedule (%d changed, %d dropped) "
            "in schema %r at %s",
            len(entries),
            len(result.written),
            len(result.dropped),
            options.schema,
            connector.display_url,
        )

    def config_entries(self) -> list[Entry]:
        """``beat_schedule`` and Celery's default entries, checked."""
        config = dict(self.app.conf.beat_schedule or {})
        if (
            self.app.conf.result_expires
            and not self.app.backend.supports_autoexpire
            and "celery.backend_cleanup" not in config
        ):
            config["celery.backend_cleanup"] = {
                "task": "celery.backend_cleanup",
                "schedule": crontab("0", "4", "*"),
                "options": {"expires": 12 * 3600},
            }
        return [entry_from_config(name, value) for name, value in config.items()]

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Hold the lease and, leading, send every due slot; the seconds to sleep."""
        half = self.tick_seconds / 2
        try:
            if not self.hold_lease():
                return half
            return self.send_due()
        except (psycopg.Error, PgqError) as exc:
            logger.warning("pgq beat: database unavailable (%s), trying again", exc)
            self.leading = False
            return half

    def sync(self) -> None:
        """Nothing to do: every change is in the database once made."""

    def close(self) -> None:
        db, self.db = self.db, None
        try:
            if db is not None:
                if self.leading:
                    try:
                        db.release_lease(self.holder)
                    except (psycopg.Error, PgqError) as exc:
                        logger.warning("pgq beat: could not give the lease up: %s", exc)
                db.connector.close()
            self.leading = False
        finally:
            super().close()

    def get_schedule(self) -> dict[str, beat.ScheduleEntry]:
        """The enabled entries as the last tick read them, as Celery's entries."""
        return {
            name: beat.ScheduleEntry(
                name=name,
                task=entry.task,
                schedule=entry.schedule.celery(),
                args=entry.args,
                kwargs=entry.kwargs,
                options=entry.options,
                last_run_at=entry.last_due,
                app=self.app,
            )
            for name, entry in self._stored.items()
        }

    def set_schedule(self, schedule: Any) -> None:
        self.data = schedule

    schedule = property(get_schedule, set_schedule)

    @property
    def info(self) -> str:
        if self.db is None:
            return "    . schedule -> Postgres (pgq)"
        return f"    . schedule -> pgq schema {self.db.schema!r} at {self.db.connector.display_url}"

    # -- leading and sending ---------------------------------------------------
    @property
    def tick_seconds(self) -> float:
        return float(self.max_interval)

    @property
    def timezone(self) -> tzinfo:
        return self.app.timezone  # type: ignore[no-any-return]

    def hold_lease(self) -> bool:
        """Take or renew the lease (valid for a tick and a half); whether this beat leads."""
        assert self.db is not None
        term = self.db.hold_lease(self.holder, self.tick_seconds * 1.5)
        if term is None:
            if self.leading:
                logger.warning("pgq beat: %s lost the lease to another beat", self.holder)
            self.leading = False
            return False
        if not self.leading or term != self.term:
            logger.info("pgq beat: %s leads (term %d), sending the schedule", self.holder, term)
        self.leading, self.term, self._renewed = True, term, time.monotonic()
        return True

    def send_due(self) -> float:
        """Send every due slot of every enabled entry; the seconds until the next one
        (at most half a tick: the lease is renewed every half tick). Safe whether this
        beat leads or not, and with any number of beats at once."""
        assert self.db is not None
        half = self.tick_seconds / 2
        entries, now = self.db.entries()
        read_at = time.monotonic()
        self._stored = {entry.name: entry for entry in entries}
        soonest: datetime | None = None
        for entry in entries:
            try:
                slots = due_slots(
                    entry.schedule,
                    entry.anchor,
                    entry.last_due,
                    now,
                    self.timezone,
                    self.settings.catch_up,
                )
                upcoming = entry.schedule.next_slot(entry.anchor, max([now, *slots]), self.timezone)
            except ValueError as exc:
                logger.error("pgq beat: entry %r has no next slot: %s", entry.name, exc)
                continue
            for due in slots:
                # A long catch-up renews the lease on the way (and stops once it is
                # lost). Sending needs no lease: the slot's transaction decides.
                renew = self.leading and time.monotonic() - self._renewed > half
                if renew and not self.hold_lease():
                    return half
                self.send_slot(entry, due)
            soonest = upcoming if soonest is None else min(soonest, upcoming)
        if time.monotonic() - self._pruned > _PRUNE_EVERY:
            self._pruned = time.monotonic()
            self.db.prune(SLOT_RETENTION)
        if soonest is None:
            return half
        wait = (soonest - now).total_seconds() - (time.monotonic() - read_at)
        return min(max(wait, _MIN_SLEEP), half)

    def publisher(self) -> Publisher:
        """The publisher of the producer's channel: the batch its messages join."""
        publisher = getattr(self.producer.channel, "publisher", None)
        if not isinstance(publisher, Publisher):
            raise ConfigurationError("pgq's beat scheduler needs the pgq transport's channel")
        return publisher

    def send_slot(self, entry: Stored, due: datetime) -> bool:
        """Send slot ``due`` of ``entry`` unless some beat did: the slot is taken and the
        message inserted in one transaction. Whether this call sent it."""
        assert self.db is not None
        db, task_id = self.db, str(uuid.uuid4())
        headers = dict(entry.options.get("headers") or {})
        headers.update({HEADER_ENTRY: entry.name, HEADER_DUE: due.isoformat()})
        celery_entry = beat.ScheduleEntry(
            name=entry.name,
            task=entry.task,
            schedule=entry.schedule.celery(),
            args=entry.args,
            kwargs=entry.kwargs,
            options={**entry.options, "task_id": task_id, "headers": headers},
            app=self.app,
        )
        try:
            publisher = self.publisher()
            with batch():
                if not publisher.in_batch(
                    lambda conn: db.take_slot(conn, entry, due, task_id, self.holder)
                ):
                    return False
                logger.info("pgq beat: sending %s (%s) due %s", entry.name, entry.task, due)
                super().apply_async(celery_entry, producer=self.producer, advance=False)
        except Exception as exc:
            # Whatever failed (the broker connection, the message, the commit), nothing of
            # the slot was committed: it is tried again at the next tick, and the beat
            # goes on with its other entries, as Celery's beat does.
            logger.error(
                "pgq beat: sending %s due %s failed: %s", entry.name, due, exc, exc_info=True
            )
            return False
        return True
