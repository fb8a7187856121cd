"""Results through real Celery workers with ``result_backend = "pgq://…"``: what Celery
documents of a result backend behaves as with Redis."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from typing import Any

import pytest
from celery import Celery, states
from celery.exceptions import TimeoutError as CeleryTimeout

from tests.acceptance.harness import QUICK_STOP, Env, start_worker, workers

# The sessions a test holds at most (the most of two runs, -n 0); a test may say otherwise.
pytestmark = [pytest.mark.acceptance, pytest.mark.sessions(10)]  # side by side, the run's meter: 9


@pytest.fixture
def env(env: Env) -> Env:
    """Workers that poll every 0.2 s (QUICK_STOP): nothing here is timed against the poll."""
    env.extra.update(QUICK_STOP)
    return env


APP = "tests.acceptance.results_app"
T = "tests.acceptance.results_app."


def client(env: Env, serializer: str = "json", **conf: Any) -> Celery:
    app = Celery("client", broker=env.broker_url, backend=env.broker_url, set_as_current=False)
    app.conf.update(
        broker_transport_options={"schema": env.schema},
        result_serializer=serializer,
        task_serializer=serializer,
        accept_content=sorted({serializer, "json"}),
        **conf,
    )
    return app


VALUE = {"text": "héllo", "n": [1, 2.5, None, True], "nested": {"k": ["v"]}}


@pytest.mark.parametrize("serializer", ["json", "pickle", "yaml", "msgpack"])
def test_results_and_states_round_trip(env: Env, serializer: str) -> None:
    if serializer == "msgpack" and importlib.util.find_spec("msgpack") is None:
        pytest.skip("msgpack is not installed")
    app = client(env, serializer)
    environ = {"TEST_RESULT_SERIALIZER": serializer, "C_FORCE_ROOT": "1"}
    with workers(env, f"w-{serializer}", app=APP, environ=environ):
        ok = app.send_task(T + "echo", args=[VALUE])
        assert ok.get(timeout=20) == VALUE
        assert ok.state == states.SUCCESS and ok.successful() and ok.ready()
        # task_extended meta comes back too.
        meta = app.backend.get_task_meta(ok.id, cache=False)
        assert meta["name"] == T + "echo" and meta["args"] == [VALUE]
        assert meta["worker"].startswith(f"w-{serializer}@") and meta["queue"] == "celery"
        bad = app.send_task(T + "fail", args=["no good"])
        with pytest.raises(ValueError, match="no good"):
            bad.get(timeout=20)
        assert bad.failed() and bad.state == states.FAILURE
        assert "ValueError: no good" in (bad.traceback or "")


@pytest.mark.sessions(14)  # side by side, the run's meter: 12
def test_documented_result_behaviours(env: Env) -> None:
    app = client(env)
    with workers(env, "w-doc", app=APP):
        slow = app.send_task(T + "sleep", args=[3, "late"])
        started = time.monotonic()
        with pytest.raises(CeleryTimeout):
            slow.get(timeout=0.5)
        # Back at its timeout, not at the result: that exists 3 s after the task starts,
        # which is after it was sent, however loaded the machine.
        assert time.monotonic() - started < 3
        assert not slow.ready() and slow.state in (states.PENDING, states.STARTED)
        assert slow.get(timeout=20) == "late"

        bad = app.send_task(T + "fail", args=["quiet"])
        err = bad.get(timeout=20, propagate=False)
        assert isinstance(err, ValueError) and str(err) == "quiet"

        # A task that waits for another task's result is refused (disable_sync_subtasks).
        inner = app.send_task(T + "add", args=[1, 2])
        assert inner.get(timeout=20) == 3
        outer = app.send_task(T + "wait_inside", args=[inner.id])
        with pytest.raises(RuntimeError, match=r"Never call result\.get"):
            outer.get(timeout=20)

        done = app.send_task(T + "add", args=[2, 2])
        assert done.get(timeout=20) == 4
        done.forget()
        assert app.AsyncResult(done.id).state == states.PENDING

        group = app.GroupResult(None, [app.send_task(T + "add", args=[i, i]) for i in range(5)])
        assert group.join_native(timeout=20) == [0, 2, 4, 6, 8]
        assert group.join(timeout=20) == [0, 2, 4, 6, 8]


ZERO_IMPORT = """
import json, sys
from celery import Celery
before = 'pg_transport' in sys.modules
app = Celery('zero', broker=sys.argv[1], backend=sys.argv[1])
app.conf.broker_transport_options = {'schema': sys.argv[2]}
backend = app.backend
backend.store_result('zero-import', {'ok': True}, 'SUCCESS')
print(json.dumps({'before': before, 'backend': type(backend).__module__,
                  'result': app.AsyncResult('zero-import').get(timeout=10)}))
"""


@pytest.mark.sessions(6)  # side by side, the run's meter: 5
def test_backend_scheme_resolves_without_importing_the_package(env: Env) -> None:
    out = subprocess.run(
        [sys.executable, "-c", ZERO_IMPORT, env.broker_url, env.schema],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env=env.environ(),
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "before": False,
        "backend": "pg_transport.results.backend",
        "result": {"ok": True},
    }


def test_a_task_too_large_to_store_fails_with_a_clear_error(env: Env) -> None:
    app = client(env)
    environ = {"PGQ_RESULT_MAX_RESULT_BYTES": "4096"}
    with workers(env, "w-big", app=APP, environ=environ):
        big = app.send_task(T + "echo", args=["x" * 10_000])
        with pytest.raises(Exception, match="more than max_result_bytes \\(4096\\)"):
            big.get(timeout=20)
        assert big.state == states.FAILURE


def test_worker_restart_keeps_results(env: Env) -> None:
    app = client(env)
    worker = start_worker(env, "w-one", app=APP)
    try:
        first = app.send_task(T + "add", args=[20, 22])
        assert first.get(timeout=20) == 42
    finally:
        worker.stop()
    assert client(env).AsyncResult(first.id).get(timeout=5) == 42
