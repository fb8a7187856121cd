"""pgq's own text for statement parameters means, to the server, what psycopg's does.

The checks of each kind of value send it twice to real Postgres, once as
``params.render`` writes it and once as psycopg's dumper does, both cast to the type the
statement gives it, and ask the server whether they are the same value (``IS NOT
DISTINCT FROM``). The rest check what is left to psycopg, and what cannot be sent.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.adapt import PyFormat, Transformer

from pg_transport.db.params import Text, render
from pg_transport.db.wire import Statement

BIGINT = st.integers(min_value=-(2**63), max_value=2**63 - 1)
FLOAT = st.floats(allow_nan=False, allow_infinity=False)
# Text Postgres can hold: anything but NUL and lone surrogates (see the tests of both).
TEXT = st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)))
TRICKY = ["", "NULL", "null", " spaced ", '"', "\\", '\\"', "a,b", "{x}", "é ☃ 𝄞", "\t\n"]


@pytest.fixture(scope="module")
def conn(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        yield conn


def psycopg_text(conn: psycopg.Connection[Any], value: Any) -> Text:
    return Transformer(conn).dump_sequence([value], [PyFormat.TEXT])[0]


def same_on_server(conn: psycopg.Connection[Any], value: Any, pg_type: str) -> bool:
    ours = render([value], lambda v: pytest.fail(f"{v!r} was left to psycopg"))[0]
    query = f"SELECT $1::{pg_type} IS NOT DISTINCT FROM $2::{pg_type}".encode()
    result = conn.pgconn.exec_params(query, [ours, psycopg_text(conn, value)])
    assert result.status == psycopg.pq.ExecStatus.TUPLES_OK, result.error_message
    return result.get_value(0, 0) == b"t"


_settings = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_settings
@given(value=BIGINT)
def test_an_int(conn: psycopg.Connection[Any], value: int) -> None:
    assert same_on_server(conn, value, "bigint")


@_settings
@given(value=FLOAT)
def test_a_finite_float(conn: psycopg.Connection[Any], value: float) -> None:
    assert same_on_server(conn, value, "float8")


@_settings
@given(value=TEXT)
def test_a_string(conn: psycopg.Connection[Any], value: str) -> None:
    assert same_on_server(conn, value, "text")


@_settings
@given(values=st.lists(BIGINT, max_size=20))
def test_an_array_of_ints(conn: psycopg.Connection[Any], values: list[int]) -> None:
    assert same_on_server(conn, values, "bigint[]")


@_settings
@given(values=st.lists(FLOAT, max_size=20))
def test_an_array_of_floats(conn: psycopg.Connection[Any], values: list[float]) -> None:
    assert same_on_server(conn, values, "float8[]")


@_settings
@given(values=st.lists(st.one_of(TEXT, st.sampled_from(TRICKY)), max_size=20))
def test_an_array_of_strings(conn: psycopg.Connection[Any], values: list[str]) -> None:
    assert same_on_server(conn, values, "text[]")


@pytest.mark.parametrize("value", [True, False])
def test_a_bool(conn: psycopg.Connection[Any], value: bool) -> None:
    assert same_on_server(conn, value, "boolean")


def test_strings_that_look_like_null_stay_strings(conn: psycopg.Connection[Any]) -> None:
    text = render([TRICKY], pytest.fail)[0]
    result = conn.pgconn.exec_params(b"SELECT array_position($1::text[], NULL)", [text])
    assert result.get_value(0, 0) is None  # no element came out NULL
    result = conn.pgconn.exec_params(b"SELECT ($1::text[])[2], ($1::text[])[3]", [text])
    assert (result.get_value(0, 0), result.get_value(0, 1)) == (b"NULL", b"null")


def test_null() -> None:
    assert render([None], pytest.fail) == [None]


class Colour(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    "value",
    [
        Decimal("1.5"),
        float("inf"),
        float("nan"),
        [1.0, float("inf")],
        [1, "a"],
        [[1, 2]],
        [True, False],
        [1, None],
        Colour.RED,
        [Colour.RED],
        {"a": 1},
        "a\x00b",
        ["a\x00b"],
    ],
    ids=repr,
)
def test_what_it_does_not_write_is_left_to_psycopg(value: Any) -> None:
    left: list[Any] = []
    assert render([1, value, "x"], lambda v: left.append(v) or b"fallback") == [
        b"1",
        b"fallback",
        b"x",
    ]
    assert left == [value]


def test_a_statement_sends_what_is_left_to_psycopg_as_psycopg_does(
    conn: psycopg.Connection[Any],
) -> None:
    statement = Statement("params_probe", "SELECT %(n)s::numeric, %(xs)s::float8[], %(s)s")
    rows = statement.execute(
        conn, {"n": Decimal("1.25"), "xs": [1.5, float("inf")], "s": "ok"}, prepare=False
    )
    assert rows == [(b"1.25", b"{1.5,Infinity}", b"ok")]


def test_a_nul_in_a_string_is_psycopg_s_error_not_a_truncated_value(
    conn: psycopg.Connection[Any],
) -> None:
    statement = Statement("params_nul", "SELECT %(s)s::text[]")
    with pytest.raises(psycopg.DataError, match="NUL"):
        statement.execute(conn, {"s": ["ok", "a\x00b"]}, prepare=False)


@pytest.mark.parametrize("value", ["\ud800", ["ok", "\udfff"]], ids=repr)
def test_a_lone_surrogate_is_the_same_error_as_psycopg_s(
    conn: psycopg.Connection[Any], value: Any
) -> None:
    with pytest.raises(UnicodeEncodeError) as ours:
        render([value], pytest.fail)
    with pytest.raises(UnicodeEncodeError) as theirs:
        psycopg_text(conn, value)

    def offending(error: UnicodeEncodeError) -> tuple[str, str]:
        return error.reason, error.object[error.start : error.end]

    assert offending(ours.value) == offending(theirs.value)


def test_a_connection_not_in_utf8_gets_psycopg_s_text(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as latin:
        latin.execute("SET client_encoding TO 'LATIN1'")
        # (the query's own text goes as UTF-8 whatever the session's encoding: ASCII only)
        statement = Statement(
            "params_latin", "SELECT %(s)s::text = chr(233) || ' ' || chr(252), %(xs)s::text[]"
        )
        rows = statement.execute(latin, {"s": "é ü", "xs": ["é"]}, prepare=True)
    assert rows == [(b"t", "{é}".encode("latin-1"))]
