"""Every ``PGQ_*`` name pgq reads is one the misspelling warning knows.

The transport's configuration keeps the names the result backend, the barrier, beat,
health and the ``pgq`` command read in a list of its own (it must not import them);
a setting added there and not to the list would be warned about as a misspelling while
it works. The names are derived here from what reads them, and each is shown to be read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from typing import Any

import click
import pytest

from pg_transport.beat.settings import BeatSettings
from pg_transport.config import unknown_environment
from pg_transport.errors import ConfigurationError
from pg_transport.fanin.settings import BarrierSettings
from pg_transport.ops import health
from pg_transport.ops.cli import main
from pg_transport.results.options import ResultOptions

NOT_A_VALUE = "not a value!"


def read_by_fields(cls: Any, prefix: str, read: Callable[[Mapping[str, str]], object]) -> list[str]:
    """``prefix`` + each field's name, upper-cased: the environment names ``cls`` reads,
    each shown to be read (a value that is not one is refused, naming the variable)."""
    names = [prefix + field.name.upper() for field in fields(cls)]
    for name in names:
        with pytest.raises(ConfigurationError, match=name):
            read({name: NOT_A_VALUE})
    return names


def cli_envvars(command: click.Command) -> Iterator[str]:
    for param in command.params:
        envvars = [param.envvar] if isinstance(param.envvar, str) else param.envvar or []
        yield from envvars
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            yield from cli_envvars(sub)


def test_the_result_backends_names_are_known() -> None:
    names = read_by_fields(
        ResultOptions, "PGQ_RESULT_", lambda env: ResultOptions.from_sources({}, env)
    )
    assert len(names) >= 6
    assert unknown_environment(dict.fromkeys(names, "1")) == []


def test_the_barriers_names_are_known() -> None:
    names = read_by_fields(
        BarrierSettings, "PGQ_BARRIER_", lambda env: BarrierSettings.from_sources({}, env)
    )
    assert len(names) >= 3
    assert unknown_environment(dict.fromkeys(names, "1")) == []


def test_beats_names_are_known() -> None:
    names = read_by_fields(
        BeatSettings, "PGQ_BEAT_", lambda env: BeatSettings.from_sources({}, env)
    )
    assert unknown_environment(dict.fromkeys(names, "1")) == []


def test_health_and_the_commands_names_are_known() -> None:
    names = {health.FILE_ENV, health.STALE_ENV, *cli_envvars(main)}
    assert {"PGQ_URL", "PGQ_SCHEMA", "PGQ_HEALTH_FILE"} <= names
    assert unknown_environment(dict.fromkeys(names, "1")) == []


def test_a_name_nothing_reads_is_still_unknown() -> None:
    # The checks above would pass if unknown_environment knew every PGQ_RESULT_* name.
    assert unknown_environment({"PGQ_RESULT_NOT_AN_OPTION": "1"}) != []
    assert unknown_environment({"PGQ_BARRIER_NOT_A_SETTING": "1"}) != []
