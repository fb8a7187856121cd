"""docker/docker-compose.yaml, read as data: every worker is tuned, checked and scalable.

Docker is not needed (nor available in CI): the file is parsed here and its services'
commands are run for real by tests/acceptance/test_compose.py. The parser is a small
YAML subset reader (block mappings and sequences, one-line flow sequences, quoted and
plain scalars) because PyYAML is not a dependency; anything outside the subset is an
error, not a silent misreading, and where PyYAML is installed both must agree.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import pytest
from psycopg.conninfo import conninfo_to_dict

from pg_transport import health
from pg_transport.cli import main
from pg_transport.config import Options, env_queue_key
from pg_transport.connection import url_to_conninfo

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
        while i < len(lines) and lines[i][0] == indent and (
            lines[i][1] == "-" or lines[i][1].startswith("- ")
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

_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate(value: str, environ: Mapping[str, str] | None = None) -> str:
    """Compose's ``${VAR}`` and ``${VAR:-default}``, from ``environ`` (default: none)."""
    env = environ or {}
    return _INTERPOLATION.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def load_compose() -> dict[str, Any]:
    data = parse_yaml(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def command_of(service: Mapping[str, Any]) -> list[str]:
    command = service["command"]
    return [str(c) for c in (shlex.split(command) if isinstance(command, str) else command)]


def environment_of(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment as a mapping (KEY: value), not a list"
    return {str(k): interpolate(str(v)) for k, v in env.items()}


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
        "b: \"x # not a comment\"  # a comment\n"
        "c:\n"
        "  - one\n"
        "  - 'it''s'\n"
        "  -\n"
        "    k: v\n"
        "d: [CMD, \"pgq\", 'health', 3]\n"
        "e:\n"
        "f: \"no\"\n"
        "g: no\n"
        "h: 2s\n"
        "i: pgq://u:${P:-x}@h:5432/db\n"
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
        "i": "pgq://u:${P:-x}@h:5432/db",
    }


@pytest.mark.parametrize(
    "text",
    ["a: &anchor 1\n", "a: *alias\n", "a: |\n  text\n", "a: {b: 1}\n", "a: 1\n  b: 2\n",
     "a: 1\na: 2\n", "- a: 1\n", "a: [x, [y]]\n", "---\na: 1\n"],
)
def test_parser_refuses_what_it_does_not_read(text: str) -> None:
    with pytest.raises(YamlSubsetError):
        parse_yaml(text)


def test_parser_agrees_with_pyyaml_on_the_compose_file() -> None:
    yaml = pytest.importorskip("yaml")
    text = COMPOSE.read_text(encoding="utf-8")
    assert parse_yaml(text) == yaml.safe_load(text)


# -- the fleet ------------------------------------------------------------------------


def test_fleet_has_postgres_migrate_metrics_and_four_queue_workers() -> None:
    compose = load_compose()
    services = compose["services"]
    assert {"postgres", "migrate", "metrics"} <= set(services)
    queues = sorted(q for svc in workers(compose).values() for q in worker_queues(svc))
    assert queues == ["callback", "default", "orchestrator", "scheduler"]


def test_migrate_is_one_shot_after_postgres_is_healthy() -> None:
    migrate = load_compose()["services"]["migrate"]
    assert command_of(migrate) == ["pgq", "migrate"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert load_compose()["services"]["postgres"]["healthcheck"]["test"][0] == "CMD-SHELL"


def test_every_worker_scales_and_waits_for_the_migration() -> None:
    for name, svc in workers(load_compose()).items():
        # `docker compose up --scale NAME=N` refuses a fixed container name, and a fixed
        # host port can be bound by one replica only.
        assert "container_name" not in svc, name
        assert "ports" not in svc, name
        assert svc["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"}
        }, name
        assert svc.get("restart") == "unless-stopped", name
        assert command_of(svc)[:4] == ["celery", "-A", "fleet", "worker"], name


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
            assert params["password"] == "pgq", name  # ${POSTGRES_PASSWORD:-pgq}
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


def test_no_password_but_the_overridable_local_default() -> None:
    # Passwords come from ${POSTGRES_PASSWORD:-pgq}: set the variable for anything
    # but a laptop; no literal password is in the file.
    text = COMPOSE.read_text(encoding="utf-8")
    passwords = re.findall(r"pgq://pgq:([^@]*)@", text)
    assert passwords and set(passwords) == {"${POSTGRES_PASSWORD:-pgq}"}
    assert "POSTGRES_PASSWORD: ${POSTGRES_PASSWORD:-pgq}" in text
