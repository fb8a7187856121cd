"""Screenshots of `pgq web` for docs/console.md: ``python -m tests.acceptance.console_screenshots``.

Builds a throwaway schema with real traffic (tasks published through Celery, a worker
draining one queue, delayed tasks, a poisoned task dead-lettered by a real worker, a
barrier, schedule entries), runs the console against it for a minute so the charts have
a history, and saves one PNG per page into docs/img/. Needs Postgres on 127.0.0.1 (or
PGQ_TEST_URL) and Debian's chromium and chromium-driver.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import psycopg
from psycopg import sql

from tests.acceptance import console as web
from tests.acceptance.harness import ROOT, Env, prepare, start_worker, wait_for
from tests.pg import drop_schema, find_postgres, new_schema_name

IMG = ROOT / "docs" / "img"
TOKEN = "screenshot-token-0123456789"
POISON_TASK = "tests.acceptance.poison_app.run_pipeline"


def execute(env: Env, query: str, *params: Any) -> None:
    with psycopg.connect(env.pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL(query).format(schema=sql.Identifier(env.schema)), params)


def poison(env: Env) -> None:
    """A task that kills its worker, dead-lettered by a real worker with its hooks run."""
    execute(
        env,
        "CREATE TABLE {schema}.poison_log (sender text, queue text, task_id text,"
        " identity jsonb, attempts int, dead_letter_id bigint)",
    )
    environ = {"PGQ_MAX_ATTEMPTS_CELERY": "1", "PGQ_VISIBILITY_TIMEOUT": "1"}
    env.client().send_task(POISON_TASK, args=[42], kwargs={"execution_id": "exec-2031"})
    for name in ("p1", "p2"):
        worker = start_worker(
            env,
            name,
            pool="solo",
            concurrency=1,
            app="tests.acceptance.poison_app",
            environ=environ,
            may_exit=True,
        )
        if name == "p2":
            wait_for(lambda: env.scalar("SELECT count(*) FROM {schema}.poison_log"), 30, "hook")
        worker.stop()


def barrier(env: Env) -> None:
    callback = json.dumps({"task": "app.tasks.aggregate", "options": {"task_id": "cb-77"}})
    execute(
        env,
        "INSERT INTO {schema}.barrier (id, total, remaining, callback, expires_at,"
        " stuck_timeout) VALUES ('exec-2031', 4, 1, %s, now() + interval '1 hour',"
        " interval '10 minutes')",
        callback,
    )
    execute(
        env,
        "INSERT INTO {schema}.barrier_part (barrier_id, idx, task_id, outcome)"
        " SELECT 'exec-2031', i, 'part-' || i, 'succeeded' FROM generate_series(0, 2) AS i",
    )


def schedules(env: Env) -> None:
    for name, args in (
        ("nightly-report", ["--crontab", "0 3 * * *"]),
        ("heartbeat", ["--every", "30"]),
    ):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pg_transport.ops.cli",
                "schedule",
                "add",
                name,
                "--task",
                "tests.acceptance.app.mark",
                *args,
                "--url",
                env.broker_url,
                "--schema",
                env.schema,
            ],
            check=True,
            cwd=ROOT,
            env=env.environ(),
            stdout=subprocess.DEVNULL,
        )


def shoot(browser: Any, url: str, name: str) -> None:
    browser.get(url)
    save(browser, name)


def save(browser: Any, name: str) -> None:
    """The whole page, however tall, as docs/img/console-NAME.png."""
    import base64

    shot = browser.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}
    )
    (IMG / f"console-{name}.png").write_bytes(base64.b64decode(shot["data"]))
    print(f"docs/img/console-{name}.png")


def main() -> None:
    IMG.mkdir(exist_ok=True)
    env = prepare(find_postgres(), new_schema_name())
    try:
        client = env.client()
        poison(env)
        barrier(env)
        schedules(env)
        with web.console(env, token=TOKEN, interval=2) as console:
            browser = web.browser()
            try:
                for round_ in range(3):  # bursts the worker drains: a history to draw
                    for i in range(150):
                        client.send_task(
                            "tests.acceptance.app.mark", kwargs={"label": str(i)}, queue="emails"
                        )
                    for i in range(40):
                        client.send_task(
                            "tests.acceptance.app.mark",
                            kwargs={"label": f"r{round_}-{i}"},
                            queue="reports",
                            countdown=3600 * (i + 1),
                        )
                    time.sleep(8)
                    worker = start_worker(env, f"w{round_}", queues="emails")
                    time.sleep(6)
                    worker.stop()
                for i in range(25):
                    client.send_task(
                        "tests.acceptance.app.mark", kwargs={"label": f"b{i}"}, queue="billing"
                    )
                for i in range(5):
                    client.send_task(
                        "tests.acceptance.app.mark",
                        kwargs={"label": f"invoice-{i}"},
                        queue="billing",
                        countdown=600 * (i + 1),
                    )
                worker = start_worker(env, "idle", queues="nothing")  # a connected process
                try:
                    time.sleep(5)
                    base = console.url
                    shoot(browser, base + "/queues?window=300", "queues")
                    shoot(browser, base + "/queue?name=billing&window=300", "queue")
                    browser.get(base + "/login")
                    browser.find_element("id", "name").send_keys("alice")
                    browser.find_element("id", "token").send_keys(TOKEN)
                    browser.find_element("id", "submit").click()
                    web_element(browser, "user")
                    shoot(browser, base + "/dead", "dead")
                    dead_id = env.scalar("SELECT min(id) FROM {schema}.dead_letter")
                    shoot(browser, f"{base}/dead/{dead_id}", "dead-letter")
                    browser.find_element("id", "purge").click()
                    web_element(browser, "confirm-purge")
                    save(browser, "purge")
                    shoot(browser, base + "/barriers?id=exec-2031", "barriers")
                    shoot(browser, base + "/schedules", "schedules")
                    shoot(browser, base + "/processes", "processes")
                finally:
                    worker.stop()
            finally:
                browser.quit()
    finally:
        drop_schema(env.pg_url, env.schema)


def web_element(browser: Any, ident: str) -> Any:
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, 15).until(
        expected_conditions.presence_of_element_located(("id", ident))
    )


if __name__ == "__main__":
    main()
