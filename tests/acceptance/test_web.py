"""`pgq web` in a real browser (Debian's headless Chromium), against real Postgres, a real
console process and real Celery workers."""

from __future__ import annotations

import re
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.cookiejar import CookieJar
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.acceptance import console as web
from tests.acceptance.harness import QUICK_STOP, Env, start_worker, wait_for
from tests.pg import pgq_url

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(not web.available(), reason="needs chromium and chromium-driver"),
]


@pytest.fixture
def env(env: Env) -> Env:
    """Workers that poll every 0.2 s (QUICK_STOP): nothing here is timed against the poll."""
    env.extra.update(QUICK_STOP)
    return env


TOKEN = "test-token-0123456789"
MARK = "tests.acceptance.app.mark"
POISON_APP = "tests.acceptance.poison_app"
POISON_TASK = "tests.acceptance.poison_app.run_pipeline"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = web.browser()
    try:
        yield driver
    finally:
        driver.quit()


def cell(browser: Any, queue: str, column: str) -> str | None:
    from selenium.common.exceptions import NoSuchElementException

    try:
        row = browser.find_element("css selector", f'tr[data-queue="{queue}"]')
        return str(row.find_element("css selector", f"td.{column}").text)
    except NoSuchElementException:
        return None


def rate(browser: Any, queue: str, column: str) -> float:
    """A rate the queues page shows (nan where it shows none: ``-``)."""
    text = cell(browser, queue, column)
    return float("nan") if text in (None, "-") else float(text)


