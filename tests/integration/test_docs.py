"""docs/*.md say only what pgq does: their commands, options, variables and SQL are checked.

- Every `pgq …` line of a fenced ``sh`` block is parsed by the real command-line
  interface (options, arguments, choices): a renamed option or a typo fails here.
- Those that are safe to run are run, in order, against a test schema: URLs in them are
  replaced by the test server's, `--schema` is set. Not run: `pgq metrics --serve` (it
  serves until stopped; tests/integration/test_metrics.py serves), `pgq demo`
  (tests/acceptance/test_demo.py), `pgq health` (tests/acceptance/test_compose.py),
  `pgq dead rehook` (it needs the user's hook module; tests/integration/test_cli_dead.py),
  `pgq web` (it serves until stopped; tests/acceptance/test_web.py drives it in a browser).
  Commands naming dead-letter ids run against rows the test creates under those ids.
- `PGQ_*=value` assignments in shell lines must be accepted by config.py.
- configuration.md lists every option with its default and every variable pgq reads.
- The autoscaling queries of monitoring.md run against a known queue state and agree
  with `pgq status`; the KEDA example embeds the same queries.
- The Redis-only options migrating.md says to remove are refused by config.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import psycopg
import pytest
from psycopg import sql

from pg_transport.config import KOMBU_KEYS, Options
from pg_transport.db.pool import Connector
from pg_transport.errors import ConfigurationError
from pg_transport.ops.cli import main
from pg_transport.store import Store
from tests.integration.conftest import Peek
from tests.integration.test_cli import invoke
from tests.unit.test_compose import cli_envvars, config_scalar_envvars

DOCS = Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
NOT_RUN = {("demo",), ("health",), ("dead", "rehook"), ("web",)}


def doc_files() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def blocks(path: Path, language: str) -> list[str]:
    return [
        body for lang, body in FENCE.findall(path.read_text(encoding="utf-8")) if lang == language
    ]


def sql_blocks(path: Path) -> list[str]:
    return blocks(path, "sql")


def shell_lines(path: Path) -> Iterator[str]:
    for body in blocks(path, "sh"):
        for line in body.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                yield line.strip()


def pgq_lines(path: Path) -> list[list[str]]:
    """``pgq …`` invocations of a page, as argv (a leading VAR=value prefix dropped)."""
    found = []
    for line in shell_lines(path):
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]
        if words[:1] == ["pgq"]:
            found.append(words[1:])
    return found


def resolve(args: list[str]) -> tuple[list[str], click.Command, list[str]]:
    """The command path, the click command, and the rest of the arguments."""
    command: click.Command = main
    path: list[str] = []
    rest = list(args)
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        sub = command.get_command(click.Context(command), rest[0])
        assert sub is not None, f"no command `pgq {' '.join(path + rest[:1])}`"
        command, path, rest = sub, [*path, rest[0]], rest[1:]
    return path, command, rest


def test_the_docs_show_pgq_commands() -> None:
    pages = {p.name: pgq_lines(p) for p in doc_files()}
    shown = {tuple(resolve(args)[0]) for lines in pages.values() for args in lines}
    # Every operator command appears somewhere in the docs.
    for expected in [
        ("migrate",),
        ("status",),
        ("delayed",),
        ("metrics",),
        ("purge",),
        ("dead", "list"),
        ("dead", "requeue"),
        ("dead", "purge"),
        ("dead", "rehook"),
        ("health",),
        ("schedule", "add"),
        ("schedule", "list"),
        ("schedule", "disable"),
        ("schedule", "enable"),
        ("schedule", "remove"),
    ]:
        assert expected in shown, f"`pgq {' '.join(expected)}` is not documented"


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: p.name)
def test_every_pgq_line_parses(page: Path) -> None:
    for args in pgq_lines(page):
        path, command, rest = resolve(args)
        try:
            with command.make_context(
                " ".join(["pgq", *path]), list(rest), resilient_parsing=False
            ):
                pass
        except click.UsageError as exc:
            raise AssertionError(f"{page.name}: `pgq {shlex.join(args)}`: {exc}") from exc


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: p.name)
def test_environment_assignments_are_accepted(page: Path) -> None:
    for line in shell_lines(page):
        for name, value in re.findall(r"\b(PGQ_[A-Z0-9_]+)=(\S+)", line):
            if name in cli_envvars():
                continue
            Options.from_sources(None, {name: value})  # raises on a name or value it refuses


def _substituted(args: list[str], url: str, schema: str) -> list[str]:
    out: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
            continue
        if word in ("--url", "--schema"):
            skip = True
            continue
        out.append(word)
    return [*out, "--url", url, "--schema", schema]


def runnable(args: list[str]) -> bool:
    path, _, rest = resolve(args)
    return tuple(path) not in NOT_RUN and not (path == ["metrics"] and "--serve" in rest)


def _ids(args: list[str]) -> list[int]:
    path, _, rest = resolve(args)
    return [int(w) for w in rest if w.isdigit()] if path == ["dead", "requeue"] else []


@pytest.mark.parametrize("page", doc_files(), ids=lambda p: p.name)
def test_safe_commands_run_against_a_test_schema(
    page: Path, broker_url: str, schema: str, pg_url: str
) -> None:
    lines = [args for args in pgq_lines(page) if runnable(args)]
    if not lines:
        pytest.skip(f"{page.name} shows no pgq command that runs here")
    assert invoke("migrate", "--url", broker_url, "--schema", schema).exit_code == 0
    ran = 0
    for args in lines:
        for dead_id in _ids(args):
            _dead_letter_with_id(pg_url, schema, dead_id)
        for queue in _purged(args):
            _declared(pg_url, schema, queue)  # purging a queue that does not exist fails
        result = invoke(*_substituted(args, broker_url, schema))
        assert result.exit_code == 0, f"{page.name}: `pgq {shlex.join(args)}`:\n{result.output}"
        ran += 1
    assert ran == len(lines)


def _purged(args: list[str]) -> list[str]:
    path, _, rest = resolve(args)
    return [w for w in rest if not w.startswith("-")][:1] if path == ["purge"] else []


def _declared(pg_url: str, schema: str, queue: str) -> None:
    connector = Connector(pg_url)
    try:
        Store(connector, schema).declare_queue(queue)
    finally:
        connector.close()


def _dead_letter_with_id(pg_url: str, schema: str, dead_id: int) -> None:
    """A dead-letter row with a given id (docs show ids like 42), for requeue to find."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.dead_letter"
                " (id, message_id, queue, read_ct, enqueued_at, reason, payload)"
                " OVERRIDING SYSTEM VALUE"
                " VALUES (%s, 0, 'docs', 5, now(), 'docs example', '{{}}')"
            ).format(sql.Identifier(schema)),
            [dead_id],
        )


