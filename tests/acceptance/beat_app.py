"""A Celery app for the beat tests: its beat_schedule comes from the environment.

TEST_BEAT_SCHEDULE is JSON: {name: {"every": seconds} | {"crontab": "m h dom mon dow"},
plus optional "task", "args", "kwargs", "options"}; TEST_BEAT_RAW, when set, is a Python
expression used as beat_schedule as it is (for the bad-input tests).
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery
from celery.schedules import crontab

app = Celery("beat_acceptance", broker=os.environ.get("PGQ_BROKER_URL", "pgq://"))
app.conf.update(
    task_default_queue=os.environ.get("TEST_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    result_expires=None,  # no celery.backend_cleanup entry
)


def _schedule() -> dict[str, Any]:
    raw = os.environ.get("TEST_BEAT_RAW")
    if raw:
        return eval(raw, {"crontab": crontab})
    entries: dict[str, Any] = {}
    for name, spec in json.loads(os.environ.get("TEST_BEAT_SCHEDULE", "{}")).items():
        if "crontab" in spec:
            schedule: Any = crontab.from_string(spec["crontab"])
        else:
            schedule = float(spec["every"])
        entry = {"task": spec.get("task", "tests.acceptance.app.mark"), "schedule": schedule}
        for key in ("args", "kwargs", "options"):
            if key in spec:
                entry[key] = spec[key]
        entries[name] = entry
    return entries


app.conf.beat_schedule = _schedule()

# TEST_CLOCK_SKEW: this process's wall clock, as Python and Celery read it, is off by
# that many seconds (the beat must not care: its times are the database's).
_skew = float(os.environ.get("TEST_CLOCK_SKEW") or 0)
if _skew:
    _real_time = time.time
    time.time = lambda: _real_time() + _skew
    app.now = lambda: datetime.now(UTC) + timedelta(seconds=_skew)  # type: ignore[method-assign]
    print(f"clock skewed by {_skew:+g}s", flush=True)
