"""`pgq web` as a subprocess, and a headless Chromium (Debian's, with its chromedriver)
driven by Selenium, for the console's browser tests."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.acceptance.harness import ROOT, Env, wait_for

CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@dataclass
class Console:
    proc: subprocess.Popen[bytes]
    log: Path
    url: str

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def console(
    env: Env,
    *,
    url: str | None = None,
    token: str | None = None,
    interval: float = 1.0,
    app: str | None = None,
) -> Iterator[Console]:
    """``pgq web`` on a free port of 127.0.0.1, until the block ends."""
    log = Path(tempfile.mkstemp(prefix="pgq-web-", suffix=".log")[1])
    environ = env.environ()
    environ.pop("PGQ_WEB_TOKEN", None)
    if token is not None:
        environ["PGQ_WEB_TOKEN"] = token
    cmd = [
        sys.executable,
        "-m",
        "pg_transport.ops.cli",
        "web",
        "--url",
        url or env.broker_url,
        "--schema",
        env.schema,
        "--port",
        "0",
        "--interval",
        str(interval),
        *(["--app", app] if app else []),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def started() -> str | None:
            if proc.poll() is not None:
                raise AssertionError(f"pgq web exited:\n{log.read_text()}")
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/", log.read_text())
            return found.group(1) if found else None

        yield Console(proc, log, wait_for(started, 30, "pgq web to listen"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def browser() -> Any:
    """A headless Chromium; the caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def available() -> bool:
    return os.access(CHROMEDRIVER, os.X_OK) and os.access(CHROMIUM, os.X_OK)
