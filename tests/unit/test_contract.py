"""The public names the design contract promises, importable as it writes them."""

from __future__ import annotations

import pytest

ERRORS = [
    "TransactionRefused",
    "PoolerDetected",
    "NotPermitted",
    "MessageTooLarge",
    "OrderingError",
    "ConfigurationError",
]


@pytest.mark.parametrize("name", ERRORS)
def test_each_contract_error_is_importable_from_pg_transport(name: str) -> None:
    import pg_transport

    error = getattr(pg_transport, name)
    assert issubclass(error, pg_transport.PgqError)
    assert name in pg_transport.__all__


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("pg_transport", ["identity", "signals", "batch", "transaction"]),
        ("pg_transport.signals", ["message_poisoned"]),
        ("pg_transport.identity", ["register"]),
        ("barrier", ["Barrier", "TRANSPORT_MARKER", "barrier_callback"]),
        ("pg_transport.integrations.django", ["join_atomic"]),
    ],
)
def test_the_contract_s_other_names(module: str, names: list[str]) -> None:
    # As ``from <module> import <names>`` does (a submodule such as identity included).
    found = __import__(module, fromlist=names)
    for name in names:
        assert getattr(found, name) is not None, (module, name)


def test_the_transport_marker_is_as_the_contract_writes_it() -> None:
    from barrier import TRANSPORT_MARKER

    assert TRANSPORT_MARKER == "_pg_transport"
