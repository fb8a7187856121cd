"""docker/docker-compose.yaml, read as data: every worker is tuned, checked and scalable.

Docker is not needed (nor available in CI): the file is parsed here and its services'
commands are run for real by tests/acceptance/test_compose.py. The parser is a small
YAML subset reader (block mappings and sequences, one-line flow sequences, quoted and
plain scalars) because PyYAML is not a dependency; anything outside the subset is an
error, not a silent misreading, and where PyYAML is installed both must agree.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import pytest
from psycopg.conninfo import conninfo_to_dict

from pg_transport.config import Options, env_queue_key
from pg_transport.db.pool import url_to_conninfo
from pg_transport.ops import health
from pg_transport.ops.cli import main

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker" / "docker-compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
EXAMPLES = ROOT / "examples"

# -- a YAML subset reader ----------------------------------------------------------

_INT = re.compile(r"^[-+]?[0-9]+$")
_FLOAT = re.compile(r"^[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$")
_BOOL = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}
_UNSUPPORTED = ("&", "*", "!", "|", ">", "{", "%", "@", "`")


class YamlSubsetError(ValueError):
    pass


def _strip_comment(line: str) -> str:
    quote: str | None = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'" and (i == 0 or line[i - 1] in " [,:-"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _split_key(text: str, lineno: int) -> tuple[str, str] | None:
    """``key: rest`` -> (key, rest); None when the text is not a mapping entry."""
    if text[:1] in "\"'":
        end = text.find(text[0], 1)
        if end < 0 or not text[end + 1 :].startswith(":"):
            return None
        return text[1:end], text[end + 2 :].strip()
    match = re.match(r"^([^\s:#\[\]{},][^:#]*?):(\s+|$)(.*)$", text)
    if not match:
        return None
    return match.group(1), match.group(3).strip()


def _scalar(text: str, lineno: int) -> Any:
    if text.startswith('"'):
        if not text.endswith('"') or len(text) < 2:
            raise YamlSubsetError(f"line {lineno}: unterminated string {text!r}")
        body = text[1:-1]
        escapes = {"\\": "\\", '"': '"', "n": "\n", "t": "\t"}
        return re.sub(r"\\(.)", lambda m: escapes[m.group(1)], body)
    if text.startswith("'"):
        if not text.endswith("'") or len(text) < 2:
            raise YamlSubsetError(f"line {lineno}: unterminated string {text!r}")
        return text[1:-1].replace("''", "'")
    if text.startswith("["):
        return _flow_sequence(text, lineno)
    if text == "{}":
        return {}
    if text[:1] in _UNSUPPORTED:
        raise YamlSubsetError(f"line {lineno}: {text!r} is outside the YAML subset read here")
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text.lower() in _BOOL:
        return _BOOL[text.lower()]
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return text


def _flow_sequence(text: str, lineno: int) -> list[Any]:
    if not text.endswith("]"):
        raise YamlSubsetError(f"line {lineno}: flow sequences must fit on one line")
    items: list[str] = []
    current, quote = "", None
    for ch in text[1:-1]:
        if quote:
            current += ch
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
            current += ch
        elif ch == ",":
            items.append(current.strip())
            current = ""
        elif ch in "[]{}":
            raise YamlSubsetError(f"line {lineno}: nested flow collections are not read here")
        else:
            current += ch
    if current.strip():
        items.append(current.strip())
    return [_scalar(item, lineno) for item in items]


def parse_yaml(text: str) -> Any:
    lines: list[tuple[int, str, int]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise YamlSubsetError(f"line {lineno}: tabs in indentation")
        stripped = _strip_comment(raw)
        if stripped.strip() in ("---", "..."):
            raise YamlSubsetError(f"line {lineno}: one document only")
        if stripped.strip():
            lines.append((len(stripped) - len(stripped.lstrip()), stripped.strip(), lineno))
    if not lines:
        return None
    value, end = _block(lines, 0, lines[0][0])
    if end != len(lines):
        raise YamlSubsetError(f"line {lines[end][2]}: unexpected indentation")
    return value


def _block(lines: list[tuple[int, str, int]], i: int, indent: int) -> tuple[Any, int]:
    if lines[i][1] == "-" or lines[i][1].startswith("- "):
        seq: list[Any] = []
        while (
            i < len(lines)
            and lines[i][0] == indent
            and (lines[i][1] == "-" or lines[i][1].startswith("- "))
        ):
            _, text, lineno = lines[i]
            item = text[1:].strip()
            if not item:
                if i + 1 >= len(lines) or lines[i + 1][0] <= indent:
                    seq.append(None)
                    i += 1
                    continue
                value, i = _block(lines, i + 1, lines[i + 1][0])
                seq.append(value)
                continue
            if _split_key(item, lineno) is not None and not item.startswith(("[", '"', "'")):
                raise YamlSubsetError(f"line {lineno}: mappings inside sequences are not read here")
            seq.append(_scalar(item, lineno))
            i += 1
        return seq, i
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent:
        _, text, lineno = lines[i]
        entry = _split_key(text, lineno)
        if entry is None:
            raise YamlSubsetError(f"line {lineno}: expected 'key: value', got {text!r}")
        key, rest = entry
        if key in mapping:
            raise YamlSubsetError(f"line {lineno}: duplicate key {key!r}")
        if rest:
            mapping[key] = _scalar(rest, lineno)
            i += 1
        elif i + 1 < len(lines) and lines[i + 1][0] > indent:
            mapping[key], i = _block(lines, i + 1, lines[i + 1][0])
        else:
            mapping[key] = None
            i += 1
    if i < len(lines) and lines[i][0] > indent:
        raise YamlSubsetError(f"line {lines[i][2]}: unexpected indentation")
    return mapping, i


# -- the compose file as data -------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")

# What the compose file needs set, each a password (docker.md: `.env`), here any value.
SECRETS = {
    name: f"{name.lower().replace('_', '-')}-value"
    for name in (
        "POSTGRES_PASSWORD",
        "OWNER_PASSWORD",
        "WORKER_PASSWORD",
        "PUBLISHER_PASSWORD",
        "MONITOR_PASSWORD",
    )
}


class MissingVariable(KeyError):
    """A ``${VAR:?message}`` whose variable is unset or empty: compose refuses to start."""


def interpolate(value: str, environ: Mapping[str, str] | None = None) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?message}``
    and ``${VAR?message}``, from ``environ`` (default: none set)."""
    env = environ or {}

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        value = env.get(name)
        missing = value is None or (op.startswith(":") and value == "")
        if not missing:
            return str(value)
        if op.endswith("?"):
            raise MissingVariable(f"{name}: {arg}")
        return arg if op else ""

    return _INTERPOLATION.sub(one, value)


