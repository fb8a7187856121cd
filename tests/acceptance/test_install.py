"""A newcomer's first steps, word for word: the built wheel in a fresh virtualenv.

README's install line (the one for a checkout) is run as written, only the checkout it
installs pointed at the wheel built from this tree (the venv is made in an empty directory),
then docs/migrating.md's steps: an app whose broker is ``pgq://``, ``pgq migrate``,
``celery -A app worker``, a task sent and run, ``pgq status``. Nothing from this checkout
is importable there: the venv has no access to the test's site-packages or this tree.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.harness import Env, Worker, wait_for, wake
from tests.pg import to_broker_url
from tests.unit.test_packaging import project

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "pip install '.[embedded]'"

APP = """\
from celery import Celery

app = Celery("app", broker={url!r})


@app.task
def add(x, y):
    return x + y
"""


def readme_install_line() -> str:
    """The one shell line of README's Install section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block, "README's Install section has no sh block"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def clean_env(home: Path) -> dict[str, str]:
    """The environment of a new shell: nothing of this test's venv, tree or PGQ_ settings."""
    keep = ("PATH", "LANG", "LC_ALL", "TMPDIR", "PIP_FIND_LINKS", "PIP_INDEX_URL")
    env = {k: v for k, v in os.environ.items() if k in keep}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    env.update(HOME=os.environ.get("HOME", str(home)), PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # The build backend the dev extra installs builds it here: the same wheel as in an
    # isolated build environment, without fetching and installing the backend into a new
    # one first (seconds of a run's start). A venv from before that extra isolates.
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            *isolation,
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=180,
    )
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def newcomer(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, subprocess.CompletedProcess[str]]]:
    """README's install line run in an empty directory; its output, and that directory."""
    home = tmp_path_factory.mktemp("newcomer")
    line = readme_install_line()
    assert INSTALL in line, line
    pinned = line.replace(INSTALL, f"pip install 'celery-pgq[embedded] @ {wheel.as_uri()}'")
    env = clean_env(home)
    result = subprocess.run(
        ["bash", "-c", pinned],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    yield home, result


def test_the_distribution_is_named_as_the_docs_say() -> None:
    assert project()["name"] == "celery-pgq"
    migrating = (ROOT / "docs" / "migrating.md").read_text(encoding="utf-8")
    assert "`pip install celery-pgq`" in migrating


def test_readme_install_line_installs_the_wheel_and_the_demo_passes(
    newcomer: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    home, result = newcomer
    out = f"exit status {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, out
    assert re.search(r"demo OK: 6 tasks, each ran exactly once", result.stdout), out
    venv = home / ".venv"
    version = subprocess.run(
        [str(venv / "bin" / "pgq"), "--version"], capture_output=True, text=True, check=False
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("pgq, version "), version.stdout
    alias = subprocess.run(
        [str(venv / "bin" / "celery-pgq"), "--version"], capture_output=True, text=True, check=False
    )
    assert alias.returncode == 0 and alias.stdout == version.stdout, alias
    # What is installed is the wheel, not this checkout.
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import pg_transport; print(pg_transport.__file__)"],
        cwd=home,
        capture_output=True,
        text=True,
        check=True,
    )
    assert str(venv) in where.stdout and str(ROOT) not in where.stdout, where.stdout


def test_migrating_steps_run_a_celery_worker_on_pgq(
    newcomer: tuple[Path, subprocess.CompletedProcess[str]], pg_url: str, schema: str
) -> None:
    home, installed = newcomer
    assert installed.returncode == 0, f"exit status {installed.returncode}"
    venv_bin = home / ".venv" / "bin"
    url = to_broker_url(pg_url)
    (home / "app.py").write_text(APP.format(url=url), encoding="utf-8")
    env = clean_env(home)
    env.update(PATH=f"{venv_bin}{os.pathsep}{env['PATH']}", PGQ_SCHEMA=schema)

    migrate = subprocess.run(
        ["pgq", "migrate", "--url", url], cwd=home, env=env, capture_output=True, text=True
    )
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr

    log = home / "worker.log"
    with log.open("wb") as sink:
        worker = subprocess.Popen(
            ["celery", "-A", "app", "worker", "--concurrency", "1", "--loglevel", "INFO"],
            cwd=home,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        sent = subprocess.run(
            [str(venv_bin / "python"), "-c", "from app import add; print(add.delay(20, 22).id)"],
            cwd=home,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr
        task_id = sent.stdout.strip()
        done = re.compile(rf"Task app\.add\[{re.escape(task_id)}\] succeeded in [\d.e-]+s: 42")
        wait_for(lambda: done.search(log.read_text(errors="replace")), 60, "the task's success")
        status = subprocess.run(
            ["pgq", "status", "--url", url], cwd=home, env=env, capture_output=True, text=True
        )
        assert status.returncode == 0, status.stderr
        assert "celery" in status.stdout, status.stdout
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            # An idle worker sees the warm shutdown at its next poll, or at once when
            # woken (a notification on its queues).
            wake([Worker(worker, log, "installed", Env(pg_url, schema))])
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)
    text = log.read_text(errors="replace")
    assert "No such transport" not in text
    assert "Traceback" not in text, text


def test_the_scheme_is_found_where_pth_files_are_not_processed(
    newcomer: tuple[Path, subprocess.CompletedProcess[str]], pg_url: str, schema: str
) -> None:
    """`pip install --target` + PYTHONPATH, zipapps, `python -S`: no .pth hook runs. The
    `celery` command still finds pgq:// (its `celery.commands` entry point imports pgq),
    and `celery pgq …` is pgq's command; a pgq result backend is found by Celery's
    `celery.result_backends` entry point."""
    home, installed = newcomer
    assert installed.returncode == 0, f"exit status {installed.returncode}"
    python = home / ".venv" / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    url = to_broker_url(pg_url)
    env = clean_env(home)
    env.update(PYTHONPATH=site, PGQ_SCHEMA=schema)

    def run(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(python), "-S", "-c", code], cwd=home, env=env, capture_output=True, text=True
        )

    # Without the hook nothing registered the scheme: the case being tested.
    bare = run(f"import kombu; kombu.Connection({url!r}).transport")
    assert "No such transport: pgq" in bare.stderr, bare.stderr
    worker_side = run(
        "import celery.bin.celery, kombu\n"
        f"c = kombu.Connection({url!r}); c.connect(); print(type(c.transport).__module__)"
    )
    assert worker_side.returncode == 0, worker_side.stderr
    assert worker_side.stdout.strip() == "pg_transport.kombu.transport", worker_side.stdout
    command = run(
        "import sys; from celery.bin.celery import main\n"
        f"sys.argv = ['celery', 'pgq', 'status', '--url', {url!r}]\nmain()"
    )
    assert command.returncode == 0, command.stderr
    backend = run(
        "from celery import Celery\n"
        f"app = Celery('x', backend={url!r})\nprint(type(app.backend).__name__)"
    )
    assert backend.returncode == 0, backend.stderr
    assert backend.stdout.strip() == "PgqBackend", backend.stdout
