"""Every service of docker/docker-compose.yaml, run for real without Docker.

Each service's `command:` and `environment:` become a local subprocess: the same argv
(with `celery` and `pgq` resolved to this checkout's), the same variables, with the
broker URL pointed at the test Postgres, a test schema, and a short health threshold.
The migrate service must exit 0; each worker must become ready, run a task the
example app routes to its queue, with its queue's visibility timeout; its healthcheck
must pass while it consumes, stay green while it idles past the threshold, and fail
once the worker is stopped (SIGSTOP) or killed (SIGKILL) for longer than that.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from pg_transport import health
from tests.acceptance.harness import Env, Worker, wait_for
from tests.integration.test_cli import pgq_command
from tests.integration.test_metrics import by_queue, parse_exposition
from tests.unit.test_compose import (
    EXAMPLES,
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


def argv(command: list[str]) -> list[str]:
    """The compose command, run with this checkout's interpreter and console script."""
    if command[0] == "celery":
        return [sys.executable, "-m", "celery", *command[1:]]
    if command[0] == "pgq":
        return [*pgq_command(), *command[1:]]
    raise AssertionError(f"unexpected program in a compose command: {command}")


def service_env(env: Env, service: dict[str, Any], heartbeat: Path | None = None) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PGQ_")}
    environ.update(environment_of(service))
    environ.update(PGQ_URL=env.broker_url, PGQ_SCHEMA=env.schema, PYTHONUNBUFFERED="1")
    if heartbeat is not None:
        environ.update({health.FILE_ENV: str(heartbeat), health.STALE_ENV: str(STALE)})
    return environ


def start(name: str, command: list[str], environ: dict[str, str]) -> Worker:
    log = Path(tempfile.mkstemp(prefix=f"pgq-compose-{name}-", suffix=".log")[1])
    with log.open("wb") as out:
        # The image's working directory holds fleet.py, as examples/ does here.
        proc = subprocess.Popen(
            argv(command), cwd=EXAMPLES, env=environ, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Worker(proc, log, name)


def healthchecks(
    checks: dict[str, tuple[dict[str, Any], dict[str, str]]],
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run services' compose healthchecks (service, environment) at once; name -> result."""
    procs = {}
    for name, (service, environ) in checks.items():
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD"
        procs[name] = subprocess.Popen(
            argv(test[1:]), env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.fixture
def env(pg_url: str, schema: str) -> Env:
    """A schema that does not exist yet: creating it is the migrate service's job."""
    return Env(pg_url, schema)


@pytest.fixture
def fleet_client(env: Env, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A publisher with the example app's routing, on the test schema."""
    for name in list(os.environ):
        if name.startswith("PGQ_"):
            monkeypatch.delenv(name)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import fleet

    return env.client(
        task_routes=fleet.app.conf.task_routes,
        task_default_queue=fleet.app.conf.task_default_queue,
    )


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


def test_the_fleet_runs_scales_and_reports_stuck_workers(
    env: Env, fleet_client: Any, running: list[Worker], tmp_path: Path
) -> None:
    services = load_compose()["services"]

    # -- migrate: a one-shot that succeeds --
    done = subprocess.run(
        argv(command_of(services["migrate"])), env=service_env(env, services["migrate"]),
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "now at version" in done.stdout

    # -- every worker service, all at once, as `docker compose up` starts them --
    fleet = workers(load_compose())
    envs: dict[str, dict[str, str]] = {}
    started: dict[str, Worker] = {}
    service_of: dict[str, str] = {}
    for name, svc in fleet.items():
        envs[name] = service_env(env, svc, tmp_path / f"{name}.heartbeat")
        started[name] = start(name, command_of(svc), envs[name])
        running.append(started[name])
        service_of.update(dict.fromkeys(worker_queues(svc), name))

    def all_ready() -> bool:
        for worker in running:
            if worker.proc.poll() is not None:
                raise AssertionError(f"{worker.name} exited early:\n{worker.output()}")
        return all(" ready." in w.output() for w in running)

    wait_for(all_ready, 90, "every worker service to be ready")

    def heartbeat_fresh(name: str) -> bool:
        return health.check(tmp_path / f"{name}.heartbeat", STALE).healthy

    def compose_healthchecks() -> dict[str, subprocess.CompletedProcess[str]]:
        return healthchecks({name: (fleet[name], envs[name]) for name in fleet})

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
    wait_for(lambda: "job job-1 finished" in started[service_of["callback"]].output(), 30,
             "the orchestration's callback")
    assert env.scalar("SELECT count(*) FROM {schema}.message") == 0

    # -- healthy while consuming, and through an idle stretch longer than the threshold --
    for name, result in compose_healthchecks().items():
        assert result.returncode == 0, f"{name}: {result.stderr}"
        assert result.stdout.startswith("healthy: worker pid ")
    idle_until = time.monotonic() + STALE + 1
    while time.monotonic() < idle_until:
        for name in fleet:
            assert heartbeat_fresh(name), f"{name} looked stuck while idle"
        time.sleep(0.2)  # pacing the probe, not ordering anything

    # -- a stopped worker and a killed one fail their healthcheck; the others do not --
    stopped, killed = service_of["orchestrator"], service_of["default"]
    os.killpg(started[stopped].proc.pid, signal.SIGSTOP)
    started[killed].kill(signal.SIGKILL)
    halted_at = time.time()
    wait_for(lambda: not heartbeat_fresh(stopped) and not heartbeat_fresh(killed),
             STALE + 15, "the halted workers' heartbeats to go stale")
    for name in (stopped, killed):
        # No beat since the halt: staleness is the halt's doing, and it took the threshold.
        assert (tmp_path / f"{name}.heartbeat").stat().st_mtime <= halted_at + 0.01
    for name, result in compose_healthchecks().items():
        if name in (stopped, killed):
            assert result.returncode == 1, f"{name}: {result.stdout}"
            assert re.match(r"Error: worker pid \d+ on .* has not consumed for", result.stderr)
        else:
            assert result.returncode == 0, f"{name}: {result.stderr}"

    # -- a stopped worker that resumes is healthy again --
    os.killpg(started[stopped].proc.pid, signal.SIGCONT)
    wait_for(lambda: heartbeat_fresh(stopped), 30, f"{stopped} to beat again")
    result = healthchecks({stopped: (fleet[stopped], envs[stopped])})[stopped]
    assert result.returncode == 0, result.stderr

    # -- the metrics service serves the fleet's queues --
    metrics_cmd = command_of(services["metrics"])
    port_at = metrics_cmd.index("--serve") + 1
    metrics_cmd[port_at] = "0"  # any free port; the compose file's is fixed in a container
    metrics_cmd[metrics_cmd.index("--host") + 1] = "127.0.0.1"
    exporter = start("metrics", metrics_cmd, service_env(env, services["metrics"]))
    running.append(exporter)
    url = wait_for(lambda: re.search(r"on (http://\S+/metrics)", exporter.output()), 30,
                   "the metrics service to listen").group(1)
    with urllib.request.urlopen(url, timeout=10) as response:
        parsed = parse_exposition(response.read().decode())
    ready = by_queue(parsed, "pgq_queue_ready_messages")
    assert set(TASKS) <= set(ready)
    assert parsed["pgq_client_processes"].samples[()] >= 3
