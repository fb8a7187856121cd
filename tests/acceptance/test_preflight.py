"""A worker or beat with a bad pgq setting stops at once with one line naming it.

Celery builds the transport deep in the worker's start-up, so a bad option used to end
the worker with some sixty lines of traceback around the one that mattered. The app
here imports nothing of pgq: the `celery` command loads pgq through its entry point.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pg import to_broker_url

pytestmark = pytest.mark.acceptance

APP = """\
from celery import Celery

app = Celery("app", broker={url!r})
app.conf.broker_transport_options = {options!r}
"""


def run_celery(
    tmp_path: Path, url: str, args: list[str], options: dict[str, object], env_extra: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "app.py").write_text(APP.format(url=url, options=options), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("options", "env", "said"),
    [
        ({"visibility_timeout": -5}, {}, "pgq option visibility_timeout=-5 must be > 0"),
        ({}, {"PGQ_POLLING_INTERVAL": "soon"}, "PGQ_POLLING_INTERVAL"),
        ({"visibilty_timeout": 5}, {}, "unknown pgq transport option 'visibilty_timeout'"),
    ],
    ids=["option", "environment", "unknown"],
)
def test_a_worker_with_a_bad_setting_says_so_in_one_line(
    tmp_path: Path, pg_url: str, options: dict[str, object], env: dict[str, str], said: str
) -> None:
    run = run_celery(
        tmp_path, to_broker_url(pg_url), ["worker", "-P", "solo", "-l", "INFO"], options, env
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("pgq: ")]
    assert len(lines) == 1 and said in lines[0], run.stderr


def test_beat_with_a_bad_setting_says_so_in_one_line(tmp_path: Path, pg_url: str) -> None:
    run = run_celery(
        tmp_path,
        to_broker_url(pg_url),
        ["beat", "-l", "INFO", "-s", str(tmp_path / "schedule")],
        {"max_attempts": 0},
        {},
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert "pgq: pgq option max_attempts=0" in run.stderr, run.stderr
