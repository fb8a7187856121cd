"""One rule for SQL: a package owns its ``.sql`` and loads it itself.

The queue's own statements, the schema and the migrations are in ``pg_transport/sql/``
beside the loader; every other file sits in the package whose modules run it (``beat/``,
``ops/``, ``results/``, ``web/``), and each ``load_named`` call names the caller's own
package. Another package that needs one of those statements asks the owner's module for
it (the console samples ``status_queues`` through ``pg_transport.ops.status.queries``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pg_transport"
LOADER = PACKAGE / "sql" / "loader.py"


def dotted(directory: Path) -> str:
    return ".".join(directory.relative_to(ROOT).parts)


def load_calls(path: Path) -> list[tuple[int, str, str]]:
    """(line, filename, package) of every ``load_named(...)`` call in ``path``; an
    argument that is not a string literal is given as ``"?"``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
        if name != "load_named":
            continue
        args = [*node.args, *(k.value for k in node.keywords)]
        literal = [a.value if isinstance(a, ast.Constant) else "?" for a in args]
        found.append((node.lineno, str(literal[0]), str(literal[2]) if len(literal) > 2 else "?"))
    return found


def every_call() -> list[tuple[Path, int, str, str]]:
    return [
        (path, *call)
        for top in (PACKAGE, ROOT / "barrier")
        for path in sorted(top.rglob("*.py"))
        if path != LOADER
        for call in load_calls(path)
    ]


def test_the_calls_are_found() -> None:
    # The checks below see nothing if the walk stops finding the calls.
    assert {(p.parent.name, f) for p, _, f, _ in every_call()} >= {
        ("beat", "beat.sql"),
        ("ops", "dead.sql"),
        ("ops", "status.sql"),
        ("web", "web.sql"),
    }


@pytest.mark.parametrize(
    "call",
    [c for c in every_call() if c[0].is_relative_to(PACKAGE)],
    ids=lambda c: f"{c[0].relative_to(ROOT)}:{c[1]}",
)
def test_each_module_loads_sql_of_its_own_package(call: tuple[Path, int, str, str]) -> None:
    path, line, filename, package = call
    assert package == dotted(path.parent), (
        f"{path.relative_to(ROOT)}:{line} loads {filename!r} from {package!r}: a module "
        "loads the .sql of its own package (named as a string literal)"
    )
    assert (path.parent / filename).is_file(), f"{path.relative_to(ROOT)}:{line}"


def test_the_sql_package_keeps_only_the_queues_files() -> None:
    assert sorted(p.name for p in (PACKAGE / "sql").glob("*.sql")) == [
        "queries.sql",
        "schema.sql",
    ]


@pytest.mark.parametrize(
    "path",
    [p for p in sorted(PACKAGE.rglob("*.sql")) if not p.is_relative_to(PACKAGE / "sql")],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_every_sql_file_is_loaded_by_its_package(path: Path) -> None:
    loaded = {(package, filename) for _, _, filename, package in every_call()}
    assert (dotted(path.parent), path.name) in loaded, (
        f"nothing loads {path.relative_to(ROOT)} as load_named({path.name!r}, schema, "
        f"{dotted(path.parent)!r})"
    )
