"""Passwords never shown: a URL full of hostile passwords through every surface of real
processes, on a real Postgres.

The URL carries three secrets, each a way libpq reads one: a raw password in the user
part (every character libpq accepts there unencoded), a percent-encoded ``?password=``
(every character with a meaning in a URL, quotes, backslash, non-ASCII; libpq uses
this one, and a real role has it), and ``?sslpassword=`` equal to the role's name (a
word the URL shows elsewhere). The surfaces: a worker's banner and log, ``celery
inspect stats``/``conf``/``report`` (and the inspecting process's own output), Flower's
API and pages, every ``pgq`` command and its errors, and the metrics exporter.
"""

from __future__ import annotations

import html
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
import pytest
from celery import Celery
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pg_transport.db.url import MASK, mask_url, parse_url
from tests.acceptance.harness import APP, ROOT, Env, start_worker, wait_for
from tests.integration.test_cli import pgq_command

pytestmark = pytest.mark.acceptance

MARK = "tests.acceptance.app.mark"
RESULTS_APP = "tests.acceptance.results_app"  # pgq as broker and result backend
# Every secret below holds one of these; no output may hold any of them.
TOKENS = ("K7q", "Zx9", "Kq8", "Zx8", "Kq6", "Zx6")
# A secret shown in a query: anything but the mask after its '='.
UNMASKED_PARAMETER = re.compile(r"(?:[?&]|\b)(?:ssl)?password=(?!\*\*\*)")


@dataclass(frozen=True)
class Hostile:
    role: str  # logs in; its password is `password`
    password: str
    refused: str  # a role that may not log in, with a hostile password too
    refused_password: str
    host: str  # the server's host part and database, as in a URL
    dbname: str
    query: str  # the test server's other libpq parameters, if any

    def url(self, role: str | None = None, *, host: str | None = None) -> str:
        """The role's URL: a raw password in the user part, overridden by the one in
        ?password= (libpq takes the last), and ?sslpassword= equal to the role name."""
        role = role or self.role
        raw = "K7q#?:&='\"\\ü," + role[-8:] + "Zx9"
        used = self.password if role == self.role else self.refused_password
        return (
            f"pgq://{role}:{raw}@{host or self.host}/{self.dbname}?{self.query}"
            f"password={quote(used, safe='')}&sslpassword={quote(role, safe='')}"
        )


def leaks(text: str) -> list[str]:
    """The secrets ``text`` shows, in any form (whole, in part, encoded, escaped)."""
    found = [token for token in TOKENS if token in text]
    found += UNMASKED_PARAMETER.findall(text)
    if text != html.unescape(text):
        found += leaks(html.unescape(text))
    return found


def admin(pg_url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(pg_url, autocommit=True)


@pytest.fixture(scope="module")
def hostile(pg_url: str) -> Iterator[Hostile]:
    tag = uuid.uuid4().hex[:8]
    role, refused = f"pgq_pw_{tag}", f"pgq_pw_no_{tag}"
    password = "Kq8#?/@:%&= '\"\\ü;,*" + tag + "Zx8"
    refused_password = "Kq6#?/@:%&= '\"\\ü;,*" + tag + "Zx6"
    params = {k: str(v) for k, v in conninfo_to_dict(pg_url).items() if v is not None}
    host = params.pop("host", "127.0.0.1")
    port = params.pop("port", "5432")
    dbname = params.pop("dbname", "")
    for key in ("user", "password"):
        params.pop(key, None)
    netloc = f"[{host}]" if ":" in host else quote(host, safe="")
    with admin(pg_url) as conn:
        superuser = conn.execute("SELECT current_user").fetchone()
        assert superuser is not None
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)
            )
        )
        # The rights of the user that owns the test schemas, so its worker can use them.
        conn.execute(
            sql.SQL("GRANT {} TO {}").format(sql.Identifier(superuser[0]), sql.Identifier(role))
        )
        # `pgq demo` creates (and drops) a schema of its own.
        conn.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                sql.Identifier(dbname), sql.Identifier(role)
            )
        )
        conn.execute(
            sql.SQL("CREATE ROLE {} NOLOGIN PASSWORD {}").format(
                sql.Identifier(refused), sql.Literal(refused_password)
            )
        )
    try:
        yield Hostile(
            role,
            password,
            refused,
            refused_password,
            f"{netloc}:{port}",
            quote(dbname, safe=""),
            urlencode(params) + "&" if params else "",
        )
    finally:
        with admin(pg_url) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE usename = %s",
                [role],
            )
            for name in (role, refused):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_the_url_carries_its_secrets_where_libpq_reads_them(hostile: Hostile) -> None:
    params = parse_url(hostile.url())
    assert params["user"] == hostile.role
    assert params["password"] == hostile.password
    assert params["sslpassword"] == hostile.role
    shown = mask_url(hostile.url())
    assert not leaks(shown), shown
    assert shown.startswith(f"pgq://{hostile.role}:{MASK}@{hostile.host}/")
    assert parse_url(shown) == {**params, "password": MASK, "sslpassword": MASK}


