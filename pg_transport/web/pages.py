"""The console's pages: every one reads, none changes anything."""

from __future__ import annotations

from datetime import datetime, timedelta, tzinfo
from typing import Any

import tornado.web

from pg_transport.ops import status as status_report
from pg_transport.ops.plugins import plugin
from pg_transport.web import consumers as consuming
from pg_transport.web import sampler
from pg_transport.web.base import STALE_INTERVALS, Base, checked_time, until
from pg_transport.web.chart import chart

__all__ = ["routes"]


def _stale(at: datetime, now: datetime, interval: float) -> bool:
    return (now - at).total_seconds() > STALE_INTERVALS * interval


#: What the charts may span, in seconds: the last 5 minutes, 15 minutes or hour.
WINDOWS = (300, 900, 3600)


def _window(handler: Base) -> int:
    raw = handler.get_query_argument("window", str(WINDOWS[-1]))
    if raw not in {str(w) for w in WINDOWS}:
        raise tornado.web.HTTPError(
            400, "bad window %r: one of %s seconds", raw, ", ".join(map(str, WINDOWS))
        )
    return int(raw)


class QueuesPage(Base):
    async def get(self) -> None:
        c = self.console
        window = _window(self)

        def read() -> dict[str, Any]:
            latest = sampler.latest(c.connector, c.schema)
            now = c.reads.now()
            live = latest.at is None or _stale(latest.at, now, c.interval)
            # No fresh tick (a first start, or no console whose role may write them):
            # counted now, with the query of `pgq status`: one scan of the message table.
            queues = status_report.collect(c.store).queues if live else latest.queues
            change = {} if live else sampler.changes(c.connector, c.schema, latest)
            depths, rates = sampler.history(c.connector, c.schema, None, window)
            per_queue = sampler.queue_rates(c.connector, c.schema, window)
            consumers = c.consumers.seen(c.reads.now) if c.consumers is not None else None
            # Which worker nodes Postgres knows connected (their sessions' names): those
            # the answers leave out are named, not silently missing from the counts.
            processes = c.reads.processes()
            return {
                "consumers": consumers,
                "connected": consuming.connected(processes),
                "silent": [] if consumers is None else consuming.silent(consumers, processes),
                "per_queue": per_queue,
                "latest": latest,
                "queues": queues,
                "live": live,
                "change": change,
                "depths": depths,
                "rates": rates,
                "now": now,
            }

        data = await self.db(read)
        now: datetime = data["now"]
        start = now - timedelta(seconds=window)
        depth_chart = chart(
            "Messages waiting, all queues",
            [
                ("waiting", "waiting", [(a, float(w)) for a, w, _ in data["depths"]]),
                ("ready", "ready", [(a, float(r)) for a, _, r in data["depths"]]),
            ],
            start=start,
            end=now,
        )
        rate_chart = chart(
            "Rows per second (message table)",
            [
                ("published", "published", [(r.at, r.inserted) for r in data["rates"]]),
                ("removed", "removed", [(r.at, r.deleted) for r in data["rates"]]),
            ],
            start=start,
            end=now,
        )
        latest = data["latest"]
        last_rates = data["rates"][-1] if data["rates"] else None
        # Celery's own queues (remote-control mailboxes and replies, event receivers')
        # hold no tasks: listed apart, folded away.
        queues = [q for q in data["queues"] if status_report.celery_own(q.queue) is None]
        own = [q for q in data["queues"] if status_report.celery_own(q.queue) is not None]
        self.page(
            "queues.html",
            window=window,
            windows=WINDOWS,
            queues=queues,
            own=own,
            kind_of=status_report.celery_own,
            consumers=data["consumers"],
            connected=data["connected"],
            silent=data["silent"],
            per_queue=data["per_queue"],
            change=data["change"],
            sampled_at=latest.at,
            live=data["live"],
            charts=[depth_chart, rate_chart],
            rates=last_rates,
            refresh=max(int(c.interval), 2),
        )


