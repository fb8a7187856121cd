"""Every service of docker/docker-compose.yaml, run for real without Docker.

Each service's `command:` and `environment:` become a local subprocess: the same argv
(with `celery` and `pgq` resolved to this checkout's, psql as installed), the same
variables and files (bind mounts), each URL pointed at a database of the test's own on
the test Postgres, with throwaway names for the compose file's roles, and a short
health threshold.

The postgres image's init script creates the roles in that database; the migrate
service must exit 0 as the owner, the grants service too; each worker, connected as the
worker role, must become ready, run a task the example app routes to its queue (sent
as the publisher role), with its queue's visibility timeout; its healthcheck must pass
while it consumes, stay green while it idles past the threshold, and fail once the
worker is stopped (SIGSTOP) or killed (SIGKILL) for longer than that. The metrics
service, connected as the monitor role, serves every queue's figures and may not read
a payload.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from celery import Celery
from kombu import Queue
from psycopg.conninfo import conninfo_to_dict

from pg_transport.db.pool import url_to_conninfo
from pg_transport.ops import health
from tests.acceptance.harness import Env, Worker, wait_for
from tests.integration.test_cli import pgq_command
from tests.integration.test_metrics import by_queue, parse_exposition
from tests.integration.test_privileges import throwaway_database
from tests.unit.test_compose import (
    COMPOSE,
    EXAMPLES,
    PASSWORD_OF,
    SECRETS,
    command_of,
    environment_of,
    load_compose,
    worker_queues,
    workers,
)

pytestmark = pytest.mark.acceptance

# Short enough to keep the test quick, several idle consume-loop cycles (~2 s) long.
STALE = 5.0
# One task per worker queue, as the example app routes it.
TASKS = {
    "default": ("fleet.add", [2, 3]),
    "orchestrator": ("fleet.orchestrate", ["job-1", 3.0]),
    "callback": ("fleet.callback", ["job-0", {"status": "done"}]),
    "scheduler": ("fleet.tick", []),
}


@dataclass(frozen=True)
class Local:
    """Where the compose file's services run here: a database of the test's own (a
    superuser's URL to it), with throwaway names for the compose file's roles, and a
    directory holding the files the services mount."""

    db_url: str
    tag: str
    mounts: Path

    def role(self, name: str) -> str:
        assert name in PASSWORD_OF, name
        return f"pgq_t_{name.removeprefix('pgq_')}_{self.tag}"

    def substitute(self, text: str) -> str:
        replaced = re.sub(
            r"\b(pgq_owner|pgq_worker|pgq_publisher|pgq_monitor)\b",
            lambda m: self.role(m.group(1)),
            text,
        )
        assert not re.search(r"\bpgq_(owner|worker|publisher|monitor)\b", replaced)
        return replaced

    @property
    def server(self) -> dict[str, str]:
        params = conninfo_to_dict(self.db_url)
        return {
            "host": str(params.get("host") or "127.0.0.1"),
            "port": str(params.get("port") or 5432),
            "dbname": str(params["dbname"]),
            "user": str(params.get("user") or "postgres"),
        }

    def url(self, compose_url: str) -> str:
        """A compose service's pgq:// URL, pointed here: the test server and database,
        the role's throwaway name, its password as given."""
        params = conninfo_to_dict(url_to_conninfo(compose_url))
        server = self.server
        return (
            f"pgq://{self.role(str(params['user']))}:{quote(str(params['password']))}"
            f"@{server['host']}:{server['port']}/{server['dbname']}"
        )

    def libpq(self, role: str) -> str:
        server = self.server
        return (
            f"postgresql://{self.role(role)}@{server['host']}:{server['port']}/{server['dbname']}"
        )

    def mount(self, service: dict[str, Any]) -> dict[str, str]:
        """The service's bind mounts: container path -> a copy here, role names replaced."""
        found = {}
        for volume in service.get("volumes") or []:
            source, target, *_ = str(volume).split(":")
            if not source.startswith("."):
                continue  # a named volume: Postgres' data
            origin = (COMPOSE.parent / source).resolve()
            copy = self.mounts / origin.name
            if origin.is_dir():
                shutil.copytree(origin, copy, dirs_exist_ok=True)
                files = [f for f in copy.iterdir() if f.is_file()]
            else:
                shutil.copy2(origin, copy)
                files = [copy]
            for file in files:
                file.write_text(self.substitute(file.read_text(encoding="utf-8")), encoding="utf-8")
            found[target] = str(copy)
        return found


def argv(command: list[str], mounts: dict[str, str] | None = None) -> list[str]:
    """The compose command, run with this checkout's interpreter and console script (or
    the installed psql), its container paths replaced by the files mounted there."""
    for target, copy in (mounts or {}).items():
        command = [
            copy + word[len(target) :] if word.startswith(target) else word for word in command
        ]
    if command[0] == "celery":
        return [sys.executable, "-m", "celery", *command[1:]]
    if command[0] == "pgq":
        return [*pgq_command(), *command[1:]]
    if command[0] == "psql":
        return command
    raise AssertionError(f"unexpected program in a compose command: {command}")


def service_env(
    local: Local, service: dict[str, Any], heartbeat: Path | None = None
) -> dict[str, str]:
    """The service's environment as compose gives it (its passwords set on the host),
    pointed here."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PGQ_", "PG"))}
    compose = environment_of(service, SECRETS)
    environ.update(compose, PYTHONUNBUFFERED="1")
    if "PGQ_URL" in compose:
        environ["PGQ_URL"] = local.url(compose["PGQ_URL"])
    if "PGUSER" in compose:  # psql, as libpq's variables say
        server = local.server
        environ.update(
            PGHOST=server["host"],
            PGPORT=server["port"],
            PGDATABASE=server["dbname"],
            PGUSER=local.role(compose["PGUSER"]),
        )
    if heartbeat is not None:
        environ.update({health.FILE_ENV: str(heartbeat), health.STALE_ENV: str(STALE)})
    return environ


def run_service(local: Local, service: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """A one-shot service, to its end."""
    return subprocess.run(
        argv(command_of(service), local.mount(service)),
        env=service_env(local, service),
        capture_output=True,
        text=True,
        timeout=60,
    )


def init_postgres(local: Local, postgres: dict[str, Any]) -> None:
    """What the postgres image does with a new data volume: run every script mounted at
    /docker-entrypoint-initdb.d as its superuser, with the service's environment, on
    the database it created (POSTGRES_DB: here, the test's)."""
    server = local.server
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    environ.update(
        environment_of(postgres, SECRETS),
        POSTGRES_USER=server["user"],
        POSTGRES_DB=server["dbname"],
        PGHOST=server["host"],
        PGPORT=server["port"],
    )
    initdb = Path(local.mount(postgres)["/docker-entrypoint-initdb.d"])
    for script in sorted(initdb.iterdir()):
        assert script.suffix == ".sh", script
        done = subprocess.run(
            ["sh", str(script)], env=environ, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr


def start(name: str, command: list[str], environ: dict[str, str]) -> Worker:
    log = Path(tempfile.mkstemp(prefix=f"pgq-compose-{name}-", suffix=".log")[1])
    with log.open("wb") as out:
        # The image's working directory holds fleet.py, as examples/ does here.
        proc = subprocess.Popen(
            argv(command),
            cwd=EXAMPLES,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Worker(proc, log, name)


def start_healthchecks(
    checks: dict[str, tuple[dict[str, Any], dict[str, str]]],
) -> dict[str, subprocess.Popen[str]]:
    """Start services' compose healthchecks (service, environment) at once; name -> process."""
    procs = {}
    for name, (service, environ) in checks.items():
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD"
        procs[name] = subprocess.Popen(
            argv(test[1:]),
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    return procs


def outcomes(
    procs: dict[str, subprocess.Popen[str]],
) -> dict[str, subprocess.CompletedProcess[str]]:
    """What started healthchecks said, once each has exited; name -> result."""
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.fixture
def local(pg_url: str, tmp_path: Path) -> Iterator[Local]:
    """A database of the test's own, as the compose file's is when Postgres first
    starts: no role of pgq's yet (creating them is the init script's job), and no
    schema (the migrate service's). Its roles are dropped with it."""
    mounts = tmp_path / "mounts"
    mounts.mkdir()
    with throwaway_database(pg_url) as db_url:
        made = Local(db_url, uuid.uuid4().hex[:8], mounts)
        yield made
    with psycopg.connect(pg_url, autocommit=True) as admin:
        for name in PASSWORD_OF:
            role = psycopg.sql.Identifier(made.role(name))
            admin.execute(psycopg.sql.SQL("DROP ROLE IF EXISTS {}").format(role))


@pytest.fixture
def env(local: Local) -> Env:
    """The compose file's database and schema, here (the superuser's view)."""
    return Env(local.db_url, "pgq")


@pytest.fixture
def fleet_client(local: Local, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A web front end publishing to the fleet as the publisher role, configured as
    docs/least-privilege.md says: the example app's routing, and queues it finds
    declared (by the workers) instead of declaring them."""
    for name in list(os.environ):
        if name.startswith("PGQ_"):
            monkeypatch.delenv(name)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import fleet

    compose_url = environment_of(load_compose()["services"]["migrate"], SECRETS)["PGQ_URL"]
    url = local.url(
        compose_url.replace("pgq_owner:", "pgq_publisher:", 1).replace(
            SECRETS["OWNER_PASSWORD"], SECRETS["PUBLISHER_PASSWORD"]
        )
    )
    queues = {q for svc in workers(load_compose()).values() for q in worker_queues(svc)}
    app = Celery("web", broker=url)
    app.conf.update(
        broker_transport_options={"auto_migrate": False},
        task_routes=fleet.app.conf.task_routes,
        task_default_queue=fleet.app.conf.task_default_queue,
        task_queues=[Queue(q, no_declare=True) for q in sorted(queues)],
        task_create_missing_queues=False,
    )
    return app


@pytest.fixture
def running() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    # All at once: a warm shutdown waits out a consume-loop cycle (~2 s) per worker.
    for worker in started:
        if worker.proc.poll() is None:
            os.killpg(worker.proc.pid, signal.SIGCONT)  # a stopped process ignores SIGTERM
            os.killpg(worker.proc.pid, signal.SIGTERM)
    for worker in started:
        worker.stop(timeout=15)


def sessions_by_role(env: Env) -> dict[str, set[str]]:
    """The roles connected to the compose database, with their application names."""
    with psycopg.connect(env.pg_url) as admin:
        rows = admin.execute(
            "SELECT usename, application_name FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    found: dict[str, set[str]] = {}
    for role, application in rows:
        found.setdefault(role, set()).add(application)
    return found


@pytest.mark.sessions(23)  # 20 seen on its own database, -n 0
def test_the_fleet_runs_scales_and_reports_stuck_workers(
    local: Local, env: Env, fleet_client: Any, running: list[Worker], tmp_path: Path
) -> None:
    services = load_compose()["services"]

    # -- postgres: a new data volume runs the init script, which creates the roles --
    init_postgres(local, services["postgres"])
    with psycopg.connect(env.pg_url) as admin:
        created = dict(
            admin.execute(
                "SELECT rolname, rolpassword FROM pg_authid WHERE rolname = ANY(%s)",
                [[local.role(name) for name in PASSWORD_OF]],
            ).fetchall()
        )
    # Each with the password compose gave the postgres service (stored as a verifier).
    assert sorted(created) == sorted(local.role(name) for name in PASSWORD_OF)
    assert all(str(verifier).startswith("SCRAM-SHA-256$") for verifier in created.values())

    # -- migrate, then grants: one-shots that succeed, as the owner --
    done = run_service(local, services["migrate"])
    assert done.returncode == 0, done.stderr
    assert "now at version" in done.stdout
    assert env.scalar(
        "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pgq'"
    ) == local.role("pgq_owner")
    for _ in range(2):  # `docker compose up` runs it again every time: nothing changes
        done = run_service(local, services["grants"])
        assert done.returncode == 0, done.stderr

    # -- every worker service, all at once, as `docker compose up` starts them --
    fleet = workers(load_compose())
    envs: dict[str, dict[str, str]] = {}
    started: dict[str, Worker] = {}
    service_of: dict[str, str] = {}
    for name, svc in fleet.items():
        envs[name] = service_env(local, svc, tmp_path / f"{name}.heartbeat")
        started[name] = start(name, command_of(svc), envs[name])
        running.append(started[name])
        service_of.update(dict.fromkeys(worker_queues(svc), name))

    def all_ready() -> bool:
        for worker in running:
            if worker.proc.poll() is not None:
                raise AssertionError(f"{worker.name} exited early:\n{worker.output()}")
        return all(" ready." in w.output() for w in running)

    wait_for(all_ready, 90, "every worker service to be ready")
    # Every worker is connected as the worker role, and nothing else is connected.
    pids = {f"pgq:{w.proc.pid}" for w in running}
    connected = sessions_by_role(env)
    assert set(connected) == {local.role("pgq_worker")}, connected
    # (a worker's sessions are named pgq:<pid>:worker:<node>)
    assert pids <= {":".join(a.split(":")[:2]) for a in connected[local.role("pgq_worker")]}

    def heartbeat_fresh(name: str) -> bool:
        return health.check(tmp_path / f"{name}.heartbeat", STALE).healthy

    def compose_healthchecks() -> dict[str, subprocess.Popen[str]]:
        return start_healthchecks({name: (fleet[name], envs[name]) for name in fleet})

    # -- each worker runs the task routed to its queue, with its queue's vt --
    sent = {q: fleet_client.send_task(task, args=args).id for q, (task, args) in TASKS.items()}

    def vt_of_running_orchestration() -> float | None:
        value = env.scalar(
            "SELECT extract(epoch FROM visible_at - now()) FROM {schema}.message"
            " WHERE queue = 'orchestrator' AND read_ct = 1"
        )
        return None if value is None else float(value)

    # The orchestration runs 3 s: meanwhile its lease is the compose file's 300 s.
    vt = wait_for(vt_of_running_orchestration, 30, "the orchestration to be claimed")
    assert 250 < vt <= 300

    def succeeded(name: str, task: str, task_id: str) -> bool:
        return f"{task}[{task_id}] succeeded" in started[name].output()

    for queue, task_id in sent.items():
        task, name = TASKS[queue][0], service_of[queue]
        wait_for(partial(succeeded, name, task, task_id), 60, f"{task} to succeed on {name}")
        for other, worker in started.items():
            if other != name:
                assert task_id not in worker.output(), f"{task} reached {other}"
    # The orchestration published its callback, which the callback worker ran.
    wait_for(
        lambda: "job job-1 finished" in started[service_of["callback"]].output(),
        30,
        "the orchestration's callback",
    )
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 0

    # -- healthy while consuming, and through an idle stretch longer than the threshold --
    # (The healthchecks, `pgq` processes that take a while to start, run during the
    # stretch: they are healthy in it, and their start-up adds no wait of its own.)
    checking = compose_healthchecks()
    idle_until = time.monotonic() + STALE + 1
    while time.monotonic() < idle_until:
        for name in fleet:
            assert heartbeat_fresh(name), f"{name} looked stuck while idle"
        time.sleep(0.2)  # pacing the probe, not ordering anything
    for name, result in outcomes(checking).items():
        assert result.returncode == 0, f"{name}: {result.stderr}"
        assert result.stdout.startswith("healthy: worker pid ")

    # -- a stopped worker and a killed one fail their healthcheck; the others do not --
    stopped, killed = service_of["orchestrator"], service_of["default"]
    os.killpg(started[stopped].proc.pid, signal.SIGSTOP)
    started[killed].kill(signal.SIGKILL)
    halted_at = time.time()
    wait_for(
        lambda: not heartbeat_fresh(stopped) and not heartbeat_fresh(killed),
        STALE + 15,
        "the halted workers' heartbeats to go stale",
    )
    for name in (stopped, killed):
        # No beat since the halt: staleness is the halt's doing, and it took the threshold.
        assert (tmp_path / f"{name}.heartbeat").stat().st_mtime <= halted_at + 0.01
    for name, result in outcomes(compose_healthchecks()).items():
        if name in (stopped, killed):
            assert result.returncode == 1, f"{name}: {result.stdout}"
            assert re.match(r"Error: worker pid \d+ on .* has not consumed for", result.stderr)
        else:
            assert result.returncode == 0, f"{name}: {result.stderr}"

    # -- a stopped worker that resumes is healthy again --
    os.killpg(started[stopped].proc.pid, signal.SIGCONT)
    wait_for(lambda: heartbeat_fresh(stopped), 30, f"{stopped} to beat again")
    # (Its healthcheck runs while the metrics service below starts.)
    resumed = start_healthchecks({stopped: (fleet[stopped], envs[stopped])})

    # -- the metrics service serves the fleet's queues --
    metrics_cmd = command_of(services["metrics"])
    port_at = metrics_cmd.index("--serve") + 1
    metrics_cmd[port_at] = "0"  # any free port; the compose file's is fixed in a container
    metrics_cmd[metrics_cmd.index("--host") + 1] = "127.0.0.1"
    exporter = start("metrics", metrics_cmd, service_env(local, services["metrics"]))
    running.append(exporter)
    url = wait_for(
        lambda: re.search(r"on (http://\S+/metrics)", exporter.output()),
        30,
        "the metrics service to listen",
    ).group(1)
    result = outcomes(resumed)[stopped]
    assert result.returncode == 0, result.stderr
    with urllib.request.urlopen(url, timeout=10) as response:
        parsed = parse_exposition(response.read().decode())
    ready = by_queue(parsed, "pgq_queue_ready_messages")
    assert set(TASKS) <= set(ready)
    assert parsed["pgq_client_processes"].samples[()] >= 3
    # It serves them as the monitor role, which reads no payload.
    assert sessions_by_role(env)[local.role("pgq_monitor")] == {f"pgq-metrics:{exporter.proc.pid}"}
    with (
        psycopg.connect(local.libpq("pgq_monitor")) as monitor,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        monitor.execute("SELECT payload FROM pgq.message")


@pytest.mark.sessions(12)  # 9 seen on its own database, -n 0
def test_the_beat_service_runs_two_replicas_as_the_worker_role(
    local: Local, env: Env, running: list[Worker], tmp_path: Path
) -> None:
    """The compose file's beat service, twice, as `docker compose up` starts it: the
    example app's schedule is stored once, one beat sends, the scheduler worker runs what
    it sends, and when the sending beat is SIGKILLed the other one goes on."""
    services = load_compose()["services"]
    init_postgres(local, services["postgres"])
    for one_shot in ("migrate", "grants"):
        done = run_service(local, services[one_shot])
        assert done.returncode == 0, done.stderr
    worker_svc = next(
        svc for svc in workers(load_compose()).values() if "scheduler" in worker_queues(svc)
    )
    worker = start(
        "worker-scheduler",
        command_of(worker_svc),
        service_env(local, worker_svc, tmp_path / "w.heartbeat"),
    )
    running.append(worker)
    beat_svc = services["beat"]
    assert beat_svc["deploy"]["replicas"] == 2
    beats = [start(f"beat-{n}", command_of(beat_svc), service_env(local, beat_svc)) for n in (1, 2)]
    running.extend(beats)
    wait_for(lambda: " ready." in worker.output(), 90, "the scheduler worker")
    wait_for(
        lambda: (
            all("pgq beat:" in b.output() for b in beats)
            and env.scalar("SELECT count(*) FROM {schema}.beat_leader") == 1
        ),
        90,
        "both beats to start, one to lead",
    )
    assert env.scalar("SELECT origin FROM {schema}.beat_entry WHERE name = 'tick-every-30s'") == (
        "config"
    )
    # A faster tick than the example app's 30 s, added as the compose file's worker role.
    worker_url = service_env(local, beat_svc)["PGQ_URL"]
    added = subprocess.run(
        [*pgq_command(), "schedule", "add", "fast-tick", "--task", "fleet.tick", "--every", "1",
         "--url", worker_url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr

    def ticks_run() -> list[str]:
        return re.findall(r"fleet\.tick\[([0-9a-f-]+)\] succeeded", worker.output())

    wait_for(lambda: len(ticks_run()) >= 3, 60, "the scheduler worker to run three ticks")
    leader_pid = int(str(env.scalar("SELECT holder FROM {schema}.beat_leader")).split(":")[-2])
    [leader] = [b for b in beats if b.proc.pid == leader_pid]
    leader.kill(signal.SIGKILL)
    before = len(ticks_run())
    wait_for(lambda: len(ticks_run()) >= before + 3, 60, "the other beat to go on")
    # Each slot's task ran once, and was sent by one of the two beats (the second after
    # the first was killed).
    ran = ticks_run()
    assert len(ran) == len(set(ran)), ran
    with psycopg.connect(env.pg_url) as conn:
        slots = dict(conn.execute("SELECT task_id, sent_by FROM pgq.beat_slot").fetchall())
    assert set(ran) <= set(slots), set(ran) - set(slots)
    assert len({slots[task_id] for task_id in ran}) == 2
    roles = sessions_by_role(env)
    assert set(roles) == {local.role("pgq_worker")}, roles