# -- configuration.md --------------------------------------------------------------------


def test_configuration_lists_every_option_default_and_variable() -> None:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    defaults = Options()
    for f in dataclasses.fields(Options):
        if f.name.startswith("env_"):
            continue
        row = re.search(rf"^\| `{f.name}` \| `([^`]*)` \|", text, re.MULTILINE)
        assert row, f"configuration.md has no row for `{f.name}`"
        shown, value = row.group(1), getattr(defaults, f.name)
        if value is None:  # unset unless given
            assert shown == "none", f.name
        elif isinstance(value, bool):
            assert shown == str(value).lower(), f.name
        elif isinstance(value, (int, float)):
            assert float(shown) == value, f.name
        elif isinstance(value, str):
            assert shown == value, f.name
        else:
            assert shown == "{}" and dict(value) == {}, f.name
    for name in config_scalar_envvars() | cli_envvars():
        assert f"`{name}`" in text, f"configuration.md does not mention {name}"
    for name in ("PGQ_VISIBILITY_TIMEOUT_<QUEUE>", "PGQ_MAX_ATTEMPTS_<QUEUE>"):
        assert f"`{name}`" in text
    for key in KOMBU_KEYS:
        assert f"`{key}`" in text, f"configuration.md does not list kombu's {key}"
    # The worked example is what config.py computes.
    assert "`reports.daily` is `PGQ_VISIBILITY_TIMEOUT_REPORTS_DAILY`" in text
    opts = Options.from_sources(None, {"PGQ_VISIBILITY_TIMEOUT_REPORTS_DAILY": "600"})
    assert opts.visibility_timeout_for("reports.daily") == 600


def test_migrating_names_only_options_pgq_refuses() -> None:
    text = (DOCS / "migrating.md").read_text(encoding="utf-8")
    table = text.split("| Redis option | on pgq |", 1)[1].split("\n\n", 1)[0]
    removed = [
        key
        for row in table.splitlines()
        if "| remove" in row
        for key in re.findall(r"`(\w+)`", row.split("|")[1])
    ]
    assert len(removed) >= 8
    for key in removed:
        with pytest.raises(ConfigurationError, match="unknown pgq transport option"):
            Options.from_sources({key: 1}, {})
    Options.from_sources({"visibility_timeout": 60}, {})  # the one Redis option kept


