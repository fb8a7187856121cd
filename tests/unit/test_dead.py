"""`pgq dead` and `pgq status` without a database: durations, shape, errors before connecting."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from pg_transport.errors import ConfigurationError
from pg_transport.ops.cli import main
from pg_transport.ops.dead import import_app, parse_duration

# Never contacted: every case below fails before connecting.
NOWHERE = "pgq://nobody@host.invalid/db"


def invoke(*args: str) -> Result:
    env = {name: None for name in ("PGQ_URL", "PGQ_SCHEMA")}
    return CliRunner(env=env).invoke(main, list(args))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("30m", 1800),
        ("12h", 43200),
        ("7d", 604800),
        ("2w", 1209600),
        ("1h30m", 5400),
        ("1.5h", 5400),
        (" 7D ", 604800),
        ("0s", 0),
    ],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7", "d", "7x", "7 d", "-7d", "7d!", "d7", "1h 30m"])
def test_bad_durations_name_the_value_and_the_form(text: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_duration(text)
    assert str(info.value).startswith(f"bad duration {text!r}: expected a number and a unit")


def test_help_lists_status_and_the_dead_commands() -> None:
    assert "status" in invoke("--help").output
    dead = invoke("dead", "--help")
    assert dead.exit_code == 0
    for command in ("list", "requeue", "purge", "rehook"):
        assert command in dead.output


@pytest.mark.parametrize(
    "command",
    [["status"], ["dead", "list"], ["dead", "requeue"], ["dead", "purge"], ["dead", "rehook", "1"]],
)
def test_every_command_takes_url_and_schema(command: list[str]) -> None:
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert "--url" in result.output and "PGQ_URL" in result.output
    assert "--schema" in result.output and "PGQ_SCHEMA" in result.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["dead", "purge", "--older-than", "soon", "--url", NOWHERE], "bad duration 'soon'"),
        (["dead", "list", "--url", "postgres://h/db"], "malformed broker URL"),
        (["status", "--url", NOWHERE, "--schema", "no-dashes"], "schema='no-dashes'"),
        (
            ["dead", "rehook", "1", "-A", "pgq_no_such_app_module", "--url", NOWHERE],
            "cannot import app module 'pgq_no_such_app_module'",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_1(args: list[str], expected: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and expected in lines[0]


@pytest.mark.parametrize(
    "args", [[], ["3", "--all"], ["--queue", "q"], ["3", "--queue", "q"], ["x"]]
)
def test_requeue_usage_errors_exit_2(args: list[str]) -> None:
    result = invoke("dead", "requeue", *args, "--url", NOWHERE)
    assert result.exit_code == 2
    assert "Traceback" not in result.output


def test_import_app_takes_module_or_module_colon_attribute() -> None:
    import_app("pg_transport.signals:app")  # the attribute is never looked up
    with pytest.raises(ConfigurationError, match="bad --app ':app'"):
        import_app(":app")
