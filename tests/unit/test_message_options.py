"""The one move of apply_async's options into headers, and the one look-up of a key a
task attribute names, that ordering, limits, unique tasks and fair share share
(pg_transport/message/options.py)."""

from __future__ import annotations

from typing import Any

import pytest

from pg_transport.errors import LimitError
from pg_transport.message import fair, limits, options, ordering, unique
from pg_transport.message.ordering import OrderingError


def test_options_move_into_the_headers_a_header_wins_and_none_is_dropped() -> None:
    table = {"a_key": "pgq-a", "b_key": "pgq-b", "c_key": "pgq-c"}
    message: dict[str, Any] = {
        "properties": {"a_key": "x", "b_key": None, "c_key": "new", "other": 1},
        "headers": {"pgq-c": "kept"},
    }
    options.move_options(message, table)
    assert message == {"properties": {"other": 1}, "headers": {"pgq-a": "x", "pgq-c": "kept"}}
    bare: dict[str, Any] = {"properties": {"a_key": "x"}}
    options.move_options(bare, table)
    assert bare == {"properties": {}, "headers": {"pgq-a": "x"}}
    untouched: dict[str, Any] = {"properties": {"other": 1}}
    options.move_options(untouched, table)
    assert untouched == {"properties": {"other": 1}}  # no headers made for nothing
    options.move_options({"properties": None}, table)  # nothing to move: no error


@pytest.mark.parametrize(
    ("module", "option", "header"),
    [
        (ordering, "ordering_key", ordering.ORDERING_KEY),
        (limits, "concurrency_key", limits.CONCURRENCY_KEY),
        (unique, "unique_key", unique.UNIQUE_KEY),
        (fair, "fair_key", fair.FAIR_KEY),
    ],
)
def test_each_feature_moves_its_own_options(module: Any, option: str, header: str) -> None:
    message: dict[str, Any] = {"properties": {option: "k", "unrelated": 2}}
    module.move_options(message)
    assert message == {"properties": {"unrelated": 2}, "headers": {header: "k"}}


class Task:
    name = "app.charge"

    def run(self, customer: str, amount: int = 0) -> None: ...


@pytest.mark.parametrize(
    "error", [OrderingError, LimitError, unique.UniqueError, fair.FairKeyError]
)
def test_a_key_is_an_argument_or_what_a_callable_makes_of_them(error: type[Exception]) -> None:
    task = Task()
    assert options.key_of(task, "k", "customer", ["acme"], {}, error) == "acme"
    assert options.key_of(task, "k", "customer", [], {"customer": "b"}, error) == "b"
    assert options.key_of(task, "k", "amount", ["acme", 5], {}, error) == 5
    assert options.key_of(task, "k", lambda c, a=0: f"{c}/{a}", ["x"], {"a": 2}, error) == "x/2"
    with pytest.raises(error, match="k names argument 'amount', which this call does not pass"):
        options.key_of(task, "k", "amount", ["acme"], {}, error)
    with pytest.raises(error, match="k names argument 'customer'"):
        options.key_of(task, "k", "customer", ["a", 1, "too many"], {}, error)
    with pytest.raises(error, match=r"k=5 must name an argument or be callable"):
        options.key_of(task, "k", 5, [], {}, error)