def showing(browser: Any, url: str, predicate: Any, what: str, timeout: float = 30) -> None:
    """Reload ``url`` until ``predicate(browser)`` holds (the page shows an outcome).

    A load of the page without an element the predicate reads does not show the outcome
    yet: the next reload is looked at (once, at load 17, a processes page's worker row
    was read without its node cell), and the wait fails only when ``timeout`` ends."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    def check() -> bool:
        browser.get(url)
        try:
            return bool(predicate(browser))
        except (NoSuchElementException, StaleElementReferenceException):
            return False

    wait_for(check, timeout, what, step=0.3)


def element(browser: Any, ident: str, timeout: float = 15) -> Any:
    """The element ``ident`` of the page a click leads to, once that page has loaded
    (a click returns before the next page is there)."""
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout).until(
        expected_conditions.presence_of_element_located(("id", ident))
    )


def sign_in(browser: Any, base: str, name: str = "alice") -> None:
    browser.get(base + "/login")
    browser.find_element("id", "name").send_keys(name)
    browser.find_element("id", "token").send_keys(TOKEN)
    browser.find_element("id", "submit").click()
    assert element(browser, "user").text == name


def add_dead(env: Env, count: int, queue: str = "web.dead") -> list[int]:
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        rows = conn.execute(
            sql.SQL(
                "INSERT INTO {}.dead_letter (message_id, queue, read_ct, enqueued_at, reason,"
                " task_name, task_id, payload) SELECT i, %s, 5, now(), 'rejected',"
                " 'app.t', 'task-' || i, '{{}}' FROM generate_series(1, %s) AS i RETURNING id"
            ).format(sql.Identifier(env.schema)),
            [queue, count],
        ).fetchall()
    return [int(r[0]) for r in rows]


@pytest.mark.sessions(16)
def test_the_queues_page_shows_a_queue_filling_and_draining(env: Env, browser: Any) -> None:
    client = env.client()
    # Published before the console starts: its first sample of web.fill is of all 40.
    for i in range(40):
        client.send_task(MARK, kwargs={"label": f"m{i}"}, queue="web.fill")
    with web.console(env) as console:
        page = console.url + "/queues"
        showing(browser, page, lambda b: cell(b, "web.fill", "ready") == "40", "40 ready")
        # The queue's own page lists the next messages a claim takes, task name and all.
        browser.find_element("link text", "web.fill").click()
        element(browser, "ready")
        assert "Queue web.fill" in browser.find_element("tag name", "h1").text
        assert len(browser.find_elements("css selector", "#ready tbody tr")) == 20
        assert MARK in browser.find_element("id", "ready").text

        # A worker that does not answer remote control: Postgres knows it is connected.
        quiet = start_worker(env, "quiet", queues="web.quiet", environ={"TEST_REMOTE_CONTROL": "0"})
        worker = start_worker(env, "drain", queues="web.fill")
        try:
            wait_for(lambda: len(env.runs()) == 40, 60, "the worker to run all 40")
            # The worker's sessions carry its node name and kind; its remote-control
            # mailbox is listed apart from the task queues, folded away.
            node = f"drain@{socket.gethostname()}"
            showing(
                browser,
                console.url + "/processes",
                lambda b: any(
                    r.find_element("css selector", "td.kind").text == "worker"
                    and r.find_element("css selector", "td.node").text == node
                    for r in b.find_elements("css selector", "#processes tbody tr")
                ),
                "the worker's node on the processes page",
            )
            mailbox = f"{node}.celery.pidbox"
            showing(
                browser,
                page,
                lambda b: b.find_elements("css selector", f'tr[data-own-queue="{mailbox}"]'),
                "the worker's mailbox among Celery's own queues",
            )
            assert not browser.find_elements("css selector", f'tr[data-queue="{mailbox}"]')
            own = browser.find_element("id", "celery-queues")
            assert own.get_attribute("open") is None  # folded away until asked for
            assert not own.find_element("id", "own-queues").is_displayed()
            own.find_element("tag name", "summary").click()
            row = own.find_element("css selector", f'tr[data-own-queue="{mailbox}"]')
            assert row.find_element("css selector", "td.kind").text == "control"
            # Who consumes each queue: the workers' own answer to remote control.
            showing(
                browser,
                page,
                lambda b: cell(b, "web.fill", "consumers") == f"1 {node}",
                "the worker among web.fill's consumers",
            )
            quiet_node = f"quiet@{socket.gethostname()}"
            showing(
                browser,
                page,
                lambda b: any(
                    quiet_node in e.text for e in b.find_elements("id", "silent-workers")
                ),
                "the worker without remote control named as connected, not counted",
            )
            assert cell(browser, "web.fill", "consumers") == f"1 {node}"
            showing(
                browser,
                page,
                lambda b: (
                    cell(b, "web.fill", "ready") == "0" and cell(b, "web.fill", "in-flight") == "0"
                ),
                "the queue drained",
            )
            # Its rate over the samples of the window: from 40 waiting (the first
            # sample) to none, so below zero; nothing dead-lettered yet.
            showing(
                browser,
                page,
                lambda b: rate(b, "web.fill", "rate") < 0,
                "web.fill's rate below zero",
            )
            assert cell(browser, "web.fill", "dead-rate") == "+0.00"
            add_dead(env, 2, queue="web.fill")
            showing(
                browser,
                page,
                lambda b: rate(b, "web.fill", "dead-rate") > 0,
                "web.fill's dead letters per second above zero",
            )
        finally:
            worker.stop()
            quiet.stop()
        # The history the chart draws: kept in Postgres, full then empty.
        depths = env.scalar(
            "SELECT array_agg(ready + in_flight ORDER BY at) FROM {schema}.console_sample"
            " WHERE queue = 'web.fill'"
        )
        assert max(depths) == 40 and depths[-1] == 0
        waiting = browser.find_element("css selector", "polyline.waiting")
        assert len(waiting.get_attribute("points").split()) >= 2


def test_a_poisoned_task_is_shown_with_its_identity_and_requeue_runs_it(
    env: Env, browser: Any
) -> None:
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.poison_log (sender text, queue text, task_id text,"
                " identity jsonb, attempts int, dead_letter_id bigint)"
            ).format(sql.Identifier(env.schema))
        )
    environ = {"PGQ_MAX_ATTEMPTS_CELERY": "1", "PGQ_VISIBILITY_TIMEOUT": "1"}
    sent = env.client().send_task(POISON_TASK, args=[42], kwargs={"execution_id": "exec-9"})
    first = start_worker(
        env, "p1", pool="solo", concurrency=1, app=POISON_APP, environ=environ, may_exit=True
    )
    wait_for(lambda: len(env.runs()) == 1, 30, "the first delivery")
    assert first.proc.wait(30) != 0  # the task took its worker down
    # The next claim finds it past max_attempts: dead-lettered, hooks run.
    second = start_worker(
        env, "p2", pool="solo", concurrency=1, app=POISON_APP, environ=environ, may_exit=True
    )
    try:
        wait_for(lambda: env.scalar("SELECT count(*) FROM {schema}.poison_log"), 30, "the hook")
        # The console imports the app's module, so its message_poisoned handlers run.
        with web.console(env, token=TOKEN, app=POISON_APP) as console:
            sign_in(browser, console.url)
            browser.get(console.url + "/dead")
            row = browser.find_element("css selector", "#dead tbody tr")
            assert sent.id in row.text and POISON_TASK in row.text
            assert "organization_id=42" in row.text and "execution_id=exec-9" in row.text
            assert row.find_element("css selector", "td.hooks").text == "1 ok, 1 failed"
            row.find_element("css selector", "td a").click()  # its own page: each hook
            hooks = element(browser, "hooks").text
            assert "mark_pipeline_failed ok" in hooks and "flaky_hook failed" in hooks
            assert "exec-9" in browser.find_element("id", "payload").text

            # Run the hooks again: each handler is called once more, outcomes recorded.
            dead_id = env.scalar("SELECT id FROM {schema}.dead_letter")
            browser.find_element("id", "rehook").click()
            assert f"row {dead_id}: 1 of 2 handlers ok" in element(browser, "result").text
            assert env.scalar("SELECT count(*) FROM {schema}.poison_log") == 2
            browser.get(f"{console.url}/dead/{dead_id}")
            element(browser, "requeue").click()
            assert "1 dead-letter row requeued" in element(browser, "result").text
            # A worker runs it again (and dies of it again: that is the task).
            wait_for(lambda: len(env.runs()) == 2, 60, "the requeued task to run")
            assert env.runs()[1][0] == sent.id
            wait_for(
                lambda: "alice from 127.0.0.1 requeued dead letters" in console.output(),
                10,
                "the audit line",
            )
    finally:
        second.stop()


def test_purge_asks_for_confirmation_first(env: Env, browser: Any) -> None:
    ids = add_dead(env, 3)
    with web.console(env, token=TOKEN) as console:
        sign_in(browser, console.url, "bob")
        browser.get(console.url + "/dead")
        for ident in ids[:2]:
            browser.find_element("css selector", f'input[name="id"][value="{ident}"]').click()
        browser.find_element("id", "purge").click()
        element(browser, "confirm-purge")
        assert "Purge 2 dead-letter rows?" in browser.find_element("tag name", "h1").text
        # Asked, not done: every row is still there.
        assert env.scalar("SELECT count(*) FROM {schema}.dead_letter") == 3
        browser.find_element("id", "confirm-purge").click()
        assert "2 dead-letter rows purged" in element(browser, "result").text
        left = env.scalar("SELECT array_agg(id) FROM {schema}.dead_letter")
        assert left == [ids[2]]
        wait_for(
            lambda: "bob from 127.0.0.1 purged dead letters" in console.output(),
            10,
            "the audit line",
        )


def post_form(base: str, path: str, fields: list[tuple[str, str]], xsrf: bool = True) -> int:
    """POST a form as a page of the console would, with its XSRF cookie and field."""
    jar = CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    opener.open(base + "/dead").read()
    token = next(c.value for c in jar if c.name == "_xsrf")
    body = urllib.parse.urlencode([*fields, *([("_xsrf", token)] if xsrf else [])]).encode()
    try:
        return int(opener.open(base + path, data=body).status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_without_the_token_no_action_is_possible(env: Env, browser: Any) -> None:
    ids = add_dead(env, 1)
    # A password in the URL (the server trusts local connections and ignores it) is
    # shown on no page.
    url = pgq_url(env.pg_url, password="hunter2-secret")
    assert "hunter2-secret" in url
    with web.console(env, url=url) as console:
        for path in ("/queues", "/processes", "/dead/999999"):
            browser.get(console.url + path)
            assert "hunter2-secret" not in browser.page_source, path
        assert "hunter2-secret" not in console.output()
        # A page of another site whose name resolves to 127.0.0.1 (DNS rebinding) gets
        # nothing: it sends its own name as Host.
        rebound = urllib.request.Request(console.url + "/dead", headers={"Host": "evil.test"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(rebound, timeout=10)
        assert refused.value.code == 400
        browser.get(console.url + "/dead")
        assert browser.find_element("id", "mode").text == "read-only"
        assert str(ids[0]) in browser.find_element("id", "dead").text
        for control in ("requeue", "rehook", "purge"):
            assert not browser.find_elements("id", control)
        assert not browser.find_elements("css selector", 'input[type="checkbox"]')
        for path in ("/dead/requeue", "/dead/purge", "/dead/rehook"):
            fields = [("id", str(ids[0])), ("confirm", "yes")]
            assert post_form(console.url, path, fields) == 403, path
        assert post_form(console.url, "/login", [("name", "eve"), ("token", "")]) == 404
    with web.console(env, token=TOKEN) as console:
        # With a token, but not signed in; and signed in needs the form's XSRF field.
        assert (
            post_form(console.url, "/dead/purge", [("id", str(ids[0])), ("confirm", "yes")]) == 403
        )
        assert post_form(console.url, "/login", [("name", "eve"), ("token", "wrong" * 4)]) == 403
        assert post_form(console.url, "/login", [("name", "eve"), ("token", TOKEN)], False) == 403
    assert env.scalar("SELECT array_agg(id) FROM {schema}.dead_letter") == ids


def monitor_role(env: Env, role: str) -> None:
    """Block 5 of docs/least-privilege.md (docker/grants.sql), for this schema and role."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docker" / "grants.sql").read_text()
    block = text.split("-- 5. monitor rights, as pgq_owner\n")[1].split("-- 6.")[0]
    schema = sql.Identifier(env.schema).as_string(None)
    block = block.replace("pgq_owner", "CURRENT_USER").replace("pgq_monitor", role)
    block = re.sub(r"\bpgq\b(?=[. ;\n])", schema, block)
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
                sql.Identifier(conn.info.dbname), sql.Identifier(role)
            )
        )
        conn.execute(block)