class QueuePage(Base):
    async def get(self) -> None:
        name = self.get_query_argument("name")
        c = self.console
        window = _window(self)

        def read() -> dict[str, Any]:
            caps = self.capabilities()
            latest = sampler.latest(c.connector, c.schema)
            figures = next((q for q in latest.queues if q.queue == name), None)
            ready = c.reads.messages(name, delayed=False, payloads=caps.payloads)
            delayed = c.reads.messages(name, delayed=True, payloads=caps.payloads)
            depths, _ = sampler.history(c.connector, c.schema, name, window)
            now = c.reads.now()
            return {
                "caps": caps,
                "figures": figures,
                "ready": ready,
                "delayed": delayed,
                "depths": depths,
                "now": now,
                "sampled_at": latest.at,
            }

        data = await self.db(read)
        now = data["now"]
        depth_chart = chart(
            "Messages waiting",
            [
                ("waiting", "waiting", [(a, float(w)) for a, w, _ in data["depths"]]),
                ("ready", "ready", [(a, float(r)) for a, _, r in data["depths"]]),
            ],
            start=now - timedelta(seconds=window),
            end=now,
        )
        self.page(
            "queue.html",
            window=window,
            windows=WINDOWS,
            name=name,
            charts=[depth_chart],
            until=until,
            refresh=max(int(c.interval), 2),
            **data,
        )


class DeadPage(Base):
    async def get(self) -> None:
        c = self.console
        filters = {
            key: (self.get_query_argument(key, "") or "").strip() or None
            for key in ("queue", "reason", "task", "since", "until")
        }
        since = checked_time(filters["since"], "since")
        until = checked_time(filters["until"], "until")

        def read() -> dict[str, Any]:
            caps = self.capabilities()
            rows, total = c.reads.dead(
                details=caps.dead_details,
                queue=filters["queue"],
                reason=filters["reason"] if caps.dead_details else None,
                task=filters["task"] if caps.dead_details else None,
                since=since,
                until=until,
            )
            return {"caps": caps, "rows": rows, "total": total}

        data = await self.db(read)
        self.page("dead.html", filters=filters, **data)


class DeadOnePage(Base):
    async def get(self, ident: str) -> None:
        c = self.console
        dead_id = int(ident)

        def read() -> dict[str, Any]:
            caps = self.capabilities()
            row = c.reads.dead_one(dead_id, details=caps.dead_details)
            task = c.reads.dead_payload(dead_id) if caps.payloads else None
            return {"caps": caps, "row": row, "task": task}

        data = await self.db(read)
        if data["row"] is None:
            raise tornado.web.HTTPError(404, "no dead-letter row %d", dead_id)
        self.page("dead_one.html", **data)


#: The statuses the barriers list filters on (a barrier's status column).
BARRIER_STATUSES = ("armed", "fired", "completed", "failed", "expired")


class BarriersPage(Base):
    async def get(self) -> None:
        c = self.console
        wanted = (self.get_query_argument("id", "") or "").strip()
        status = (self.get_query_argument("status", "") or "").strip() or None
        if status is not None and status not in BARRIER_STATUSES:
            raise tornado.web.HTTPError(
                400, "bad status %r: one of %s", status, ", ".join(BARRIER_STATUSES)
            )
        before_at = checked_time(self.get_query_argument("before_at", "") or None, "before_at")
        before_id = self.get_query_argument("before_id", "") or ""
        before = None if before_at is None else (before_at, before_id)

        def read() -> dict[str, Any]:
            caps = self.capabilities()
            counts = status_report.barrier_counts(c.store)
            # Only a role that may read callbacks and parts gets one barrier's details.
            extra = plugin("barrier")
            show = None if extra is None else extra.show
            found = None
            if wanted and caps.barrier_details and show is not None:
                found = show(c.connector, c.schema, wanted)
            armed = c.reads.armed_barriers()
            listed, after = c.reads.barriers_page(status, before)
            return {
                "caps": caps,
                "counts": counts,
                "found": found,
                "armed": armed,
                "listed": listed,
                "after": after,
            }

        data = await self.db(read)
        if wanted and data["caps"].barrier_details and data["found"] is None:
            raise tornado.web.HTTPError(404, "no barrier %r", wanted)
        self.page(
            "barriers.html",
            wanted=wanted,
            listing=status,
            statuses=BARRIER_STATUSES,
            paged=before is not None,
            **data,
        )


