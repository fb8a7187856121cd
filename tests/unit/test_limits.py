"""Flow limits as written (pg_transport.message.limits): what a rate, a burst, a
concurrency and a key may be, and the one error naming the option and the value."""

from __future__ import annotations

from typing import Any

import pytest

from pg_transport import LimitError
from pg_transport.message.limits import (
    CONCURRENCY_KEY,
    DEFAULT_REFUSED,
    Limit,
    Rate,
    check_headers,
    parse_rate,
    task_defaults,
    task_limits,
)


@pytest.mark.parametrize(
    ("text", "rate"),
    [("10/s", Rate(10, 1.0)), ("600/m", Rate(600, 60.0)), ("3600/h", Rate(3600, 3600.0)),
     ("25", Rate(25, 1.0)), (7, Rate(7, 1.0)), ("0.5/s", Rate(1, 2.0)), (" 5 / m ", Rate(5, 60.0))],
)  # fmt: skip
def test_celery_s_rate_syntax_is_read(text: Any, rate: Rate) -> None:
    assert parse_rate("pgq_rate_limit", text) == rate


@pytest.mark.parametrize(
    "text", ["ten per second", "0/s", "-3/m", "10/fortnight", "", "1e400", True, None, "nan"]
)
def test_a_bad_rate_is_refused_naming_option_and_value(text: Any) -> None:
    with pytest.raises(LimitError) as caught:
        parse_rate("pgq_rate_limit", text)
    assert str(caught.value).startswith(f"pgq_rate_limit={text!r}: ")


class FakeTask:
    name = "app.call"

    def run(self, customer_id: str, payload: dict[str, Any]) -> None: ...


def task(**attributes: Any) -> Any:
    return type("T", (FakeTask,), attributes)()


def test_a_task_s_attributes_define_one_limit_of_its_name() -> None:
    defined = task_limits(
        task(pgq_rate_limit="10/s", pgq_rate_burst=3, concurrency_key="customer_id",
             concurrency_limit=2)
    )  # fmt: skip
    assert defined == [Limit("task:app.call", Rate(10, 1.0), 3, 2)]


@pytest.mark.parametrize(
    ("attributes", "named"),
    [({"concurrency_limit": 0, "concurrency_key": "customer_id"}, "concurrency_limit=0"),
     ({"concurrency_limit": -1, "concurrency_key": "customer_id"}, "concurrency_limit=-1"),
     ({"concurrency_limit": 2.5, "concurrency_key": "customer_id"}, "concurrency_limit=2.5"),
     ({"concurrency_limit": 3}, "concurrency_limit=3 needs concurrency_key"),
     ({"pgq_rate_limit": "ten per second"}, "pgq_rate_limit='ten per second'"),
     ({"pgq_rate_limit": "5/s", "pgq_rate_burst": 0}, "pgq_rate_burst=0")],
)  # fmt: skip
def test_a_bad_task_limit_is_refused_naming_the_option(
    attributes: dict[str, Any], named: str
) -> None:
    with pytest.raises(LimitError, match=named.replace(".", r"\.")):
        task_limits(task(**attributes))


def test_a_task_s_key_argument_becomes_the_header() -> None:
    headers: dict[str, Any] = {}
    task_defaults(task(concurrency_key="customer_id"), (["c-42", {}], {}, {}), headers)
    assert headers == {CONCURRENCY_KEY: "c-42"}
    check_headers({"headers": headers})


def test_a_key_a_call_cannot_give_refuses_the_publish() -> None:
    """Celery logs what its signal receivers raise and publishes anyway: the refusal is
    carried to the publish instead, which raises it."""
    headers: dict[str, Any] = {}
    task_defaults(task(concurrency_key="customer_id"), ([], {}, {}), headers)
    assert DEFAULT_REFUSED in headers
    with pytest.raises(LimitError, match="customer_id"):
        check_headers({"headers": headers})


@pytest.mark.parametrize("key", ["", "x" * 513, 1.5, None, True])
def test_a_bad_key_header_is_refused(key: Any) -> None:
    with pytest.raises(LimitError, match=CONCURRENCY_KEY):
        check_headers({"headers": {CONCURRENCY_KEY: key}})
