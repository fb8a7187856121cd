"""The pgq command without a database: its shape, and errors caught before connecting."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from pg_transport.ops.cli import main
from pg_transport.ops.terminal import printable, quoted


def invoke(*args: str) -> Result:
    # No PGQ_* from the developer's shell may change what a test sees.
    env = {name: None for name in ("PGQ_URL", "PGQ_SCHEMA")}
    return CliRunner(env=env).invoke(main, list(args))


def test_help_lists_the_commands_implemented_so_far() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("migrate", "purge", "demo"):
        assert command in result.output


@pytest.mark.parametrize("command", [["migrate"], ["purge", "celery"], ["demo"]])
def test_every_command_takes_url(command: list[str]) -> None:
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert "--url" in result.output and "PGQ_URL" in result.output
    assert "--schema" in result.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["migrate", "--url", "postgres://x/db"], "malformed broker URL"),
        (["purge", "q", "--url", "http://h/db"], "malformed broker URL"),
        (["migrate", "--url", "pgq://h/db?nonsense=1"], "malformed broker URL"),
        (["migrate", "--url", "pgq://h/db", "--schema", "no-dashes"], "schema='no-dashes'"),
        (["demo", "--url", "pgq://h/db", "--schema", "a b"], "schema='a b'"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(args: list[str], expected: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and expected in lines[0]


def test_password_never_printed() -> None:
    result = invoke("migrate", "--url", "pgq://u:s3cret@h/db?bogus=1")
    assert result.exit_code == 1
    assert "s3cret" not in result.stderr


# -- values from rows, printed -------------------------------------------------------
HOSTILE = "a\x1b[31mred\x1b]0;title\x07\rover\x08\u202eevil\u2066\x9b\u2028\ud800\tb\nc"


def test_printable_escapes_every_control_format_and_separator_character() -> None:
    shown = printable(HOSTILE)
    assert shown == (
        "a\\x1b[31mred\\x1b]0;title\\x07\\rover\\x08\\u202eevil\\u2066\\x9b\\u2028\\ud800\\tb\\nc"
    )
    assert shown.isprintable()
    assert printable(shown) == shown  # escaping twice changes nothing


@pytest.mark.parametrize(
    "text",
    ["jobs", "reports.daily", "ünï cödé", "日本語 queue", "a\\x1b", "emoji \U0001f600", 'say "hi"'],
)
def test_printable_leaves_ordinary_text_alone(text: str) -> None:
    assert printable(text) == text
    assert quoted(text) == f"'{text}'"
