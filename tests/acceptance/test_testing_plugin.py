"""pgq's pytest plugin (``pg_transport.testing``) as a user's project uses it.

examples/testing is a small project with its own conftest.py (``pytest_plugins =
["pg_transport.testing", …]``) and tests: its own app pointed at pgq for a test, a task
defined in a test on a running worker, a schema per test, and Celery's own
``celery_app``/``celery_worker`` fixtures on pgq. Its test run, in a subprocess of its
own against this server (``PGQ_TEST_URL``), must pass whole, and must leave no database
behind.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

pytestmark = pytest.mark.acceptance

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "testing"


def databases(pg_url: str) -> set[str]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'pgq\\_test\\_%'"
        ).fetchall()
    return {str(row[0]) for row in rows}


def test_a_projects_test_run_with_the_plugin_passes(pg_url: str, tmp_path: Path) -> None:
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE, project)
    before = databases(pg_url)
    # The plugin's own database name prefix (pgq_test_), not the one this run was given.
    env = {k: v for k, v in os.environ.items() if k != "PGQ_TEST_DB_PREFIX"}
    env.update(PGQ_TEST_URL=pg_url, PYTHONPATH=str(EXAMPLE.parents[1]))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(r"^4 passed", out, re.MULTILINE), out
    assert databases(pg_url) == before, "the plugin left its test database behind"