# -- monitoring.md: the autoscaling queries -----------------------------------------------


def autoscaling_queries() -> dict[str, str]:
    """monitoring.md's SQL blocks by their first comment: 'depth' and 'age'."""
    found = {}
    for block in sql_blocks(DOCS / "monitoring.md"):
        first = block.splitlines()[0]
        kind = "depth" if first.startswith("-- depth") else "age" if "age" in first else None
        assert kind, f"unexpected SQL block in monitoring.md: {first}"
        found[kind] = "\n".join(line for line in block.splitlines() if not line.startswith("--"))
    assert set(found) == {"depth", "age"}
    return found


def for_queue(query: str, schema: str, queue: str) -> sql.Composed:
    """A documented query with its schema and queue replaced (composed, not pasted)."""
    assert query.count("pgq.message") == 1 and query.count("'default'") == 1
    template = query.replace("pgq.message", "{schema}.message").replace("'default'", "{queue}")
    return sql.SQL(template).format(schema=sql.Identifier(schema), queue=sql.Literal(queue))


def message(n: int) -> dict[str, Any]:
    return {"body": f"m{n}", "properties": {}, "headers": {}}


def test_autoscaling_queries_agree_with_pgq_status(
    broker_url: str, schema: str, store: Store, peek: Peek, pg_url: str
) -> None:
    for n in range(3):
        store.publisher.publish("default", message(n))
    store.publisher.publish("default", message(3), delay=3600)  # delayed: not ready
    store.claim(["default"], [300.0], 1)  # m0 in flight: not ready
    store.publisher.publish("other", message(4))

    def ready_since(body: str, seconds: int) -> None:
        peek(
            "UPDATE {schema}.message SET visible_at = now() - make_interval(secs => %s)"
            " WHERE payload->>'body' = %s",
            seconds,
            body,
        )

    def status() -> dict[str, Any]:
        out = invoke("status", "--json", "--url", broker_url, "--schema", schema).stdout
        return {q["queue"]: q for q in json.loads(out)["queues"]}

    queries = autoscaling_queries()
    with psycopg.connect(pg_url, autocommit=True) as conn:

        def scalar(kind: str, queue: str) -> Any:
            rows = conn.execute(for_queue(queries[kind], schema, queue)).fetchall()
            assert len(rows) == 1 and len(rows[0]) == 1, "KEDA needs one row, one column"
            return rows[0][0]

        # FIFO: the head (m1) is the oldest ready message: the age is status's figure.
        ready_since("m1", 120)
        ready_since("m2", 90)
        figures = status()["default"]
        assert scalar("depth", "default") == figures["ready"] == 2
        age = scalar("age", "default")
        assert isinstance(age, int)
        assert abs(age - figures["oldest_ready_age_s"]) < 2  # seconds tick apart
        assert 120 <= age < 180
        # Claims go by the time a message became visible (a redelivered or just-due
        # one waits its turn): with one priority the head is always the oldest ready
        # message, as monitoring.md says.
        ready_since("m1", 5)
        age = scalar("age", "default")
        assert 90 <= age < 150
        assert abs(age - status()["default"]["oldest_ready_age_s"]) < 2
        # A higher priority goes first.
        store.publisher.publish("default", message(5), priority=9)
        assert scalar("age", "default") <= 1
        assert scalar("depth", "default") == 3
        assert (scalar("depth", "idle"), scalar("age", "idle")) == (0, 0)
        assert scalar("depth", "other") == status()["other"]["ready"] == 1


def test_the_depth_query_stops_at_its_cap(schema: str, store: Store, pg_url: str) -> None:
    depth = autoscaling_queries()["depth"].replace("LIMIT 10000", "LIMIT 3")
    for n in range(5):
        store.publisher.publish("default", message(n))
    with psycopg.connect(pg_url) as conn:
        assert conn.execute(for_queue(depth, schema, "default")).fetchone() == (3,)


def test_the_keda_example_runs_the_documented_queries() -> None:
    text = (DOCS / "monitoring.md").read_text(encoding="utf-8")
    embedded = re.findall(r"query: >-\n((?:\s{10}\S.*\n)+)", text)

    def norm(q: str) -> str:
        return " ".join(q.split()).replace("( ", "(").replace(" )", ")")

    assert [norm(q) for q in embedded] == [norm(q) for q in autoscaling_queries().values()]