def sessions_of(env: Env, role: str, application_name: str) -> int:
    return int(
        env.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = %s AND application_name = %s",
            role,
            application_name,
        )
    )


def celery(env: Env, url: str, *args: str, app: str = APP) -> str:
    """A `celery` command on ``url``; its whole output (stdout and stderr)."""
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, *args],
        cwd=ROOT,
        env=env.environ(PGQ_BROKER_URL=url),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def replies(output: str) -> dict[str, Any]:
    """The JSON replies `celery inspect -j` printed."""
    line = next(line for line in output.splitlines() if line.startswith("{"))
    return dict(json.loads(line))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def start_flower(env: Env, url: str, app: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Flower on ``url`` (its API open); the process and its base URL, once it answers."""
    port = free_port()
    with log.open("wb") as out:
        flower = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                app,
                "flower",
                "--address=127.0.0.1",
                f"--port={port}",
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env.environ(PGQ_BROKER_URL=url, FLOWER_UNAUTHENTICATED_API="true"),
        )
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert flower.poll() is None, log.read_text()
        try:
            return get(f"{base}/healthcheck")[0] == 200
        except OSError:
            return False

    wait_for(up, 60, "Flower to answer")
    return flower, base


@pytest.mark.sessions(20)
def test_worker_inspect_and_flower_show_the_url_masked(env: Env, hostile: Hostile) -> None:
    url, shown = hostile.url(), mask_url(hostile.url())
    worker = start_worker(env, "masked", environ={"PGQ_BROKER_URL": url})
    node = f"masked@{socket.gethostname()}"
    flower: subprocess.Popen[bytes] | None = None
    flower_log = Path(tempfile.mkstemp(prefix="pgq-flower-", suffix=".log")[1])
    try:
        # Published through Celery's producer pool: its connections are clones of the
        # app's, rebuilt from kombu's fields. They connect as the role, with its password.
        client = Celery("client", broker=url)
        client.conf.update(broker_transport_options={"schema": env.schema})
        result = client.send_task(MARK, args=["masked"])
        wait_for(lambda: env.runs(), 30, "the task to run")
        assert [(r[0], r[1]) for r in env.runs()] == [(result.id, "masked")]
        assert sessions_of(env, hostile.role, f"pgq:{os.getpid()}") > 0
        with client.connection_for_write() as conn:
            clone = conn.clone()
            assert clone.as_uri() == shown
            assert parse_url(clone.as_uri(include_password=True))["password"] == hostile.password
            clone.close()

        stats = celery(env, url, "inspect", "stats", "-d", node, "-j", "-t", "10")
        conf = celery(env, url, "inspect", "conf", "-d", node, "-j", "-t", "10")
        report = celery(env, url, "inspect", "report", "-d", node, "-j", "-t", "10")
        for output in (stats, conf, report):
            assert not leaks(output), output
        broker = replies(stats)[node]["broker"]
        assert broker["hostname"] == shown
        assert "password" not in broker
        assert broker["alternates"] == []
        assert replies(conf)[node]["broker_url"] == shown
        assert "broker_url: " in replies(report)[node]["ok"]

        # Flower shows the stats' broker and the conf on a worker's page and in its API,
        # and its own Connection.as_uri() in its log (its broker page has no pgq view).
        flower, base = start_flower(env, url, APP, flower_log)
        status, api = get(f"{base}/api/workers?refresh=1&workername={quote(node)}")
        assert status == 200, api
        assert not leaks(api), api
        assert json.loads(api)[node]["stats"]["broker"]["hostname"] == shown
        assert json.loads(api)[node]["conf"]["broker_url"] == shown
        pages = {
            path: get(base + path)
            for path in ("/workers", f"/worker/{quote(node)}", "/broker", "/tasks")
        }
        for path, (_status, page) in pages.items():
            assert not leaks(page), (path, page)
        assert shown in html.unescape(pages[f"/worker/{quote(node)}"][1])
        # Flower's broker page has no pgq view: migrating.md quotes what it says instead.
        said = re.search(r"'\w+' broker is not supported", html.unescape(pages["/broker"][1]))
        assert said, pages["/broker"]
        migrating = (ROOT / "docs" / "migrating.md").read_text(encoding="utf-8")
        assert f"*{said.group(0)}*" in migrating, said.group(0)
    finally:
        if flower is not None:
            os.killpg(flower.pid, signal.SIGTERM)
            flower.wait(30)
        code = worker.stop()
    log, flower_text = worker.output(), flower_log.read_text(errors="replace")
    flower_log.unlink()
    assert code == 0, log
    assert f".> transport:   {shown}" in log, log
    assert f"Connected to {shown}" in log, log
    assert not leaks(log), log
    assert f"Broker: {shown}" in flower_text, flower_text
    assert not leaks(flower_text), flower_text


def masked_alike(shown: str, url: str) -> bool:
    """Whether ``shown`` is ``url`` with every secret masked (by pgq's mask, or by
    Celery's over pgq's)."""
    params, original = parse_url(shown), parse_url(url)
    secrets = ("password", "sslpassword")
    return {k: v for k, v in params.items() if k not in secrets} == {
        k: v for k, v in original.items() if k not in secrets
    } and all(set(params[key]) == {"*"} for key in secrets)


@pytest.mark.sessions(21)
def test_result_backend_url_is_masked_in_conf_report_and_flower(env: Env, hostile: Hostile) -> None:
    """The hostile URL as result backend too: Celery shows ``result_backend`` through a
    pattern of its own, which a raw '#' or '?' in the password, or ?password=, gets by."""
    url, shown = hostile.url(), mask_url(hostile.url())
    worker = start_worker(env, "results", app=RESULTS_APP, environ={"PGQ_BROKER_URL": url})
    node = f"results@{socket.gethostname()}"
    flower: subprocess.Popen[bytes] | None = None
    flower_log = Path(tempfile.mkstemp(prefix="pgq-flower-", suffix=".log")[1])
    try:
        # The backend connects with the password: a result stored by the worker, read here.
        client = Celery("client", broker=url, backend=url, set_as_current=False)
        client.conf.update(broker_transport_options={"schema": env.schema})
        assert client.send_task(RESULTS_APP + ".add", args=[2, 3]).get(timeout=30) == 5
        assert client.backend.as_uri() == shown
        assert str(client.conf.result_backend) == shown
        assert not leaks(client.bugreport())

        conf = celery(env, url, "inspect", "conf", "-d", node, "-j", "-t", "10", app=RESULTS_APP)
        report = celery(
            env, url, "inspect", "report", "-d", node, "-j", "-t", "10", app=RESULTS_APP
        )
        local_report = celery(env, url, "report", app=RESULTS_APP)
        for output in (conf, report, local_report):
            assert not leaks(output), output
        assert masked_alike(replies(conf)[node]["result_backend"], url)
        said = re.search(r"results:(\S+)", replies(report)[node]["ok"])
        assert said and masked_alike(said.group(1), url), report
        said = re.search(r"results:(\S+)", local_report)
        assert said and masked_alike(said.group(1), url), local_report

        # Flower's Config tab (a worker's page) and its API show the worker's conf.
        flower, base = start_flower(env, url, RESULTS_APP, flower_log)
        status, api = get(f"{base}/api/workers?refresh=1&workername={quote(node)}")
        assert status == 200, api
        assert not leaks(api), api
        assert masked_alike(json.loads(api)[node]["conf"]["result_backend"], url)
        status, page = get(f"{base}/worker/{quote(node)}")
        assert status == 200 and "result_backend" in page, page
        assert not leaks(page), page
    finally:
        if flower is not None:
            os.killpg(flower.pid, signal.SIGTERM)
            flower.wait(30)
        code = worker.stop()
    log, flower_text = worker.output(), flower_log.read_text(errors="replace")
    flower_log.unlink()
    assert code == 0, log
    assert f".> results:     {shown}" in log, log
    assert not leaks(log), log
    assert not leaks(flower_text), flower_text


def pgq(*args: str, url: str, env: Env) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    environ.update(PGQ_URL=url, PGQ_SCHEMA=env.schema)
    return subprocess.run(
        [*pgq_command(), *args], capture_output=True, text=True, env=environ, timeout=120, cwd="/"
    )


def test_every_pgq_command_and_error_shows_the_url_masked(env: Env, hostile: Hostile) -> None:
    url, shown = hostile.url(), mask_url(hostile.url())
    # A queue to purge (purging one that does not exist is an error of its own).
    assert env.scalar("INSERT INTO {schema}.queue (name) VALUES ('celery') RETURNING name")
    commands = (
        ("demo",),  # the longest (it starts a worker): first, so the others fill around it
        ("migrate",),
        ("status",),
        ("status", "--json"),
        ("purge", "celery"),
        ("dead", "list"),
        ("dead", "list", "--json"),
        ("dead", "requeue", "--all"),
        ("dead", "purge", "--yes"),
        ("dead", "rehook", "1"),
        ("barrier", "show", "x"),
        ("metrics",),
    )
    # Errors: a server that does not answer, a role it refuses, URLs it cannot take.
    unreachable = hostile.url(host="127.0.0.1:1")
    refused = hostile.url(hostile.refused)
    bad = {
        "unreachable": ("status", unreachable),
        "refused": ("status", refused),
        "raw slash": ("migrate", url.replace("K7q#", "K7q/")),
        "raw at": ("migrate", url.replace("K7q#", "K7q@")),
        "bad port": ("migrate", hostile.url(host="127.0.0.1:notaport")),
        "bad escape": ("migrate", url.replace("K7q#", "K7q%zz")),
        "no host": ("migrate", f"pgq://{hostile.role}:Kq8Zx8"),
        "bad scheme": ("migrate", url.replace("pgq://", "postgres://")),
    }
    # Independent processes, the commands and the errors alike: side by side, a few at
    # a time (one pool: no wait for the slowest command before the errors start).
    with ThreadPoolExecutor(4) as pool:
        running = {" ".join(args): pool.submit(pgq, *args, url=url, env=env) for args in commands}
        failing = {
            what: pool.submit(pgq, command, url=bad_url, env=env)
            for what, (command, bad_url) in bad.items()
        }
    runs = {command: future.result() for command, future in running.items()}
    errors = {what: future.result() for what, future in failing.items()}
    for command, result in runs.items():
        assert not leaks(result.stdout + result.stderr), (command, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr, (command, result.stderr)
    for command in (
        "migrate",
        "status",
        "purge celery",
        "dead list",
        "dead list --json",
        "dead requeue --all",
        "dead purge --yes",
        "metrics",
        "demo",
    ):
        assert runs[command].returncode == 0, (command, runs[command].stderr)
    assert f"pgq schema {env.schema!r} at {shown} is up to date" in runs["migrate"].stdout
    assert runs["status"].stdout.startswith(f"pgq schema {env.schema!r} at {shown}\n")
    assert f"({shown})" in runs["demo"].stdout
    assert runs["dead rehook 1"].returncode == 1
    assert runs["barrier show x"].returncode == 1

    for what, result in errors.items():
        assert result.returncode == 1, (what, result.stdout, result.stderr)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), (what, result.stderr)
        assert not leaks(result.stdout + result.stderr), (what, result.stderr)
    assert errors["unreachable"].stderr.startswith(
        f"Error: cannot connect to Postgres at {mask_url(unreachable)}: "
    )
    assert errors["refused"].stderr.startswith(
        f"Error: cannot connect to Postgres at {mask_url(refused)}: "
    )
    assert "is not permitted to log in" in errors["refused"].stderr
    assert "malformed broker URL" in errors["raw slash"].stderr


def test_metrics_exporter_shows_the_url_masked_when_scrapes_fail(
    env: Env, hostile: Hostile
) -> None:
    url, shown = hostile.url(), mask_url(hostile.url())
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    environ.update(PGQ_URL=url, PGQ_SCHEMA=env.schema)
    proc = subprocess.Popen(
        [*pgq_command(), "metrics", "--serve", "0"],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert banner.startswith(f"serving metrics of pgq schema {env.schema!r} at {shown} on "), (
            banner
        )
        endpoint = banner.rsplit(" ", 1)[1].strip()
        status, body = get(endpoint)
        assert status == 200 and "pgq_" in body, body
        assert not leaks(body), body
        # The role may not log in any more, and its sessions are gone: the next scrape
        # has to connect, and is refused.
        with admin(env.pg_url) as conn:
            conn.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(hostile.role)))
            conn.execute(
                "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE usename = %s",
                [hostile.role],
            )
        status, body = get(endpoint)
        assert status == 503, body
        assert not leaks(body), body
        if " at pgq://" in body:
            assert f" at {shown}:" in body, body
    finally:
        with admin(env.pg_url) as conn:
            conn.execute(sql.SQL("ALTER ROLE {} LOGIN").format(sql.Identifier(hostile.role)))
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert not leaks(out + err), out + err


def test_worker_that_cannot_connect_logs_the_masked_url_only(env: Env, hostile: Hostile) -> None:
    """The retry messages of a worker whose broker is down name it without its password."""
    url = hostile.url(host="127.0.0.1:1")
    log = Path(tempfile.mkstemp(prefix="pgq-worker-unreachable-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                APP,
                "worker",
                "-P",
                "solo",
                "-l",
                "info",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=ROOT,
            env=env.environ(PGQ_BROKER_URL=url),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(
            lambda: "Cannot connect to" in log.read_text(errors="replace"),
            60,
            "the worker to report that it cannot connect",
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    text = log.read_text(errors="replace")
    log.unlink()
    assert f"Cannot connect to {mask_url(url)}" in text, text
    assert "Connection refused" in text, text
    assert not leaks(text), text
