"""A task's ordering defaults apply whichever thread sends it, whichever app is current."""

from __future__ import annotations

import re
import threading
import uuid
from typing import Any

import pytest
from celery import Celery

from pg_transport.kombu.hooks import apply_task_defaults
from pg_transport.message.ordering import (
    FOLLOWABLE,
    ORDERING_KEY,
    OrderingError,
    placement,
)


def _app(finalize: bool) -> tuple[Celery, str]:
    """An app that is not the current one, with a task of its own only (shared=False):
    found through the app that holds it, not through whichever app the calling thread
    has. Not finalized, the task is made when first used (a .delay() does that)."""
    app = Celery("pgq-ordering-defaults", broker="memory://", set_as_current=False)

    @app.task(ordering_key="customer", followable=True, shared=False)
    def charge(customer: str, amount: int = 0) -> None:
        return None

    if finalize:
        app.finalize()
    return app, str(charge.name)


def _headers_sent(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    headers: dict[str, Any] = {}
    apply_task_defaults(sender=name, body=((), kwargs, {}), headers=headers)
    return headers


@pytest.mark.parametrize("finalize", [True, False])
def test_a_task_of_an_app_that_is_not_current_gets_its_defaults(finalize: bool) -> None:
    app, name = _app(finalize)
    assert _headers_sent(name, {"customer": "c1", "amount": 3}) == {
        ORDERING_KEY: "c1",
        FOLLOWABLE: True,
    }
    assert app.finalized is finalize  # the look finalized nothing


@pytest.mark.parametrize("finalize", [True, False])
def test_a_task_sent_from_another_thread_gets_its_defaults(finalize: bool) -> None:
    _app_kept, name = _app(finalize)
    seen: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: seen.append(_headers_sent(name, {"customer": "c2"})))
    thread.start()
    thread.join()
    assert seen == [{ORDERING_KEY: "c2", FOLLOWABLE: True}]


def test_a_header_the_call_gave_wins() -> None:
    _app_kept, name = _app(True)
    headers: dict[str, Any] = {ORDERING_KEY: "given", FOLLOWABLE: False}
    apply_task_defaults(sender=name, body=((), {"customer": "c3"}, {}), headers=headers)
    assert headers == {ORDERING_KEY: "given", FOLLOWABLE: False}


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"customer": uuid.UUID(int=7)}, "must be a string (or an integer), not UUID"),
        ({"customer": "x" * 2000}, "must be 1 to 1024 bytes"),
        ({"amount": 1}, "ordering_key names argument 'customer', which this call does not pass"),
    ],
)
def test_a_call_that_gives_no_usable_key_is_refused_at_publish(
    kwargs: dict[str, Any], why: str
) -> None:
    # Celery logs what a before_task_publish receiver raises and publishes anyway: the
    # receiver says why in the headers, and the publish (placement) refuses the message.
    _app_kept, name = _app(True)
    headers = _headers_sent(name, kwargs)
    assert ORDERING_KEY not in headers
    with pytest.raises(OrderingError, match=re.escape(why)):
        placement({"headers": headers}, 300.0)


@pytest.mark.parametrize("finalize", [True, False])
def test_a_key_callable_is_called_with_the_call_s_arguments(finalize: bool) -> None:
    # Given to @app.task, the callable becomes a class attribute of the task: called as
    # a function of the call's arguments, not as a method of the task.
    app = Celery("pgq-ordering-callable", broker="memory://", set_as_current=False)

    def key(customer: str, amount: int = 0, **kw: Any) -> str:
        return kw["tenant"] + "/" + customer

    @app.task(name="pgq-test.ordering.keyed-by-callable", ordering_key=key, shared=False)
    def charge(customer: str, amount: int = 0, **kw: Any) -> None:
        return None

    if finalize:
        app.finalize()
    name = str(charge.name)
    assert _headers_sent(name, {"customer": "c1", "tenant": "t"}) == {ORDERING_KEY: "t/c1"}
    headers: dict[str, Any] = {}
    apply_task_defaults(sender=name, body=(["c2", 5], {"tenant": "u"}, {}), headers=headers)
    assert headers == {ORDERING_KEY: "u/c2"}
    # One that raises (no tenant) refuses the publish.
    with pytest.raises(OrderingError, match="ordering_key raised KeyError"):
        placement({"headers": _headers_sent(name, {"customer": "c1"})}, 300.0)
