"""The pgq scheme resolves in a fresh interpreter that never imports pg_transport."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest

from tests.acceptance.harness import ROOT, Env

pytestmark = pytest.mark.acceptance

ZERO_IMPORT = """
import json, sys
from kombu import Connection
before = 'pg_transport' in sys.modules
with Connection(sys.argv[1], transport_options={'schema': sys.argv[2]}) as conn:
    queue = conn.SimpleQueue('zero-import')
    queue.put({'hello': 'world'})
    message = queue.get(timeout=10)
    message.ack()
    queue.close()
    print(json.dumps({'before': before, 'payload': message.payload,
                      'transport': type(conn.transport).__module__}))
"""


def test_scheme_resolves_without_importing_the_package(env: Env) -> None:
    out = subprocess.run(
        [sys.executable, "-c", ZERO_IMPORT, env.broker_url, env.schema],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env=env.environ(),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result == {
        "before": False,
        "payload": {"hello": "world"},
        "transport": "pg_transport.kombu.transport",
    }


PROBE = """
import sys
from kombu.transport import resolve_transport
try:
    resolve_transport('pgq')
    print('resolved-before')
except KeyError:
    print('unknown-before')
import pg_transport
print(resolve_transport('pgq').__module__)
"""


def test_import_registers_too() -> None:
    # -S skips site, so the install-time hook does not run: only the import can register.
    paths = [str(ROOT), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    out = subprocess.run(
        [sys.executable, "-S", "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["unknown-before", "pg_transport.kombu.transport"]


BACKEND_PROBE = """
import celery.app.backends as backends
print(backends.BACKEND_ALIASES.get('pgq'))
import pg_transport
print(backends.BACKEND_ALIASES.get('pgq'))
"""


def test_import_registers_the_result_backend_too() -> None:
    # -S: no install-time hook; Celery's table is loaded first, the package after it.
    paths = [str(ROOT), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    out = subprocess.run(
        [sys.executable, "-S", "-c", BACKEND_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "pg_transport.results.backend:PgqBackend"]


LAZY_PROBE = """
import sys
before = 'celery' in sys.modules
import celery.app.backends as backends
print(before, backends.BACKEND_ALIASES.get('pgq'))
"""


def test_the_backend_alias_waits_for_celery() -> None:
    # With the install-time hook: nothing of Celery's is imported at start-up, and the
    # alias is there once Celery loads its table.
    out = subprocess.run(
        [sys.executable, "-c", LAZY_PROBE], capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "pg_transport.results.backend:PgqBackend"]