#: A crontab's fields, in cron's order.
CRON_FIELDS = ("minute", "hour", "day of month", "month", "day of week")


def readable_schedule(entry: dict[str, Any], now: datetime, tz: tzinfo) -> dict[str, Any]:
    """An entry's schedule as the page shows it: ``kind`` (``every``, ``crontab`` or
    ``unreadable``), its ``fields`` (label, value) and its ``next`` run (None when it is
    disabled or its schedule cannot be read)."""
    from pg_transport.beat.entries import Cron, schedule_from_json

    data = entry["schedule"]
    try:
        sched = schedule_from_json(data)
    except (ValueError, TypeError, KeyError, AttributeError):
        return {"kind": "unreadable", "fields": [("stored", str(data))], "next": None}
    if isinstance(sched, Cron):
        fields = list(zip(CRON_FIELDS, sched.spec.split(), strict=True))
        kind = "crontab"
    else:
        fields = [("seconds", f"{sched.seconds:g}")]
        if sched.aligned:
            fields.append(("aligned", "to the epoch"))
        kind = "every"
    upcoming = None
    if entry["enabled"]:
        anchor = entry["anchor"]
        after = max(now, entry["last_due"] or anchor)
        try:
            upcoming = sched.next_slot(anchor, after, tz)
        except ValueError:  # a crontab that never falls due
            upcoming = None
    return {"kind": kind, "fields": fields, "next": upcoming}


class SchedulesPage(Base):
    async def get(self) -> None:
        from celery import current_app

        from pg_transport.beat.store import BeatStore

        c = self.console
        # The app given with --app (Celery's default app otherwise: UTC) says in which
        # timezone a crontab's minutes are, as it does for its beat.
        tz = current_app.timezone

        def read() -> dict[str, Any]:
            beat = BeatStore(c.connector, c.schema)
            entries = beat.listing()
            now = c.reads.now()
            shown = [readable_schedule(e, now, tz) for e in entries]
            return {"entries": list(zip(entries, shown, strict=True)), "leader": beat.leader()}

        data = await self.db(read)
        self.page("schedules.html", tz=str(tz), **data)


class ProcessesPage(Base):
    async def get(self) -> None:
        rows = await self.db(self.console.reads.processes)
        self.page("processes.html", rows=rows, refresh=max(int(self.console.interval), 2))


class LimitsPage(Base):
    """The flow limits (docs/flow-control.md), read only: each limit's definition, the
    messages holding its slots and those waiting for one. Counted per limit: no key is
    read (a console run as the monitor may not read them). Then the unique keys held per
    queue, queued and running: counted by unique_counts(), never listed."""

    async def get(self) -> None:
        store = self.console.store
        rows = await self.db(lambda: status_report.limit_lines(store))
        unique = await self.db(lambda: status_report.unique_lines(store))
        self.page(
            "limits.html", rows=rows, unique=unique, refresh=max(int(self.console.interval), 2)
        )


class RootPage(Base):
    def get(self) -> None:
        self.redirect("/queues")


class NotFound(Base):
    """Any other path: the console's own 404 page, with its headers."""

    def prepare(self) -> None:
        super().prepare()
        raise tornado.web.HTTPError(404, "no such page")


def routes(args: dict[str, Any]) -> list[Any]:
    return [
        (r"/", RootPage, args),
        (r"/queues", QueuesPage, args),
        (r"/queue", QueuePage, args),
        (r"/dead", DeadPage, args),
        (r"/dead/([0-9]{1,18})", DeadOnePage, args),
        (r"/barriers", BarriersPage, args),
        (r"/schedules", SchedulesPage, args),
        (r"/processes", ProcessesPage, args),
        (r"/limits", LimitsPage, args),
    ]