def load_compose() -> dict[str, Any]:
    data = parse_yaml(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def command_of(service: Mapping[str, Any]) -> list[str]:
    command = service["command"]
    return [str(c) for c in (shlex.split(command) if isinstance(command, str) else command)]


def environment_of(
    service: Mapping[str, Any], environ: Mapping[str, str] = SECRETS
) -> dict[str, str]:
    """A service's environment as compose gives it, with ``environ`` set on the host."""
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment as a mapping (KEY: value), not a list"
    return {str(k): interpolate(str(v), environ) for k, v in env.items()}


def is_worker(service: Mapping[str, Any]) -> bool:
    command = command_of(service) if service.get("command") else []
    return command[:1] == ["celery"] and "worker" in command


def workers(compose: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if is_worker(svc)}


def worker_queues(service: Mapping[str, Any]) -> list[str]:
    command = command_of(service)
    for flag in ("-Q", "--queues"):
        if flag in command:
            return command[command.index(flag) + 1].split(",")
    raise AssertionError(f"worker command without -Q: {command}")


def cli_envvars() -> set[str]:
    """Every environment variable a pgq command reads (its click options' envvar)."""
    found: set[str] = set()

    def walk(command: click.Command) -> None:
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            if isinstance(envvar, str):
                found.add(envvar)
            elif envvar:
                found.update(envvar)
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                walk(sub)

    walk(main)
    return found


def config_scalar_envvars() -> set[str]:
    """``PGQ_<KEY>`` of every scalar transport option (config.py reads each)."""
    return {
        f"PGQ_{f.name.upper()}"
        for f in dataclasses.fields(Options)
        if not f.name.startswith(("env_", "queue_"))
    }


# -- the parser itself ----------------------------------------------------------------


def test_parser_reads_the_subset() -> None:
    text = (
        "# comment\n"
        "a: 1\n"
        'b: "x # not a comment"  # a comment\n'
        "c:\n"
        "  - one\n"
        "  - 'it''s'\n"
        "  -\n"
        "    k: v\n"
        "d: [CMD, \"pgq\", 'health', 3]\n"
        "e:\n"
        'f: "no"\n'
        "g: no\n"
        "h: 2s\n"
        "i: pgq://u:${P:?set P, see x.md}@h:5432/db\n"
    )
    assert parse_yaml(text) == {
        "a": 1,
        "b": "x # not a comment",
        "c": ["one", "it's", {"k": "v"}],
        "d": ["CMD", "pgq", "health", 3],
        "e": None,
        "f": "no",
        "g": False,
        "h": "2s",
        "i": "pgq://u:${P:?set P, see x.md}@h:5432/db",
    }


@pytest.mark.parametrize(
    "text",
    [
        "a: &anchor 1\n",
        "a: *alias\n",
        "a: |\n  text\n",
        "a: {b: 1}\n",
        "a: 1\n  b: 2\n",
        "a: 1\na: 2\n",
        "- a: 1\n",
        "a: [x, [y]]\n",
        "---\na: 1\n",
    ],
)
def test_parser_refuses_what_it_does_not_read(text: str) -> None:
    with pytest.raises(YamlSubsetError):
        parse_yaml(text)


def test_parser_agrees_with_pyyaml_on_the_compose_file() -> None:
    yaml = pytest.importorskip("yaml")
    text = COMPOSE.read_text(encoding="utf-8")
    assert parse_yaml(text) == yaml.safe_load(text)


# -- the fleet ------------------------------------------------------------------------


def test_fleet_has_postgres_migrate_grants_metrics_and_four_queue_workers() -> None:
    compose = load_compose()
    services = compose["services"]
    assert {"postgres", "migrate", "grants", "metrics"} <= set(services)
    queues = sorted(q for svc in workers(compose).values() for q in worker_queues(svc))
    assert queues == ["callback", "default", "orchestrator", "scheduler"]


def test_migrate_is_one_shot_after_postgres_is_healthy() -> None:
    migrate = load_compose()["services"]["migrate"]
    assert command_of(migrate) == ["pgq", "migrate"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    check = load_compose()["services"]["postgres"]["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL"
    # Ready only once the image's init scripts ran: its temporary server meanwhile
    # listens on a socket only, so the check goes over TCP.
    assert " -h 127.0.0.1 " in check[1]


def test_grants_are_one_shot_after_every_migration() -> None:
    grants = load_compose()["services"]["grants"]
    assert grants["restart"] == "no"
    assert grants["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}
    command = command_of(grants)
    assert command[0] == "psql" and "ON_ERROR_STOP=1" in command
    assert mounted(grants, command[command.index("-f") + 1]) == GRANTS


def test_every_worker_scales_and_waits_for_the_migration_and_grants() -> None:
    for name, svc in workers(load_compose()).items():
        # `docker compose up --scale NAME=N` refuses a fixed container name, and a fixed
        # host port can be bound by one replica only.
        assert "container_name" not in svc, name
        assert "ports" not in svc, name
        assert svc["depends_on"] == {"grants": {"condition": "service_completed_successfully"}}, (
            name
        )
        assert svc.get("restart") == "unless-stopped", name
        assert command_of(svc)[:4] == ["celery", "-A", "fleet", "worker"], name


def test_two_beats_run_the_pgq_scheduler_after_the_grants() -> None:
    beat = load_compose()["services"]["beat"]
    command = command_of(beat)
    assert command[:4] == ["celery", "-A", "fleet", "beat"]
    assert command[command.index("-S") + 1] == "pgq"
    assert beat["deploy"] == {"replicas": 2}
    assert "container_name" not in beat and "ports" not in beat
    assert beat["depends_on"] == {"grants": {"condition": "service_completed_successfully"}}
    assert beat.get("restart") == "unless-stopped"
    # The migrate service owns the schema, as for the workers.
    assert environment_of(beat)["PGQ_AUTO_MIGRATE"] == "false"


def test_every_worker_sets_the_vt_of_each_of_its_queues() -> None:
    for name, svc in workers(load_compose()).items():
        env = environment_of(svc)
        options = Options.from_sources(None, env)  # refuses a suffix no queue can match
        for queue in worker_queues(svc):
            key = f"PGQ_VISIBILITY_TIMEOUT_{env_queue_key(queue)}"
            assert key in env, f"{name}: no {key}"
            assert options.visibility_timeout_for(queue) == float(env[key]), name
        # The migrate service owns the schema: a worker of an older or newer pgq
        # must stop with "run pgq migrate", not race to change it.
        assert options.auto_migrate is False, name


def test_vt_suffix_must_be_the_upper_cased_queue_name() -> None:
    # What the note in the compose file warns about, checked against config.py.
    from pg_transport.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="PGQ_VISIBILITY_TIMEOUT_orchestrator"):
        Options.from_sources(None, {"PGQ_VISIBILITY_TIMEOUT_orchestrator": "300"})
    opts = Options.from_sources(None, {"PGQ_VISIBILITY_TIMEOUT_REPORTS_DAILY": "600"})
    assert opts.visibility_timeout_for("reports.daily") == 600.0


def test_every_worker_has_a_consuming_healthcheck() -> None:
    for name, svc in workers(load_compose()).items():
        env = environment_of(svc)
        check = svc["healthcheck"]
        assert check["test"] == ["CMD", "pgq", "health"], name
        for key in ("interval", "timeout", "retries", "start_period"):
            assert key in check, f"{name}: healthcheck.{key}"
        stale = float(env[health.STALE_ENV])
        # An idle worker's consume loop turns every ~2 s: a threshold a few times
        # that never flags an idle worker, and the check interval must see it.
        assert stale >= 10, name
        assert env[health.FILE_ENV].startswith("/tmp/"), name
        # The health command reads the same variables the worker's step writes to.
        assert {health.FILE_ENV, health.STALE_ENV} <= cli_envvars()


def test_every_pgq_variable_is_one_pgq_reads() -> None:
    allowed = config_scalar_envvars() | cli_envvars()
    assert {"PGQ_URL", "PGQ_SCHEMA", "PGQ_VISIBILITY_TIMEOUT", health.FILE_ENV} <= allowed
    for name, svc in load_compose()["services"].items():
        env = environment_of(svc)
        for key in env:
            if not key.startswith("PGQ_"):
                continue
            if key.startswith(("PGQ_VISIBILITY_TIMEOUT_", "PGQ_MAX_ATTEMPTS_")) and (
                key not in allowed
            ):
                Options.from_sources(None, {key: env[key]})  # a per-queue name: valid?
                continue
            assert key in allowed, f"{name}: {key} is read by nothing in pgq"


def test_urls_parse_and_point_at_the_postgres_service() -> None:
    compose = load_compose()
    compose_db = environment_of(compose["services"]["postgres"])["POSTGRES_DB"]
    for name, svc in compose["services"].items():
        env = environment_of(svc)
        if "PGQ_URL" in env:
            params = conninfo_to_dict(url_to_conninfo(env["PGQ_URL"]))
            assert params["host"] == "postgres", name
            assert params["password"] == SECRETS[PASSWORD_OF[params["user"]]], name
            assert params["dbname"] == compose_db, name


def test_example_app_routes_a_task_to_every_worker_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import fleet

    routed = {route["queue"] for route in fleet.app.conf.task_routes.values()}
    routed.add(fleet.app.conf.task_default_queue)
    queues = {q for svc in workers(load_compose()).values() for q in worker_queues(svc)}
    assert queues == routed
    assert fleet.app.conf.task_acks_late is True
    # The heartbeat step the health check relies on is part of every worker.
    assert health.HeartbeatStep in fleet.app.steps["consumer"]


def test_dockerfile_copies_what_the_fleet_runs() -> None:
    compose = load_compose()
    dockerfile = DOCKERFILE.read_text(encoding="utf-8")
    for name, svc in compose["services"].items():
        if "build" in svc:
            context = (COMPOSE.parent / svc["build"]["context"]).resolve()
            assert context == ROOT, name
            assert (context / svc["build"]["dockerfile"]).resolve() == DOCKERFILE, name
        if svc.get("image", "").startswith("pgq-fleet"):
            assert "build" in svc, f"{name}: would be pulled, not built"
    sources = [
        src
        for line in dockerfile.splitlines()
        if line.startswith("COPY ")
        for src in line.split()[1:-1]
    ]
    for src in sources:
        assert (ROOT / src).exists(), src
    assert "examples/fleet.py" in sources
    assert re.search(r"^RUN pip install \.", dockerfile, re.MULTILINE)
    # The ignore file must let through everything the Dockerfile copies.
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text(encoding="utf-8")
    kept = [line[1:] for line in ignore.splitlines() if line.startswith("!")]
    for src in sources:
        assert any(k == src or k.startswith(src.rstrip("/") + "/") for k in kept), src


# -- roles and passwords -----------------------------------------------------------------

# The role of docs/least-privilege.md each service runs as, and the variable holding
# its password.
ROLE_OF = {
    "migrate": "pgq_owner",
    "grants": "pgq_owner",
    "metrics": "pgq_monitor",
    "beat": "pgq_worker",
}
PASSWORD_OF = {
    "pgq_owner": "OWNER_PASSWORD",
    "pgq_worker": "WORKER_PASSWORD",
    "pgq_publisher": "PUBLISHER_PASSWORD",
    "pgq_monitor": "MONITOR_PASSWORD",
}
INITDB = COMPOSE.parent / "initdb"
GRANTS = COMPOSE.parent / "grants.sql"


def mounted(service: Mapping[str, Any], target: str) -> Path:
    """The host file or directory a service mounts at ``target`` (a bind mount)."""
    for volume in service.get("volumes") or []:
        source, at, *_ = str(volume).split(":")
        if at == target:
            return (COMPOSE.parent / source).resolve()
    raise AssertionError(f"nothing mounted at {target}")


def role_of(service: Mapping[str, Any]) -> str:
    """The role a service connects as (its URL's user, or libpq's PGUSER)."""
    env = environment_of(service)
    if "PGQ_URL" in env:
        return str(conninfo_to_dict(url_to_conninfo(env["PGQ_URL"]))["user"])
    return env["PGUSER"]


def test_each_service_runs_as_the_role_its_job_needs() -> None:
    services = load_compose()["services"]
    expected = {name: ROLE_OF.get(name, "pgq_worker") for name in services if name != "postgres"}
    assert set(workers(load_compose())) | set(ROLE_OF) == set(expected)
    for name, role in expected.items():
        assert role_of(services[name]) == role, name
        # Its password, and no other: nobody but Postgres knows the superuser's.
        env = environment_of(services[name])
        known = {secret for secret in SECRETS.values() if secret in " ".join(env.values())}
        assert known == {SECRETS[PASSWORD_OF[role]]}, name
    postgres = environment_of(services["postgres"])
    assert postgres["POSTGRES_USER"] not in PASSWORD_OF
    # The superuser's container knows every role's password: its init script sets them.
    assert {k: postgres[k] for k in SECRETS} == SECRETS


def test_no_password_has_a_default_and_compose_refuses_to_start_without_them() -> None:
    text = COMPOSE.read_text(encoding="utf-8")
    uses = _INTERPOLATION.findall(text)
    assert {name for name, _, _ in uses} == set(SECRETS)
    for name, op, message in uses:
        assert op == ":?", f"${{{name}{op}{message}}}: a variable with a default"
        assert name in message and "docs/docker.md" in message
    urls = [
        str(v)
        for svc in load_compose()["services"].values()
        for v in (svc.get("environment") or {}).values()
        if "://" in str(v)
    ]
    assert len(urls) == len(load_compose()["services"]) - 2  # all but postgres and grants
    for url in urls:  # the password part is a variable, always
        assert re.fullmatch(r"pgq://\w+:\$\{\w+:\?[^}]*\}@postgres:5432/pgq", url), url
    # Compose interpolates every service's environment when it starts: without any one
    # of the variables, it stops there, naming it.
    for missing in SECRETS:
        environ = {k: v for k, v in SECRETS.items() if k != missing}
        with pytest.raises(MissingVariable, match=rf"^'{missing}: set {missing}, see"):
            for service in load_compose()["services"].values():
                environment_of(service, environ)
        with pytest.raises(MissingVariable):  # set but empty is missing too
            for service in load_compose()["services"].values():
                environment_of(service, {**environ, missing: ""})


def test_interpolation_follows_compose() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET}|${UNSET}|${UNSET:-d}|${EMPTY:-d}|${EMPTY-d}", env) == "v||d|d|"
    assert interpolate("${EMPTY?m}", env) == ""
    with pytest.raises(MissingVariable, match="EMPTY: m"):
        interpolate("${EMPTY:?m}", env)
    with pytest.raises(MissingVariable, match="UNSET: m"):
        interpolate("${UNSET?m}", env)


def test_the_roles_are_created_and_granted_as_the_least_privilege_page_says() -> None:
    """initdb/ runs the page's superuser blocks, grants.sql its owner blocks: the same
    statements, the passwords and database name given to psql as variables."""
    # Imported here: that module imports this one (its compose and example paths).
    from tests.integration.test_privileges import page_sql, statements

    postgres = load_compose()["services"]["postgres"]
    assert mounted(postgres, "/docker-entrypoint-initdb.d") == INITDB
    [script] = INITDB.iterdir()  # the image runs every file there
    assert script.suffix == ".sh" and os.access(script, os.X_OK)
    shell = script.read_text(encoding="utf-8")
    heredoc = re.search(r"<<'SQL'\n(.*?)^SQL$", shell, re.MULTILINE | re.DOTALL)
    assert heredoc, "the SQL as a quoted here-document (psql interpolates, the shell not)"
    for kind in ("owner", "worker", "publisher", "monitor"):
        assert f'--set {kind}_password="${kind.upper()}_PASSWORD"' in shell
    as_page = re.sub(r":'(\w+)_password'", lambda m: f"'{m.group(1)}-secret'", heredoc.group(1))
    as_page = as_page.replace(':"DBNAME"', "app")
    blocks = page_sql()
    assert statements(as_page) == [s for n in ("1", "2") for s in statements(blocks[n][1])]
    grants = GRANTS.read_text(encoding="utf-8")
    assert statements(grants) == [s for n in ("4", "5", "6") for s in statements(blocks[n][1])]
