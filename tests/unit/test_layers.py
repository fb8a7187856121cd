"""Dependencies point inward (docs/design: Layout, Dependencies): read from the source.

Each module's imports are parsed (``ast``), those inside functions and ``TYPE_CHECKING``
blocks included: a deferred import is a dependency all the same. A rule names a group
of modules and the imports none of them may make; a name is forbidden when it is the
forbidden module or inside it (``kombu`` forbids ``kombu.transport.virtual`` too).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pg_transport"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, and for ``from M import n`` also ``M.n`` (``n``
    may be a submodule: ``from pg_transport import store``)."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else None
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                anchor = (package or module_name(path)).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def modules(where: str) -> Iterator[Path]:
    target = PACKAGE / where
    if target.suffix == ".py":
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
        "config.py",
        ["pg_transport.message.ordering", "pg_transport.ordering"],
        "options know their defaults, not the ordering headers",
    ),
]


@pytest.mark.parametrize(("where", "forbidden", "why"), RULES, ids=[r[0] for r in RULES])
def test_layer_imports_nothing_it_must_not(where: str, forbidden: list[str], why: str) -> None:
    found = [
        f"{module_name(path)} imports {name}"
        for path in modules(where)
        for name in sorted(imports(path))
        if any(within(name, f) for f in forbidden)
    ]
    assert found == [], why


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
