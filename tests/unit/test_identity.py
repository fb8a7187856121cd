"""Identity recovery from kwargs and positional args, and decoding poisoned bodies."""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pg_transport import identity
from pg_transport.message.poison import decode

TASK = "app.tasks.run_pipeline"


@pytest.fixture(autouse=True)
def registry() -> Iterator[None]:
    identity.clear()
    identity.register(TASK, execution_id=2, organization_id=0)
    yield
    identity.clear()


def test_kwargs_win_over_positional() -> None:
    found, why = identity.recover(TASK, [7, "x", "pos-exec"], {"execution_id": "kw-exec"})
    assert found == {"execution_id": "kw-exec", "organization_id": 7}
    assert why == []


def test_positional_fallback() -> None:
    assert identity.recover(TASK, [7, "x", "e-1"], {}) == (
        {"execution_id": "e-1", "organization_id": 7},
        [],
    )


def test_short_args_give_a_reason_not_an_exception() -> None:
    found, why = identity.recover(TASK, [7], {})
    assert found == {"organization_id": 7}
    assert why == ["execution_id: positional index 2 out of range (1 args)"]


def test_non_list_args_and_non_mapping_kwargs() -> None:
    found, why = identity.recover(TASK, "oops", ["not", "a", "dict"])
    assert found == {}
    assert "args is str, not a list" in why and "kwargs is list, not a mapping" in why


def test_type_checked() -> None:
    found, why = identity.recover(TASK, [{"nested": 1}, None, True], {})
    assert found == {}
    assert "organization_id: args[0] holds dict, not a str or number" in why
    assert "execution_id: args[2] holds bool, not a str or number" in why


def test_watched_kwargs_are_found_in_any_task() -> None:
    assert identity.recover("other.task", [1, 2], {"execution_id": 9, "x": 1}) == ({}, [])
    identity.watch("execution_id")
    found, why = identity.recover("other.task", [1, 2], {"execution_id": 9, "x": 1})
    assert (found, why) == ({"execution_id": 9}, [])
    with pytest.raises(ValueError, match="field names"):
        identity.watch("")


@pytest.mark.parametrize("bad", [-1, "2", 1.0, True])
def test_register_refuses_bad_indexes(bad: Any) -> None:
    with pytest.raises(ValueError, match="non-negative positional index"):
        identity.register("t", execution_id=bad)


@given(
    args=st.recursive(st.none() | st.integers() | st.text(), st.lists, max_leaves=8),
    kwargs=st.recursive(
        st.none() | st.integers() | st.text(), lambda c: st.dictionaries(st.text(), c), max_leaves=8
    ),
)
def test_recover_never_raises(args: Any, kwargs: Any) -> None:
    found, why = identity.recover(TASK, args, kwargs)
    assert isinstance(found, dict) and isinstance(why, list)


def payload(body: Any, content_type: str = "application/json", **headers: Any) -> dict[str, Any]:
    return {
        "body": body,
        "content-type": content_type,
        "headers": headers,
        "properties": {"delivery_info": {}},
    }


def test_decode_protocol_2_json() -> None:
    body = json.dumps([[1, 2, 3], {"execution_id": "e"}, {}])
    got = decode(payload(body, id="tid", task=TASK))
    assert (got.task_id, got.task_name, got.args, got.kwargs, got.reasons) == (
        "tid",
        TASK,
        [1, 2, 3],
        {"execution_id": "e"},
        [],
    )


def test_decode_protocol_2_base64_body() -> None:
    raw = json.dumps([[1], {}, {}]).encode()
    p = payload(base64.b64encode(raw).decode(), id="t", task=TASK)
    p["properties"]["body_encoding"] = "base64"
    assert decode(p).args == [1]


def test_decode_protocol_1() -> None:
    body = json.dumps({"task": TASK, "id": "t1", "args": [5], "kwargs": {"a": 1}})
    got = decode(payload(body))
    assert (got.task_id, got.task_name, got.args, got.kwargs) == ("t1", TASK, [5], {"a": 1})


def test_decode_yaml_and_msgpack_where_installed() -> None:
    yaml = pytest.importorskip("yaml")
    got = decode(
        payload(yaml.safe_dump([[1], {"k": 2}, {}]), "application/x-yaml", id="t", task=TASK)
    )
    assert (got.args, got.kwargs) == ([1], {"k": 2})
    msgpack = pytest.importorskip("msgpack")
    packed = base64.b64encode(msgpack.packb([[3], {}, {}])).decode()
    p = payload(packed, "application/x-msgpack", id="t", task=TASK)
    p["properties"]["body_encoding"] = "base64"
    assert decode(p).args == [3]


def test_pickle_is_never_unpickled() -> None:
    class Boom:
        def __reduce__(self) -> Any:
            return (exec, ("raise SystemExit('unpickled!')",))

    p = payload(
        base64.b64encode(pickle.dumps(Boom())).decode(),
        "application/x-python-serialize",
        id="t",
        task=TASK,
    )
    p["properties"]["body_encoding"] = "base64"
    got = decode(p)
    assert got.task_id == "t" and got.args is None
    assert got.reasons == ["undecodable body: pickled body: never unpickled to recover identity"]


def test_undecodable_body_gives_a_reason() -> None:
    got = decode(payload("{not json", id="t", task=TASK))
    assert got.task_name == TASK and got.args is None
    assert got.reasons[0].startswith("undecodable body:")


@given(st.dictionaries(st.text(), st.none() | st.text() | st.integers() | st.binary()))
def test_decode_never_raises(junk: dict[str, Any]) -> None:
    assert isinstance(decode(junk).reasons, list)