def test_a_monitor_role_sees_counts_but_no_payloads(env: Env, browser: Any) -> None:
    role = f"{env.schema}_monitor"
    monitor_role(env, role)
    try:
        for i in range(5):
            env.client().send_task(MARK, kwargs={"label": f"secret-{i}"}, queue="web.mon")
        add_dead(env, 2, queue="web.mon")
        url = pgq_url(env.pg_url, user=role)
        assert role in url
        with web.console(env, url=url) as console:
            showing(
                browser,
                console.url + "/queues",
                lambda b: cell(b, "web.mon", "ready") == "5",
                "the monitor's counts",
            )
            assert cell(browser, "web.mon", "dead") == "2"
            # It may not publish, so it cannot ask the workers what they consume: the
            # column says it does not know, and the page lists the worker nodes Postgres
            # knows connected (their sessions' names).
            worker = start_worker(env, "seen", queues="web.other")
            try:
                node = f"seen@{socket.gethostname()}"
                showing(
                    browser,
                    console.url + "/queues",
                    lambda b: any(
                        node in e.text for e in b.find_elements("id", "connected-workers")
                    ),
                    "the connected worker listed for the monitor",
                )
                assert cell(browser, "web.mon", "consumers") == "?"
                assert browser.find_element("id", "no-consumers")
            finally:
                worker.stop()
            browser.get(console.url + "/queue?name=web.mon")
            assert browser.find_element("id", "no-payloads")
            assert len(browser.find_elements("css selector", "#ready tbody tr")) == 5
            assert "secret" not in browser.page_source and MARK not in browser.page_source
            browser.get(console.url + "/dead?queue=web.mon")
            assert browser.find_element("id", "no-details")
            assert "rejected" not in browser.page_source and "app.t" not in browser.page_source
            assert len(browser.find_elements("css selector", "#dead tbody tr")) == 2
            browser.get(console.url + "/barriers")  # the list reads columns it may read
            assert browser.find_element("id", "barrier-list")
            browser.get(console.url + "/schedules")  # the schedule holds task arguments
            assert browser.find_element("id", "error-title").text == "Not allowed for this role"
            assert "permission denied" in browser.find_element("id", "error-detail").text
    finally:
        with psycopg.connect(env.pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_row_content_is_shown_as_text_never_as_markup(env: Env, browser: Any) -> None:
    hostile = '"><img src=x onerror=alert(1)><script>alert(2)</script>'
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        s = sql.Identifier(env.schema)
        conn.execute(
            sql.SQL("INSERT INTO {}.message (queue, payload) VALUES (%s, '{{}}')").format(s),
            [hostile],
        )
        dead_id = conn.execute(
            sql.SQL(
                "INSERT INTO {}.dead_letter (message_id, queue, read_ct, enqueued_at, reason,"
                " task_name, task_id, identity, hooks, payload) VALUES (1, %s, 1, now(), %s,"
                " %s, %s, jsonb_build_object('k', %s::text),"
                " jsonb_build_array(jsonb_build_object('receiver', %s::text, 'ok', false,"
                " 'error', %s::text)), '{{}}') RETURNING id"
            ).format(s),
            [hostile] * 7,
        ).fetchone()[0]  # type: ignore[index]
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.barrier (id, total, remaining, callback, expires_at,"
                " stuck_timeout) VALUES (%s, 2, 1, json_build_object('task', %s::text),"
                " now() + interval '1 hour', interval '1 minute')"
            ).format(s),
            [hostile, hostile],
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.beat_entry (name, task, schedule, origin)"
                " VALUES (%s, %s, '{{\"every\": 5}}', 'command')"
            ).format(s),
            [hostile, hostile],
        )
        # Schedules shown by their fields, with their next run, not as stored JSON.
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.beat_entry (name, task, schedule, origin, enabled) VALUES"
                " ('nightly', 'app.report', '{{\"crontab\": \"30 3 * * 1-5\"}}', 'command', true),"
                " ('off', 'app.report', '{{\"every\": 90}}', 'command', false)"
            ).format(s)
        )
        # Barriers to list by status, newest first, a page at a time: 52 expired, 3
        # completed, one a minute apart.
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.barrier (id, status, total, remaining, callback, created_at,"
                " expires_at, stuck_timeout, finished_at) SELECT 'b' || i,"
                " CASE WHEN i <= 52 THEN 'expired' ELSE 'completed' END, 3,"
                " CASE WHEN i <= 52 THEN 1 ELSE 0 END, '{{}}', now() - i * interval '1 minute',"
                " now() - interval '1 second', interval '1 minute', now()"
                " FROM generate_series(1, 55) AS i"
            ).format(s)
        )
    quoted = urllib.parse.quote(hostile, safe="")
    with web.console(env) as console:
        for path in (
            "/queues",
            f"/queue?name={quoted}",
            "/dead",
            f"/dead/{dead_id}",
            f"/barriers?id={quoted}",
            "/schedules",
        ):
            browser.get(console.url + path)
            assert hostile in browser.find_element("tag name", "main").text, path
            for tag in ("img", "script"):
                assert not browser.find_elements("tag name", tag), (path, tag)
        # (the page last shown is /schedules)
        nightly = browser.find_element("css selector", 'tr[data-entry="nightly"]')
        shown = nightly.find_element("css selector", "td.schedule").text
        assert shown == "crontab minute 30 hour 3 day of month * month * day of week 1-5"
        upcoming = nightly.find_element("css selector", "td.next").text
        when = datetime.strptime(upcoming, "%Y-%m-%d %H:%M:%SZ").replace(tzinfo=UTC)
        assert (when.hour, when.minute, when.isoweekday() <= 5) == (3, 30, True)
        assert timedelta(0) < when - datetime.now(UTC) <= timedelta(days=3, minutes=1)
        off = browser.find_element("css selector", 'tr[data-entry="off"]')
        assert off.find_element("css selector", "td.schedule").text == "every seconds 90"
        assert off.find_element("css selector", "td.next").text == "disabled"
        assert "{" not in browser.find_element("id", "entries").text

        def listed() -> list[tuple[str, str]]:
            rows = browser.find_elements("css selector", "#barrier-list tbody tr[data-barrier]")
            return [
                (r.get_attribute("data-barrier"), r.find_element("css selector", "td.status").text)
                for r in rows
            ]

        browser.get(console.url + "/barriers")
        browser.find_element("link text", "expired").click()
        element(browser, "barrier-list")
        page = listed()
        assert page == [(f"b{i}", "expired") for i in range(1, 51)]  # newest first
        assert not browser.find_elements("id", "newest")
        browser.find_element("id", "older").click()
        element(browser, "newest")
        assert listed() == [("b51", "expired"), ("b52", "expired")]
        assert not browser.find_elements("id", "older")  # the last page
        browser.get(console.url + "/barriers")  # all: the armed one (newest) first
        everything = listed()
        assert everything[0] == (hostile, "armed") and len(everything) == 50
        browser.get(console.url + "/barriers?status=completed")
        assert listed() == [("b53", "completed"), ("b54", "completed"), ("b55", "completed")]
        browser.get(console.url + "/barriers?status=nonsense")
        assert "bad status" in browser.find_element("id", "error-detail").text
