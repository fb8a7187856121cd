"""The fan-in layering, read from the source (every import statement, at module level or
inside a function): the core never imports the barrier add-on, results count chords on
``pg_transport.fanin``, the transport imports nothing of the result backend, and the
operator code (ops/, web/) reaches the barrier only through its plugin."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pg_transport"


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(path: Path, module: str | None = None) -> Iterator[str]:
    """Every module ``path`` imports (relative imports resolved as in ``module``, by
    default its own name), wherever in the file the import is."""
    module = module or module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            # `from pg_transport import results` imports pg_transport.results.
            yield from (f"{base}.{alias.name}" for alias in node.names)


def names(module: str, root: str) -> bool:
    return module == root or module.startswith(root + ".")


def offenders(paths: list[Path], root: str) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in paths
        for name in imported(path)
        if names(name, root)
    )


def sources(*under: str) -> list[Path]:
    found = [p for u in under for p in sorted((PACKAGE / u).rglob("*.py"))]
    assert found, under
    return found


def transport_modules() -> list[Path]:
    """The kombu transport: pg_transport/transport.py, or the kombu/ package it moves to."""
    found = [p for p in [PACKAGE / "transport.py"] if p.exists()]
    kombu = PACKAGE / "kombu"
    if kombu.is_dir():
        found.extend(sorted(kombu.rglob("*.py")))
    assert found
    return found


def test_the_resolver_reads_imports_as_python_does(tmp_path: Path) -> None:
    """The checks below are only as good as this reading of imports."""
    source = tmp_path / "x.py"
    source.write_text(
        "import barrier\nfrom barrier.state import x\nfrom .. import results\n"
        "def f():\n    from ..fanin import state\n",
        encoding="utf-8",
    )
    found = set(imported(source, "pg_transport.results.x"))
    assert {"barrier", "barrier.state", "pg_transport.results"} <= found
    assert "pg_transport.fanin.state" in found


def test_no_module_of_pg_transport_imports_the_barrier() -> None:
    assert offenders(sources("."), "barrier") == []


def test_results_import_no_barrier() -> None:
    assert offenders(sources("results"), "barrier") == []


def test_results_count_chords_on_fanin() -> None:
    chords = PACKAGE / "results" / "chords.py"
    assert any(names(n, "pg_transport.fanin") for n in imported(chords))


def test_the_transport_imports_no_results() -> None:
    assert offenders(transport_modules(), "pg_transport.results") == []


def test_ops_and_web_import_no_barrier() -> None:
    assert offenders(sources("ops", "web"), "barrier") == []


def test_fanin_imports_neither_the_barrier_nor_results() -> None:
    fanin = sources("fanin")
    assert offenders(fanin, "barrier") + offenders(fanin, "pg_transport.results") == []


def loaded_after(statement: str) -> list[str]:
    """The barrier modules a fresh interpreter holds after ``statement``."""
    code = (
        f"{statement}\nimport sys\n"
        "print(sorted(m for m in sys.modules if m == 'barrier' or m.startswith('barrier.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return list(eval(out.stdout))  # a printed list of str


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
    assert loaded_after(statement) == []


def test_the_barrier_plugin_is_found_by_its_entry_point() -> None:
    from pg_transport.ops.plugins import names, plugin

    assert "barrier" in names()
    found = plugin("barrier")
    assert found is not None and found.cli is not None and found.cli.name == "barrier"
    assert found.status_counts is not None and found.show is not None
