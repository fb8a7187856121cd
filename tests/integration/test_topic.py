"""Topic binding patterns compiled and matched by Postgres itself, as publish_routed does.

tests/unit/test_topic.py checks the patterns with Python's engine; what routes is
Postgres' ARE engine, so here every accepted key's pattern must compile there, and
match exactly the routing keys AMQP's word rules select.
"""

from __future__ import annotations

import string
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pg_transport.message.topic import MAX_KEY_BYTES, binding_pattern, literal_pattern
from tests.unit.test_topic import amqp_matches, words

# Any character Postgres text can hold, with the regex-significant ones often.
any_char = st.characters(exclude_characters="\x00.", codec="utf-8")
word = st.text(st.one_of(st.sampled_from("ab\\^$|?*+()[]{}#\n"), any_char), max_size=3)
plain_word = word.filter(lambda w: "*" not in w and "#" not in w)
binding_key = st.lists(st.one_of(st.just("*"), st.just("#"), plain_word), max_size=6)
routing_key = st.lists(plain_word, max_size=6).map(".".join)


@pytest.fixture(scope="module")
def pg(pg_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        yield conn


def matched(pg: psycopg.Connection[Any], pattern: str, keys: list[str]) -> list[bool]:
    """Whether each key matches ``pattern``, as publish_routed tests it (key ~ pattern)."""
    rows = pg.execute(
        "SELECT k ~ %s FROM unnest(%s::text[]) WITH ORDINALITY AS t(k, n) ORDER BY n",
        [pattern, keys],
    ).fetchall()
    return [bool(r[0]) for r in rows]


@settings(max_examples=300, deadline=None)
@given(binding_key, st.lists(routing_key, min_size=1, max_size=10))
def test_postgres_matches_as_amqp_words_do(
    pg: psycopg.Connection[Any], binding_words: list[str], keys: list[str]
) -> None:
    binding = ".".join(binding_words)
    pattern = binding_pattern(binding)
    # Some keys made from the binding itself, so that matches are not all by chance.
    keys = [*keys, binding.replace("*", "x").replace("#", "y.z"), binding.replace("#", "")]
    expected = [amqp_matches(words(binding), words(k)) for k in keys]
    assert matched(pg, pattern, keys) == expected, (binding, pattern)


def test_every_ascii_character_in_a_word_is_literal(pg: psycopg.Connection[Any]) -> None:
    for c in (string.punctuation + string.whitespace + "\x01\x7f").replace(".", ""):
        if c in "*#":
            continue
        key = f"a{c}b.{c}"
        # b and the letter-after-backslash cases catch an escape read as \b, \d, \y...
        others = [key.replace(c, ""), "axb.x", f"a{c}{c}b.{c}", f"a{c}b.{c}{c}", "ab.b"]
        assert matched(pg, binding_pattern(key), [key, *others]) == [True] + [False] * 5, c
        assert matched(pg, literal_pattern(key), [key, *others]) == [True] + [False] * 5, c


@pytest.mark.parametrize("unit", ["*.", "#.a.", "a.#.*.", "\\.", "[.", "é."])
def test_the_longest_keys_compile_and_match(pg: psycopg.Connection[Any], unit: str) -> None:
    # At the length limit, in the shapes that make the longest patterns.
    key = unit * (MAX_KEY_BYTES // len(unit.encode()))
    key = key[:-1] if key.endswith(".") else key
    assert len(key.encode()) <= MAX_KEY_BYTES
    routing = key.replace("*", "w").replace("#", "v")
    expected = amqp_matches(words(key), words(routing))
    assert matched(pg, binding_pattern(key), [routing, routing + ".x"]) == [
        expected,
        amqp_matches(words(key), words(routing + ".x")),
    ]
