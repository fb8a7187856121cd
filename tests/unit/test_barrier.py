"""Barrier pieces that need no database: message building, settings, the decorator."""

from __future__ import annotations

import base64
import json
import pickle
import zlib
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery, group

from barrier import TRANSPORT_MARKER, BarrierError, barrier_callback
from pg_transport.errors import ConfigurationError
from pg_transport.fanin.messages import as_signature, eta_delay, publish_key, task_message
from pg_transport.fanin.settings import BarrierSettings


@pytest.fixture
def app() -> Celery:
    app = Celery("unit", broker="pgq://", set_as_current=False)
    app.conf.task_routes = {"t.routed": {"queue": "routed", "priority": 4}}
    return app


def test_the_marker_is_the_contract_name() -> None:
    assert TRANSPORT_MARKER == "_pg_transport"


def test_message_has_the_virtual_transport_layout(app: Celery) -> None:
    sig = app.signature("t.x", args=[1], kwargs={"a": 2}, task_id="tid")
    out = task_message(
        app, sig, args_prefix=([9],), extra_kwargs={"m": True}, headers={"pgq_barrier": "b"}
    )
    p = out.payload
    assert (out.queue, out.priority, out.task_id) == ("celery", 0, "tid")
    assert p["content-type"] == "application/json" and p["content-encoding"] == "utf-8"
    assert json.loads(p["body"]) == [
        [[9], 1],
        {"a": 2, "m": True},
        {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
    ]
    assert p["headers"]["task"] == "t.x" and p["headers"]["id"] == "tid"
    assert p["headers"]["pgq_barrier"] == "b"
    props = p["properties"]
    assert props["correlation_id"] == "tid" and props["delivery_mode"] == 2
    assert props["delivery_info"] == {"exchange": "", "routing_key": "celery"}
    assert props["body_encoding"] is None and props["priority"] == 0 and props["delivery_tag"]


def test_routing_and_priority(app: Celery) -> None:
    assert task_message(app, app.signature("t.routed")).queue == "routed"
    assert task_message(app, app.signature("t.routed")).priority == 4
    assert task_message(app, app.signature("t.x", queue="q2")).queue == "q2"
    assert task_message(app, app.signature("t.x", priority=300)).priority == 255
    app.conf.task_default_queue = "dflt"
    assert task_message(app, app.signature("t.x")).queue == "dflt"


def test_binary_bodies_are_base64_and_compression_is_kept(app: Celery) -> None:
    out = task_message(
        app, app.signature("t.x", args=[b"\x00"], serializer="pickle", compression="zlib")
    )
    p = out.payload
    assert p["properties"]["body_encoding"] == "base64"
    assert p["headers"]["compression"] == "application/x-gzip"
    args, _kwargs, _embed = pickle.loads(zlib.decompress(base64.b64decode(p["body"])))
    assert args == (b"\x00",)


def test_links_and_custom_headers_travel(app: Celery) -> None:
    sig = app.signature("t.x", link=app.signature("t.next"), headers={"tenant": "a"})
    p = task_message(app, sig).payload
    assert json.loads(p["body"])[2]["callbacks"][0]["task"] == "t.next"
    assert p["headers"]["tenant"] == "a"


def test_eta_becomes_a_delay(app: Celery) -> None:
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    assert eta_delay({"eta": "2030-01-01T00:00:30+00:00"}, now) == 30.0
    assert eta_delay({"eta": "2030-01-01T00:00:30"}, now) == 30.0  # naive: UTC
    assert eta_delay({"eta": "2029-12-31T00:00:00+00:00"}, now) == 0.0
    assert eta_delay({"eta": None}, now) == eta_delay({"eta": "garbage"}, now) == 0.0
    assert 25 < task_message(app, app.signature("t.x", countdown=30)).delay <= 30


def test_canvas_is_refused(app: Celery) -> None:
    with pytest.raises(BarrierError, match="callback must be a single task signature"):
        as_signature(app, group(app.signature("t.a"), app.signature("t.b")), "callback")
    assert as_signature(app, dict(app.signature("t.a")), "part").task == "t.a"


def test_publish_key_is_deterministic_and_bounded() -> None:
    assert publish_key("b", "x" * 10_000) == publish_key("b", "x" * 10_000)
    assert len(publish_key("b", "x" * 10_000)) == 32
    assert publish_key("a", "bc") != publish_key("ab", "c")


def test_settings_defaults_conf_and_environment() -> None:
    assert BarrierSettings.from_sources({}, {}) == BarrierSettings(86400.0, 3600.0, 30.0)
    conf = {"pgq_barrier_ttl": 60, "pgq_barrier_sweep_interval": 0}
    env = {"PGQ_BARRIER_STUCK_TIMEOUT": "5.5", "PGQ_BARRIER_TTL": "120"}
    assert BarrierSettings.from_sources(conf, env) == BarrierSettings(120.0, 5.5, 0.0)


@pytest.mark.parametrize(
    ("conf", "env", "message"),
    [
        ({"pgq_barrier_ttl": 0}, {}, "pgq_barrier_ttl=0 must be"),
        ({"pgq_barrier_stuck_timeout": "soon"}, {}, "'soon' is not a number"),
        ({}, {"PGQ_BARRIER_SWEEP_INTERVAL": "-1"}, "PGQ_BARRIER_SWEEP_INTERVAL='-1' must be"),
        ({"pgq_barrier_ttl": True}, {}, "is not a number"),
        ({"pgq_barrier_ttl": float("inf")}, {}, "finite"),
    ],
)
def test_bad_settings_name_key_and_value(
    conf: dict[str, Any], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message.replace("(", "\\(")):
        BarrierSettings.from_sources(conf, env)


def test_callback_called_directly_always_runs() -> None:
    seen: list[Any] = []

    @barrier_callback
    def body(results: Any, **kwargs: Any) -> int:
        seen.append((results, kwargs))
        return 1

    assert body([1], x=2) == 1
    # The marker without a running barrier task: popped, and the body still runs.
    assert body([2], **{TRANSPORT_MARKER: True}) == 1
    assert seen == [([1], {"x": 2}), ([2], {})]
    assert body.__name__ == "body"
