"""Topic binding keys: what is refused, and what an accepted key's pattern matches.

The patterns are checked here with Python's ``re`` against a word-by-word reading of
AMQP's rules (the constructs they use mean the same in Python and in Postgres' ARE);
tests/integration/test_topic.py checks the same against Postgres itself.
"""

from __future__ import annotations

import functools
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pg_transport.message.topic import (
    MAX_KEY_BYTES,
    InvalidBindingKey,
    binding_pattern,
    literal_pattern,
)


def python(pattern: str) -> re.Pattern[str]:
    """``pattern`` as Postgres reads it: '.' also matches a line feed, and (with
    fullmatch) '$' is the end of the string, not also the place before a last line feed."""
    return re.compile(pattern, re.DOTALL)


def words(key: str) -> list[str]:
    return key.split(".") if key else []


def amqp_matches(binding: list[str], routing: list[str]) -> bool:
    """AMQP topic matching on words: '*' one word, '#' zero or more, others themselves."""

    @functools.cache
    def rest_matches(b: int, r: int) -> bool:  # binding[b:] against routing[r:]
        if b == len(binding):
            return r == len(routing)
        if binding[b] == "#":
            return any(rest_matches(b + 1, i) for i in range(r, len(routing) + 1))
        return r < len(routing) and binding[b] in ("*", routing[r]) and rest_matches(b + 1, r + 1)

    return rest_matches(0, 0)


# Short alphabets, so that generated keys and routing keys often meet.
plain_word = st.text(alphabet="ab.$^()[]{}|?+\\\n", max_size=3).filter(lambda w: "." not in w)
binding_word = st.one_of(st.just("*"), st.just("#"), plain_word)
binding_key = st.lists(binding_word, max_size=6).map(".".join)
routing_key = st.lists(plain_word, max_size=6).map(".".join)


@given(binding_key, st.lists(routing_key, min_size=1, max_size=8))
def test_patterns_match_as_amqp_words_do(binding: str, routing_keys: list[str]) -> None:
    compiled = python(binding_pattern(binding))
    for key in routing_keys:
        expected = amqp_matches(words(binding), words(key))
        assert bool(compiled.fullmatch(key)) == expected, (binding, key)


@pytest.mark.parametrize(
    ("binding", "matching", "not_matching"),
    [
        ("", [""], ["a", "."]),
        ("#", ["", "a", "a.b", ".", "a..b"], []),
        ("*", ["a", "bc"], ["", "a.b", "."]),
        ("a.#", ["a", "a.b", "a.b.c", "a."], ["", "ab", "b.a"]),
        ("#.a", ["a", "b.a", "b.c.a", ".a"], ["", "ba", "a.b"]),
        ("a.#.b", ["a.b", "a.x.b", "a.x.y.b", "a..b"], ["ab", "a.xb", "a.b.c"]),
        ("*.*", ["a.b", ".", "a."], ["a", "a.b.c", ""]),
        ("#.*", ["a", "a.b", "."], [""]),
        ("a.*.c", ["a.b.c", "a..c"], ["a.c", "a.b.b.c"]),
        ("a.b+", ["a.b+"], ["a.bb", "a.bbb"]),
        ("a|b", ["a|b"], ["a", "b"]),
        ("(x).[y]", ["(x).[y]"], ["x.y"]),
        ("$^.\\d", ["$^.\\d"], ["$^.1"]),
    ],
)
def test_named_cases(binding: str, matching: list[str], not_matching: list[str]) -> None:
    compiled = python(binding_pattern(binding))
    assert [k for k in matching if not compiled.fullmatch(k)] == []
    assert [k for k in not_matching if compiled.fullmatch(k)] == []


@pytest.mark.parametrize("word", ["a**", "**", "a*", "*a", "#a", "a#", "##", "*#", "a#b"])
def test_a_word_mixing_a_wildcard_is_refused_naming_key_and_word(word: str) -> None:
    key = f"stock.{word}.usd"
    with pytest.raises(InvalidBindingKey) as info:
        binding_pattern(key)
    message = str(info.value)
    assert repr(key) in message and repr(word) in message
    assert "mixes a wildcard with other characters" in message


def test_a_key_longer_than_amqp_allows_is_refused() -> None:
    assert binding_pattern("a" * MAX_KEY_BYTES)
    with pytest.raises(InvalidBindingKey, match="256 bytes long; AMQP routing keys are at most"):
        binding_pattern("é" * 128)  # 256 bytes in UTF-8


def test_a_nul_is_refused() -> None:
    with pytest.raises(InvalidBindingKey, match="NUL"):
        binding_pattern("a.\x00")


def test_runs_of_hash_collapse() -> None:
    assert binding_pattern("#.#.#") == binding_pattern("#")
    assert binding_pattern("a.#.#.b") == binding_pattern("a.#.b")


@given(st.text(max_size=20))
def test_literal_pattern_matches_only_itself(key: str) -> None:
    compiled = python(literal_pattern(key))
    assert compiled.fullmatch(key)
    assert not compiled.fullmatch(key + "x")
    assert not compiled.fullmatch("x" + key)
