"""Celery's task message protocol, checked before Celery is given a message: every field
a worker unpacks, in every shape a publisher could write, is either refused with a reason
naming it or one Celery's own unpacking takes without raising."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
from celery import Celery
from celery.utils.time import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kombu.asynchronous.timer import to_timestamp
from kombu.message import Message

from pg_transport.message import envelope, protocol

app = Celery("protocol", set_as_current=False)


@app.task(name="t.add")
def add(x: int) -> int:
    return x


def payload(**headers: Any) -> dict[str, Any]:
    """A protocol 2 message as pgq stores it, Celery's own headers updated by ``headers``."""
    sent = app.amqp.as_task_v2("id-1", "t.add", args=(1,), kwargs={}, countdown=None)
    return {
        "body": json.dumps(sent.body),
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {**sent.headers, **headers},
        "properties": {"body_encoding": None, "delivery_info": {}},
    }


def v1(**fields: Any) -> dict[str, Any]:
    body = {"task": "t.add", "id": "id-1", "args": [1], "kwargs": {}, **fields}
    return {
        "body": json.dumps(body),
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {},
        "properties": {},
    }


def celery_takes(message: dict[str, Any]) -> None:
    """What a worker does with a message before its pool runs the task (strategy, the
    Request, the pool's arguments); raises where Celery would."""
    from celery.worker.request import Request
    from celery.worker.strategy import hybrid_to_proto2, proto1_to_proto2

    kombu_message = Message(
        body=message["body"],
        content_type=message["content-type"],
        content_encoding=message["content-encoding"],
        headers=message["headers"],
        properties=message["properties"],
        delivery_info={},
    )
    body: Any = None
    if "task" not in kombu_message.headers:
        body = kombu_message.decode()
        assert body["task"] in app.tasks
    headers: Any = None
    decoded, utc = False, True
    if body is None and "args" not in kombu_message.payload:
        pass
    elif "args" in kombu_message.payload:
        body, headers, decoded, utc = hybrid_to_proto2(kombu_message, kombu_message.payload)
    else:
        body, headers, decoded, utc = proto1_to_proto2(kombu_message, body)
    request = Request(
        kombu_message, app=app, task=add, body=body, headers=headers, decoded=decoded, utc=utc
    )
    hard, soft = request.time_limits
    for limit in (hard, soft):
        if limit:
            time.monotonic() + limit
    if request.eta:
        to_timestamp(timezone.to_system(request.eta))
    if request.expires:
        request.maybe_expire()
    assert request.stamps is not None
    str(request.argsrepr), str(request.kwargsrepr)


def test_celery_s_own_messages_pass() -> None:
    assert protocol.fault(payload()) is None
    assert protocol.fault(payload(timelimit=[30, 20.5], retries=3)) is None
    assert protocol.fault(payload(eta="2030-01-02T03:04:05.123456+00:00")) is None
    assert protocol.fault(payload(expires="2030-01-02T03:04:05")) is None
    assert protocol.fault(v1(timelimit=[None, 5], eta="2030-01-02T03:04:05Z")) is None
    celery_takes(payload(timelimit=[30, 20.5], eta="2030-01-02T03:04:05Z"))


def test_messages_that_are_not_celery_tasks_are_not_looked_at() -> None:
    # kombu's own, and a worker's remote-control broadcast.
    plain = {"body": "hello", "content-type": "text/plain", "headers": {}, "properties": {}}
    control = {
        "body": json.dumps({"method": "ping", "arguments": {}, "destination": None}),
        "content-type": "application/json",
        "headers": {"clock": 1, "expires": 1.5},
        "properties": {},
    }
    assert protocol.fault(plain) is None
    assert protocol.fault(control) is None


BAD: dict[str, list[Any]] = {
    "timelimit": ["abc", [1, 2, 3], [1], "12", 5, {"a": 1}, [-1, None], ["1", None], [1e300, 1]],
    "eta": ["", "abc", 12, [2030], {"y": 1}, "0001-01-01T00:00:00+14:00", "9999-12-31T23:59Z"],
    "expires": ["", "tomorrow", 3.5, ["2030-01-01"], True],
    "retries": ["1", -1, 1.5, True, [1]],
    "argsrepr": [12, ["a"], {"a": 1}],
    "kwargsrepr": [12, ["a"]],
    "id": [None, 12, ["a"], {"a": 1}],
    "task": [12, ["t.add"], None],
    "shadow": [12, ["x"]],
    "root_id": [12, {}],
    "parent_id": [12, []],
    "group": [12],
    "group_index": ["0", -1, 0.5],
    "ignore_result": ["yes", 1],
    "replaced_task_nesting": ["1", -2],
    "stamped_headers": ["a", [1], {"a": 1}],
    "stamps": ["a", [1]],
}


