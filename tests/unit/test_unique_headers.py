"""What a message asks for with the unique and fair headers, and how Celery's options
and a task's defaults become them (no database)."""

from __future__ import annotations

from typing import Any

import pytest

from pg_transport.message import fair, unique
from pg_transport.message.unique import UniqueError


class Task:
    name = "app.report"

    def run(self, report_id: int, fmt: str = "pdf") -> None: ...


def headers_for(task: Any, args: Any, kwargs: Any, **properties: Any) -> dict[str, Any]:
    headers: dict[str, Any] = {}
    unique.task_defaults(task, (args, kwargs, {}), headers, properties)
    fair.task_defaults(task, (args, kwargs, {}), headers, properties)
    return headers


def test_a_default_key_names_an_argument_and_is_prefixed_by_the_task() -> None:
    class T(Task):
        unique_key = "report_id"
        unique_while = "queued_or_running"
        fair_key = "fmt"

    assert headers_for(T(), [7, "csv"], {}) == {
        "pgq-unique-key": "app.report:7",
        "pgq-unique-while": "queued_or_running",
        "pgq-fair-key": "csv",
    }
    assert headers_for(T(), [], {"report_id": 8, "fmt": "pdf"})["pgq-unique-key"] == (
        "app.report:8"
    )


def test_true_keys_on_all_arguments_whatever_their_keyword_order() -> None:
    class T(Task):
        unique_key = True

    one = headers_for(T(), [1], {"a": 1, "b": 2})["pgq-unique-key"]
    assert one == headers_for(T(), [1], {"b": 2, "a": 1})["pgq-unique-key"]
    assert one != headers_for(T(), [2], {"a": 1, "b": 2})["pgq-unique-key"]


def test_call_options_win_over_the_task_defaults() -> None:
    class T(Task):
        unique_key = "report_id"
        unique_conflict = "return"
        fair_key = "fmt"

    got = headers_for(T(), [7], {}, unique_key="mine", unique_conflict="raise", fair_key="x")
    assert got == {}
    message = {"properties": {"unique_key": "mine", "unique_conflict": "raise", "fair_key": "x"}}
    unique.move_options(message)
    fair.move_options(message)
    assert message["headers"] == {
        "pgq-unique-key": "mine",
        "pgq-unique-conflict": "raise",
        "pgq-fair-key": "x",
    }
    assert message["properties"] == {}


def test_a_default_the_call_cannot_give_refuses_the_publish() -> None:
    class T(Task):
        unique_key = "missing"

    headers = headers_for(T(), [7], {})
    with pytest.raises(UniqueError, match="missing"):
        unique.uniqueness({"headers": headers})


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"pgq-unique-key": "k", "pgq-unique-while": "sometimes"}, "pgq-unique-while"),
        ({"pgq-unique-key": "k", "pgq-unique-conflict": "maybe"}, "pgq-unique-conflict"),
        ({"pgq-unique-key": ""}, "pgq-unique-key"),
        ({"pgq-unique-key": "é" * 600}, "pgq-unique-key"),
        ({"pgq-unique-key": 1.5}, "pgq-unique-key"),
        ({"pgq-unique-key": True}, "pgq-unique-key"),
    ],
)
def test_bad_headers_are_refused_naming_them(headers: dict[str, Any], named: str) -> None:
    with pytest.raises(UniqueError, match=named):
        unique.uniqueness({"headers": headers})


def test_what_a_message_asks_for() -> None:
    assert unique.uniqueness({"headers": {}}).key is None
    asked = unique.uniqueness(
        {"headers": {"pgq-unique-key": 42, "pgq-unique-while": "queued_or_running"}}
    )
    assert asked == unique.Uniqueness(key="42", while_running=True, conflict="return")
    assert fair.fair_key({"headers": {"pgq-fair-key": "t-1"}}) == "t-1"
    assert fair.fair_key({"headers": {}}) is None
    with pytest.raises(fair.FairKeyError, match="pgq-fair-key"):
        fair.fair_key({"headers": {"pgq-fair-key": ["a"]}})


def test_a_process_remembers_its_latest_duplicates_and_no_self_alias(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(unique, "MAX_NOTED", 3)
    monkeypatch.setattr(unique, "_holders", type(unique._holders)())
    unique.note_holder("t", "t")  # a resend of the holder itself: no alias
    unique.note_holder("", "h")
    assert unique.holder_of("t") is None and unique.holder_of("") is None
    for n in range(5):
        unique.note_holder(f"dup-{n}", "holder")
    assert [unique.holder_of(f"dup-{n}") for n in range(5)] == [
        None,
        None,
        "holder",
        "holder",
        "holder",
    ]


def test_a_chords_part_with_a_key_is_refused_and_other_messages_are_not() -> None:
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": {"task": "b"}}
    headers: dict[str, Any] = {"task": "app.part", "group": "g1", unique.UNIQUE_KEY: "k"}
    unique.refuse_in_chord(((), {}, embed), headers, {})
    with pytest.raises(UniqueError, match=r"unique_key='k'.*part of chord g1"):
        unique.uniqueness({"headers": headers})
    # The option, not yet moved into the headers, counts too; protocol 1 as well.
    headers = {"task": "app.part", "group": "g2"}
    unique.refuse_in_chord({"chord": {"task": "b"}}, headers, {"unique_key": "o"})
    assert "unique_key='o'" in headers[unique.DEFAULT_REFUSED]
    for body, given in (
        (((), {}, {**embed, "chord": None}), {unique.UNIQUE_KEY: "k"}),  # not a chord's part
        (((), {}, embed), {}),  # a part without a key
    ):
        headers = dict(given)
        unique.refuse_in_chord(body, headers, {})
        assert unique.DEFAULT_REFUSED not in headers


def test_a_chords_body_with_a_key_is_refused() -> None:
    class Body:
        task = "app.body"
        options: dict[str, Any] = {"unique_key": "b"}

    with pytest.raises(UniqueError, match=r"unique_key='b'.*body of a chord"):
        unique.refuse_on_chord_body(Body(), None)

    class Default(Task):
        unique_key = "report_id"

    Body.options = {}
    with pytest.raises(UniqueError, match=r"task app\.body's default"):
        unique.refuse_on_chord_body(Body(), Default())
    unique.refuse_on_chord_body(Body(), Task())  # no key: nothing to refuse
