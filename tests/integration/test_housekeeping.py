"""A consumer's housekeeping threads (lease renewal, queue maintenance and the vacuum
check; vacuuming) end when its connection closes: none of them is left sending
statements to a database its test, or its application, drops next. Lease renewal keeps
its pace while a VACUUM runs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import suppress
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Queue

from pg_transport.consume.housekeeping import Housekeeper
from pg_transport.consume.vacuum import Vacuumer
from pg_transport.message.rows import Lease
from tests.integration.conftest import Peek, PublishingStore
from tests.integration.test_vacuum import dead_rows
from tests.pg import (
    create_database,
    drop_database,
    metered_database,
    new_database_name,
    to_broker_url,
)


@pytest.fixture
def own_database(pg_url: str) -> Iterator[str]:
    """A database of this test's own (the session's prefix: cleaned up if interrupted),
    kept by a session of its own while the test runs: named with that session's pid, so
    that no run starting beside this one (another pytest process, a run this suite
    starts) takes it for abandoned."""
    with psycopg.connect(pg_url, autocommit=True) as keeper:
        name = new_database_name(keeper_pid=keeper.info.backend_pid)
        url = create_database(pg_url, name, keeper)
        metered_database(name)
        try:
            yield url
        finally:
            drop_database(pg_url, name)


def consuming(url: str, schema: str) -> tuple[Connection, Consumer]:
    conn = Connection(to_broker_url(url), transport_options={"schema": schema})
    consumer = Consumer(conn, [Queue("kept", Exchange("kept"), "r")], accept=["json"])
    consumer.consume()
    with suppress(TimeoutError):
        conn.drain_events(timeout=0.05)  # starts the housekeeping threads
    return conn, consumer


def threads_of(conn: Connection) -> list[Any]:
    transport = conn.transport
    found = [transport._renewer, transport._vacuumer]
    assert all(t is not None and t.is_alive() for t in found), found
    return found


def test_closing_a_consumer_ends_its_housekeeping_before_the_close_returns(
    own_database: str, schema: str, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    conn, _ = consuming(own_database, schema)
    threads = threads_of(conn)
    conn.close()
    assert [t.name for t in threads if t.is_alive()] == [], "still running after the close"
    # So dropping its database right after cannot make one fail on it.
    drop_database(pg_url, own_database.rsplit("/", 1)[1].split("?")[0])
    assert not [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]


class HeldVacuum(Vacuumer):
    """A VACUUM that takes as long as the test says: it starts, then waits for ``release``
    before it runs (a VACUUM of a large table takes seconds)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.started = threading.Event()
        self.release = threading.Event()

    def vacuum(self) -> None:
        self.started.set()
        self.release.wait(30)
        super().vacuum()


def test_lease_renewal_keeps_its_pace_while_a_vacuum_runs(
    store: PublishingStore, peek: Peek
) -> None:
    """The housekeeping thread looks for dead rows on the session it renews and maintains
    on; the VACUUM the look finds due runs on the vacuum thread, and renewals go on."""
    vt = 1.5
    dead_rows(peek, 100)  # (first: it empties the table)
    for n in range(10):
        store.publisher.publish("q", {"body": n, "properties": {"delivery_info": {}}})
    held = [(c.token, vt) for c in store.claim(["q"], [vt], 10)]
    vacuumer = HeldVacuum(store.connector, store.schema, 1)
    renewed: list[float] = []

    def renew(leases: Sequence[tuple[Lease, float]]) -> None:
        assert store.renew(leases) == len(leases), "a lease lapsed"
        renewed.append(time.monotonic())

    housekeeper = Housekeeper(
        flush_acks=lambda: None,
        held=lambda: held,
        renew=renew,
        maintain=lambda: None,
        default_vt=vt,
        look=vacuumer.look,
    )
    vacuumer.start()
    housekeeper.start()
    try:
        assert vacuumer.started.wait(30), "the look never found the dead rows"
        since = time.monotonic()
        while time.monotonic() - since < 3 * vt:  # three leases long: a measurement
            time.sleep(vt / 3)
        during = [t for t in renewed if t >= since]
        vacuumer.release.set()
    finally:
        housekeeper.stop(10)
        vacuumer.stop(10)
    assert vacuumer.vacuums == 1
    # Every vt/3 (the pace), a little later under load; never a lease's length.
    gaps = [b - a for a, b in zip([since, *during], during, strict=False)]
    assert len(during) >= 3 and max(gaps) < vt, gaps
