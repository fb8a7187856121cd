"""What a message's ordering headers and options become, and a task's defaults."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from pg_transport.kombu.hooks import apply_task_defaults
from pg_transport.message import ordering
from pg_transport.message.ordering import OrderingError, move_options, placement


def test_no_ordering_header_costs_nothing() -> None:
    assert placement({"headers": {"id": "t1"}}, 300.0) == ordering.UNORDERED
    assert placement({}, 300.0) == ordering.UNORDERED


def test_a_key_stores_the_task_id_for_a_retry_to_find() -> None:
    found = placement({"headers": {"id": "t1", "pgq-ordering-key": 42}}, 300.0)
    assert (found.okey, found.task_id, found.follows, found.followable) == ("42", "t1", None, False)


def test_a_follower_is_followable_and_waits_the_default_unless_it_says() -> None:
    found = placement({"headers": {"id": "t2", "pgq-follows": "t1"}}, 12.5)
    assert (found.follows, found.follow_wait, found.followable) == ("t1", 12.5, True)
    told = placement({"headers": {"id": "t2", "pgq-follows": "t1", "pgq-follows-timeout": "3"}}, 9)
    assert told.follow_wait == 3.0


def test_the_task_id_comes_from_the_correlation_id_without_a_header() -> None:
    found = placement(
        {"headers": {"pgq-followable": "yes"}, "properties": {"correlation_id": "c9"}}, 1.0
    )
    assert found.task_id == "c9" and found.followable


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"pgq-ordering-key": True}, "pgq-ordering-key"),
        ({"pgq-ordering-key": "a\x00b"}, "pgq-ordering-key"),
        ({"pgq-follows": 1.5}, "pgq-follows"),
        ({"pgq-follows": "a", "pgq-follows-timeout": float("nan")}, "pgq-follows-timeout"),
        ({"pgq-follows": "a", "pgq-follows-timeout": 10**9}, "pgq-follows-timeout"),
        ({"pgq-followable": 2}, "pgq-followable"),
    ],
)
def test_unusable_headers_are_refused_by_name(headers: dict[str, Any], named: str) -> None:
    with pytest.raises(OrderingError, match=named):
        placement({"headers": {"id": "t", **headers}}, 1.0)


def test_apply_async_options_become_headers_and_a_header_wins() -> None:
    message: dict[str, Any] = {
        "headers": {"pgq-ordering-key": "given"},
        "properties": {"ordering_key": "option", "follows": "t0", "followable": None, "x": 1},
    }
    move_options(message)
    assert message["headers"] == {"pgq-ordering-key": "given", "pgq-follows": "t0"}
    assert message["properties"] == {"x": 1}


def test_a_tasks_default_key_comes_from_its_argument_by_name_or_position() -> None:
    app = Celery("ordering_defaults", set_as_current=True)

    @app.task(ordering_key="customer", followable=True)
    def hook(event: str, customer: str) -> None: ...

    @app.task(ordering_key=lambda account: f"acct-{account}")
    def ledger(account: int) -> None: ...

    @app.task(ordering_key="missing")
    def broken(x: int) -> None: ...

    for body in [(("paid",), {"customer": "c1"}, {}), (("paid", "c1"), {}, {})]:
        headers: dict[str, Any] = {}
        apply_task_defaults(sender=hook.name, body=body, headers=headers)
        assert headers == {"pgq-ordering-key": "c1", "pgq-followable": True}
    given = {"pgq-ordering-key": "mine"}
    apply_task_defaults(sender=hook.name, body=((), {"customer": "c1"}, {}), headers=given)
    assert given["pgq-ordering-key"] == "mine"
    headers = {}
    apply_task_defaults(sender=ledger.name, body=((7,), {}, {}), headers=headers)
    assert headers == {"pgq-ordering-key": "acct-7"}
    refused: dict[str, Any] = {"id": "t9"}
    apply_task_defaults(sender=broken.name, body=((1,), {}, {}), headers=refused)
    with pytest.raises(OrderingError, match="missing"):  # the publish refuses it
        placement({"headers": refused}, 300.0)


def test_a_keyed_message_may_hold_its_key_a_day_at_most() -> None:
    """Its ETA and its follows wait together: a later message of its key waits as long."""
    hold = ordering.MAX_KEY_HOLD
    keyed = placement({"headers": {"pgq-ordering-key": "k", "id": "t1"}}, 300.0)
    ordering.check_hold(keyed, hold)
    with pytest.raises(OrderingError, match=r"'k': .* at most 86400 s to run \(eta/countdown"):
        ordering.check_hold(keyed, hold + 1)
    follower = placement(
        {"headers": {"pgq-ordering-key": "k", "pgq-follows": "t0", "pgq-follows-timeout": 600}},
        300.0,
    )
    ordering.check_hold(follower, hold - 600)
    with pytest.raises(OrderingError, match=r"\+ pgq-follows-timeout 600 s"):
        ordering.check_hold(follower, hold - 599)
    # Unkeyed, any delay (a year-9999 ETA) and a year's follows wait hold no key.
    ordering.check_hold(placement({"headers": {}}, 300.0), 1e12)
    ordering.check_hold(
        placement({"headers": {"pgq-follows": "t0", "pgq-follows-timeout": 3e7}}, 300.0), 1e12
    )
