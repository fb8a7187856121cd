"""Named parts of a statement (``-- part:`` blocks): composed in at load time, checked.

A long statement (the claim) is written as named parts, each with its invariant beside
it; the server still gets one statement. What the loader must refuse is what would let a
part and its statement drift apart unnoticed: a part not defined, one that no statement
uses, one that uses itself.
"""

from __future__ import annotations

import pytest

from pg_transport.sql import load_queries
from pg_transport.sql.loader import parse_named

COMPOSED = """
-- name: outer
-- A statement made of parts.
SELECT {part:columns} FROM t WHERE {part:filter}

-- part: columns
-- Two columns.
a, b

-- part: filter
-- A part within a part.
a > 0 AND {part:also}

-- part: also
b IS NOT NULL
"""


def test_parts_are_composed_into_the_statement_that_uses_them() -> None:
    assert parse_named(COMPOSED) == {
        "outer": "SELECT a, b FROM t WHERE a > 0 AND b IS NOT NULL",
    }


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("-- name: q\nSELECT {part:nowhere}\n", "'nowhere' is not defined"),
        ("-- name: q\nSELECT 1\n-- part: spare\n2\n", "['spare'] are used by no query"),
        ("-- name: q\nSELECT {part:loop}\n-- part: loop\n{part:loop}\n", "'loop' uses itself"),
        ("-- name: q\nSELECT 1\n-- part: q\n2\n", "'q' is defined twice"),
    ],
)
def test_a_part_that_cannot_be_composed_is_refused(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        parse_named(text)


def test_the_claim_reaches_the_server_whole() -> None:
    # Every part composed in, and only statements come out of the file.
    queries = load_queries("pgq")
    assert "{part:" not in queries["claim"]
    assert not any(name.startswith("claim_") for name in queries)
    for stage in ("acked AS", "candidates AS", "gated AS", "handed AS", "picked AS"):
        assert stage in queries["claim"], stage
