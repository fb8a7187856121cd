"""Dependencies point inward (docs/design/layout.md): read from the source.

Each module's imports are parsed (``ast``), those inside functions and ``TYPE_CHECKING``
blocks included: a deferred import is a dependency all the same. A rule names a group
of modules and the imports none of them may make; a name is forbidden when it is the
forbidden module or inside it (``kombu`` forbids ``kombu.transport.virtual`` too).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pg_transport"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, and for ``from M import n`` also ``M.n`` (``n``
    may be a submodule: ``from pg_transport import store``)."""
    name = module_name(path, root)
    package = name.rsplit(".", 1)[0] if path.name != "__init__.py" else None
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = (package or name).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def modules(where: str) -> Iterator[Path]:
    target = PACKAGE / where
    if where == "":
        yield from sorted(PACKAGE.rglob("*.py"))
    elif target.suffix == ".py":
        yield target
    else:
        yield from sorted(target.rglob("*.py"))


def within(name: str, forbidden: str) -> bool:
    return name == forbidden or name.startswith(forbidden + ".")


# (the modules, what none of them may import, why)
RULES = [
    (
        "message",
        [
            "kombu",
            "celery",
            "psycopg",
            "pg_transport.sql",
            "pg_transport.db",
            "pg_transport.signals",
            "pg_transport.consume",
            "pg_transport.publish",
            "pg_transport.kombu",
            "pg_transport.store",
        ],
        "what a row and its headers mean: no SQL, no kombu or Celery, nothing that uses it",
    ),
    (
        "consume",
        ["pg_transport.kombu", "pg_transport.transport", "kombu.transport"],
        "the engine knows no kombu transport: the kombu layer drives it",
    ),
    (
        "store.py",
        ["pg_transport.publish"],
        "the store runs the queue's other statements; the transport composes the publisher",
    ),
    (
        "",
        ["barrier"],
        "the core never imports the barrier add-on (it plugs in through pgq.plugins)",
    ),
    (
        "results",
        ["barrier", "pg_transport.kombu", "pg_transport.transport", "pg_transport.consume"],
        "the result backend counts chords on fanin/ and knows nothing of the transport",
    ),
    (
        "fanin",
        ["barrier", "pg_transport.results", "pg_transport.kombu", "pg_transport.consume"],
        "the counting core chords and the barrier share depends on neither",
    ),
    (
        "kombu",
        ["pg_transport.results", "barrier"],
        "the transport does not wire the result backend: results own their housekeeping",
    ),
    (
        "transport.py",
        ["pg_transport.results", "barrier"],
        "(the name users and the install hook give the transport: a re-export)",
    ),
    (
        "atomic",
        [
            "barrier",
            "pg_transport.results",
            "pg_transport.kombu",
            "pg_transport.transport",
            "pg_transport.consume",
        ],
        "an atomic run reaches the result backend through db/completing, and the "
        "worker's QoS through the class attribute the delivery guard reads",
    ),
    (
        "ops",
        ["barrier", "pg_transport.consume"],
        "operator code reads rows and runs statements; it drives no engine",
    ),
    (
        "web",
        ["barrier", "pg_transport.consume", "pg_transport.ops.cli_common"],
        "the console reads rows; formatting shared with the CLI is ops/format.py",
    ),
    (
        "config.py",
        ["pg_transport.message.ordering", "pg_transport.ordering"],
        "options know their defaults, not the ordering headers",
    ),
]


@pytest.mark.parametrize(
    ("where", "forbidden", "why"), RULES, ids=[r[0] or "pg_transport" for r in RULES]
)
def test_layer_imports_nothing_it_must_not(where: str, forbidden: list[str], why: str) -> None:
    found = [
        f"{module_name(path)} imports {name}"
        for path in modules(where)
        for name in sorted(imports(path))
        if any(within(name, f) for f in forbidden)
    ]
    assert found == [], why


#: The operator layers: they may import everything below them, nothing below imports them.
TOP = ("pg_transport.ops", "pg_transport.web")


def test_nothing_below_the_operator_layers_imports_them() -> None:
    """ops/ and web/ use everything below; nothing below uses them, a deferred import
    included (a refused worker's heartbeat: ops/health.py watches backoff.py)."""
    found = [
        f"{module_name(path)} imports {name}"
        for path in modules("")
        if not any(within(module_name(path), top) for top in TOP)
        for name in sorted(imports(path))
        if any(within(name, top) for top in TOP)
    ]
    assert found == [], "an arrow up: nothing below ops/ and web/ may import them"


def test_the_parser_sees_deferred_and_from_imports() -> None:
    # The rules above prove something only if the parse finds what a module imports.
    hooks = imports(PACKAGE / "kombu" / "hooks.py")
    assert "celery.signals" in hooks  # from celery import signals
    assert "celery._state" in hooks  # inside a function
    guard = imports(PACKAGE / "kombu" / "guard.py")
    assert "pg_transport.kombu.qos" in guard
    assert within("kombu.transport.virtual", "kombu")
    assert not within("kombuish", "kombu")


def test_every_rule_names_modules_that_exist() -> None:
    for where, _, _ in RULES:
        assert list(modules(where)), where


def test_relative_imports_resolve_as_python_does(tmp_path: Path) -> None:
    package = tmp_path / "pg_transport" / "results"
    package.mkdir(parents=True)
    source = package / "x.py"
    source.write_text(
        "from barrier.state import x\nfrom .. import fanin\n"
        "def f():\n    from ..fanin import state\n",
        encoding="utf-8",
    )
    found = imports(source, tmp_path)
    assert {"barrier.state", "pg_transport.fanin", "pg_transport.fanin.state"} <= found


def test_results_count_chords_on_fanin() -> None:
    chords = imports(PACKAGE / "results" / "chords.py")
    assert any(within(name, "pg_transport.fanin") for name in chords)


def barrier_modules_after(statement: str) -> list[str]:
    """The barrier modules a fresh interpreter holds after ``statement``."""
    code = (
        f"{statement}\nimport sys\n"
        "print('\\n'.join(sorted(m for m in sys.modules"
        " if m == 'barrier' or m.startswith('barrier.'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


@pytest.mark.parametrize(
    "statement",
    [
        "import pg_transport.results.backend",
        "import pg_transport.transport",
        # What every `celery` command loads (celery pgq): no barrier hooks in every worker.
        "import pg_transport.ops.celery_command",
        "import pg_transport.ops.cli",
        "import pg_transport.web.app",
    ],
)
def test_importing_the_core_imports_no_barrier(statement: str) -> None:
    """Importing the barrier connects its worker hooks and its sweeper: an app that never
    names it gets neither."""
    assert barrier_modules_after(statement) == []


def test_the_barrier_plugin_is_found_by_its_entry_point() -> None:
    from pg_transport.ops.plugins import names, plugin

    assert "barrier" in names()
    found = plugin("barrier")
    assert found is not None and found.cli is not None and found.cli.name == "barrier"
    assert found.status_counts is not None and found.show is not None
