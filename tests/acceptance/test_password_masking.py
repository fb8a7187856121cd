"""A broker URL with a password: the worker's banner and logs show it masked, never in clear."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote, unquote, urlencode

import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.acceptance.harness import APP, ROOT, Env, start_worker, wait_for

pytestmark = pytest.mark.acceptance

MARK = "tests.acceptance.app.mark"
# Under trust auth any password is accepted; '@' must be percent-encoded in a URL.
FAKE_PASSWORD = "S3cr3t-p@ss"


def url_with_password(pg_url: str) -> tuple[str, str, str]:
    """(pgq URL carrying a password, that password, the URL as it must be shown)."""
    params = {k: str(v) for k, v in conninfo_to_dict(pg_url).items() if v is not None}
    user = params.pop("user", "postgres")
    password = params.pop("password", "") or FAKE_PASSWORD
    dbname = params.pop("dbname", "")
    host = params.get("host", "")
    netloc_host = ""
    if host and not host.startswith("/") and "," not in host:
        netloc_host = f"[{host}]" if ":" in host else host
        del params["host"]
        if params.get("port", "").isdigit():
            netloc_host += f":{params.pop('port')}"
    query = f"?{urlencode(params)}" if params else ""
    tail = f"{netloc_host}/{quote(dbname, safe='')}{query}"
    url = f"pgq://{quote(user, safe='')}:{quote(password, safe='')}@{tail}"
    masked = f"pgq://{quote(user, safe='')}:**@{tail}"
    return url, password, masked


def test_url_builder_round_trips() -> None:
    url, password, masked = url_with_password("postgresql://postgres@127.0.0.1:5432/test")
    assert url == "pgq://postgres:S3cr3t-p%40ss@127.0.0.1:5432/test"
    assert password == FAKE_PASSWORD
    assert masked == "pgq://postgres:**@127.0.0.1:5432/test"


def test_worker_log_shows_the_masked_url_only(env: Env) -> None:
    url, password, masked = url_with_password(env.pg_url)
    assert unquote(url.split("@", 1)[0].rsplit(":", 1)[1]) == password

    worker = start_worker(env, "masked", environ={"PGQ_BROKER_URL": url})
    try:
        result = env.client().send_task(MARK, args=["masked"])
        wait_for(lambda: env.runs(), 30, "the task to run")
    finally:
        code = worker.stop()
    log = worker.output()

    assert [(r[0], r[1]) for r in env.runs()] == [(result.id, "masked")]
    assert code == 0, log
    assert f".> transport:   {masked}" in log, log
    assert f"Connected to {masked}" in log, log
    for secret in {password, quote(password, safe=""), quote(password)}:
        assert secret not in log, f"password {secret!r} leaked into the worker log"


def test_worker_that_cannot_connect_logs_the_masked_url_only(env: Env) -> None:
    """The retry messages of a worker whose broker is down name it without its password."""
    password = "Unreach-p@ss:" + os.urandom(4).hex()
    url = f"pgq://postgres:{quote(password, safe='')}@127.0.0.1:1/test"
    masked = "pgq://postgres:**@127.0.0.1:1/test"
    log = Path(tempfile.mkstemp(prefix="pgq-worker-unreachable-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", APP, "worker", "-P", "solo", "-l", "info",
             "--without-gossip", "--without-mingle", "--without-heartbeat"],
            cwd=ROOT, env=env.environ(PGQ_BROKER_URL=url), stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_for(lambda: "Cannot connect to" in log.read_text(errors="replace"), 60,
                 "the worker to report that it cannot connect")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    text = log.read_text(errors="replace")
    log.unlink()
    assert f"Cannot connect to {masked}" in text, text
    assert "Connection refused" in text, text
    for secret in {password, quote(password, safe=""), quote(password)}:
        assert secret not in text, f"password {secret!r} leaked into the worker log"