@pytest.mark.parametrize(
    ("field", "value"), [(f, v) for f, values in BAD.items() for v in values], ids=repr
)
def test_a_header_of_the_wrong_shape_is_refused_naming_it(field: str, value: Any) -> None:
    why = protocol.fault(payload(**{field: value}))
    assert why is not None and f"header {field!r}" in why
    # The same field in a protocol 1 body, and in a hybrid message's body.
    why = protocol.fault(v1(**{field: value}))
    assert why is not None and f"body field {field!r}" in why
    if field in protocol.HYBRID and field != "task":  # (no task header: protocol 1)
        hybrid = payload()
        hybrid["body"] = json.dumps({"args": [1], "kwargs": {}, field: value})
        del hybrid["headers"][field]
        why = protocol.fault(hybrid)
        assert why is not None and f"field {field!r}" in why


@pytest.mark.parametrize("field", protocol.REQUIRED)
def test_a_missing_id_or_task_is_refused(field: str) -> None:
    message = payload()
    del message["headers"][field]
    if field == "task":  # no task header: a protocol 1 message, whose body has none
        assert protocol.fault(message) is None
        assert protocol.fault(v1(task=None)) is not None
    else:
        assert protocol.fault(message) == "Celery task message has no header 'id'"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"task": "t.add", "id": "i", "args": "x"}, "'args'"),
        ({"task": "t.add", "id": "i", "args": [], "kwargs": [1]}, "'kwargs'"),
        ({"task": "t.add", "id": "i", "args": [], "callbacks": "x"}, "'callbacks'"),
        ({"task": "t.add", "id": "i", "args": [], "chord": [1]}, "'chord'"),
    ],
)
def test_a_protocol_1_body_of_the_wrong_shape_is_refused(body: Any, named: str) -> None:
    message = v1()
    message["body"] = json.dumps(body)
    why = protocol.fault(message)
    assert why is not None and named in why


def test_a_base64_body_is_read_and_one_that_does_not_parse_is_left_to_celery() -> None:
    message = v1(timelimit="abc")
    message["body"] = base64.b64encode(message["body"].encode()).decode()
    message["properties"]["body_encoding"] = "base64"
    assert "'timelimit'" in (protocol.fault(message) or "")
    # Celery's decoder refuses it before a pool slot is taken (pgq dead-letters what it
    # cannot decode): not this check's to name.
    message = payload()
    message["body"] = "{not json"
    assert protocol.fault(message) is None
    assert protocol.fault(v1() | {"body": "{not json"}) is None


def test_a_compressed_body_is_left_to_celery_its_headers_are_checked() -> None:
    message = payload(compression="application/x-gzip")
    message["body"] = base64.b64encode(b'{"args": [], "timelimit": "abc"}').decode()
    message["properties"]["body_encoding"] = "base64"
    assert protocol.fault(message) is None
    message["headers"]["retries"] = "1"
    assert "'retries'" in (protocol.fault(message) or "")


def test_the_envelope_check_includes_the_protocol() -> None:
    assert "'timelimit'" in (envelope.fault(payload(timelimit="abc")) or "")


def test_the_reason_shows_a_long_value_cut_short() -> None:
    why = protocol.fault(payload(timelimit="x" * 500)) or ""
    assert "timelimit" in why and len(why) < 200


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**40), max_value=2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["2030-01-02T03:04:05Z", "2030-01-02", "0001-01-01", "9999-12-31"]),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=2)
    ),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    field=st.sampled_from(sorted(protocol.FIELDS)),
    value=JSON,
    hybrid=st.booleans(),
)
@pytest.mark.sessions(8)  # side by side, the run's meter
def test_whatever_passes_the_check_celery_takes_without_raising(
    field: str, value: Any, hybrid: bool
) -> None:
    message = payload(**{field: value})
    if hybrid and field in protocol.HYBRID and field != "task":
        message["body"] = json.dumps({"args": [1], "kwargs": {}, field: value})
        del message["headers"][field]
    if protocol.fault(message) is None:
        celery_takes(message)
