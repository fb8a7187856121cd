"""AMQP topic binding keys, turned into the regular expressions Postgres routes with.

A topic exchange's binding is stored with its key as an anchored Postgres regular
expression (ARE), and the routing statement matches every publish to the exchange
against every binding's expression. One expression Postgres cannot compile therefore
breaks every later publish to that exchange, so a key is checked here, at bind time,
and what is accepted always yields a valid expression.

Semantics (AMQP 0-9-1, as RabbitMQ routes): a routing key is zero or more words
separated by ``.`` (the empty key has no words; ``a..b`` has an empty middle word).
In a binding key ``*`` stands for exactly one word and ``#`` for zero or more words;
every other word matches itself, character for character, whatever regex
metacharacters it holds. A word that mixes a wildcard with other characters (``a*``,
``**``, ``#a``) is refused: it has no meaning in AMQP, and read as a regex it is what
used to make an invalid or surprising expression.

kombu's in-memory ``TopicExchange`` differs in one respect this module does not copy:
there ``#`` needs at least one word (``a.#`` does not match ``a``).
"""

from __future__ import annotations

__all__ = ["MAX_KEY_BYTES", "InvalidBindingKey", "binding_pattern", "literal_pattern"]

#: AMQP carries a routing key as a short string: at most 255 bytes. The bound also keeps
#: the expression small enough for Postgres' regex compiler whatever the key's shape.
MAX_KEY_BYTES = 255

# The characters an ARE gives a meaning of its own outside brackets. A backslash before
# one of them stands for the character itself; a backslash before a letter or digit
# would be an escape (\d, \m, \y...), so nothing else is escaped. Embedded options and
# directors (``(?x)``, ``***=``) are only read at the very start of an expression, where
# ours always has ``^``.
_SPECIAL = frozenset("\\^$.|?*+()[]{}")
_WORD = "[^.]*"  # one word: possibly empty, never crossing a dot


class InvalidBindingKey(ValueError):
    """A topic binding key that AMQP gives no meaning to, or Postgres cannot store."""


def _literal(text: str) -> str:
    return "".join("\\" + c if c in _SPECIAL else c for c in text)


def literal_pattern(key: str) -> str:
    """An expression matching exactly ``key``: what a direct or fanout binding stores
    (their routing never reads it, but every stored expression stays a valid one)."""
    return f"^{_literal(key)}$"


def _check(key: str) -> list[str]:
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > MAX_KEY_BYTES:
        raise InvalidBindingKey(
            f"topic binding key {key[:40]!r}... is {size} bytes long; AMQP routing keys "
            f"are at most {MAX_KEY_BYTES}"
        )
    if "\x00" in key:
        raise InvalidBindingKey(f"topic binding key {key!r} holds a NUL character")
    words = key.split(".") if key else []
    for word in words:
        if word not in ("*", "#") and ("*" in word or "#" in word):
            raise InvalidBindingKey(
                f"topic binding key {key!r}: word {word!r} mixes a wildcard with other "
                "characters ('*' matches exactly one word and '#' zero or more words, "
                "each standing alone between dots)"
            )
    return words


def binding_pattern(key: str) -> str:
    """The anchored ARE that matches the routing keys a topic binding ``key`` selects.

    Raises :class:`InvalidBindingKey` for a key AMQP gives no meaning to.
    """
    words = _check(key)
    # '#.#' selects what '#' does; collapsing runs keeps the expression linear in size.
    tokens = [w for i, w in enumerate(words) if not (w == "#" and i and words[i - 1] == "#")]
    if not tokens:
        return "^$"  # the empty key: only the empty routing key, which has no words
    if tokens == ["#"]:
        return "^.*$"
    parts: list[str] = []
    rest = tokens
    if tokens[0] == "#":
        # Leading '#': zero words, or some words and the dot before the next one.
        parts.append("(?:.*\\.)?")
        rest = tokens[1:]
    first, *following = rest
    if sum(1 for t in rest if t != "#") == 1 and first in ("*", ""):
        # The one word this key needs may be empty, so the expression would match the
        # empty routing key too, which has no words at all: require a character.
        parts.insert(0, "(?=.)")
    parts.append(_WORD if first == "*" else _literal(first))
    for token in following:
        if token == "#":
            parts.append("(?:\\..*)?")  # zero words, or a dot and whole words up to the next
        elif token == "*":
            parts.append("\\." + _WORD)
        else:
            parts.append("\\." + _literal(token))
    return "^" + "".join(parts) + "$"
