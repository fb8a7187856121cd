"""pyproject.toml's dependency ranges: bounded above, and met by what the tests run on.

pgq uses internals of kombu, Celery and psycopg; a release of one of them that pip would
install unasked must first be tested, so every runtime dependency has an upper bound,
and the versions installed here (the ones this test run proves pgq against) must lie
inside the declared ranges, or the bounds claim something no run has checked.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 has no tomllib
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
UPPER = {"<", "<=", "==", "~=", "==="}


def project() -> dict[str, Any]:
    with PYPROJECT.open("rb") as f:
        return dict(tomllib.load(f)["project"])


def runtime_requirements() -> list[Requirement]:
    """What installing pgq (and its `embedded` extra, used by `pgq demo`) pulls in."""
    meta = project()
    found = [*meta["dependencies"], *meta["optional-dependencies"]["embedded"]]
    return [Requirement(text) for text in found]


def test_the_runtime_dependencies_are_the_ones_checked_here() -> None:
    # A dependency added without a bound would fail below; this pins what "below" saw.
    assert {r.name for r in runtime_requirements()} == {
        "celery",
        "kombu",
        "psycopg",
        "tenacity",
        "click",
        "pgserver",
    }


@pytest.mark.parametrize("requirement", runtime_requirements(), ids=lambda r: r.name)
def test_every_runtime_dependency_has_an_upper_bound(requirement: Requirement) -> None:
    bounds = [s for s in requirement.specifier if s.operator in UPPER]
    assert bounds, f"{requirement} has no upper bound"
    lower = [s for s in requirement.specifier if s.operator == ">="]
    assert lower, f"{requirement} has no lower bound"


@pytest.mark.parametrize("requirement", runtime_requirements(), ids=lambda r: r.name)
def test_installed_versions_satisfy_the_declared_ranges(requirement: Requirement) -> None:
    try:
        installed = version(requirement.name)
    except PackageNotFoundError:
        pytest.fail(f"{requirement.name} is not installed: pip install -e '.[dev]'")
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"installed {requirement.name} {installed} is outside {requirement.specifier}: "
        "test it, then move the bound"
    )


# Every "pip install" a user is told to run, in code and docs: it names this distribution
# (`celery-pgq[...]`) or a checkout (`.[...]`), never `pgq[...]`, which is another project.
_INSTALL_HINT = re.compile(r"pip install\s+['\"]?([A-Za-z0-9_.-]*)\[")


def _install_hints() -> list[tuple[str, str]]:
    root = PYPROJECT.parent
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    files += sorted((root / "pg_transport").rglob("*.py"))
    files += sorted((root / "barrier").rglob("*.py"))
    found = []
    for path in files:
        for match in _INSTALL_HINT.finditer(path.read_text(encoding="utf-8")):
            found.append((str(path.relative_to(root)), match.group(1)))
    return found


def test_every_install_hint_names_this_distribution_or_a_checkout() -> None:
    hints = _install_hints()
    assert any(name == "celery-pgq" for _, name in hints), hints
    wrong = [(where, name) for where, name in hints if name not in ("celery-pgq", ".")]
    assert not wrong, wrong


def test_the_command_has_a_name_no_other_distribution_installs() -> None:
    scripts = project()["scripts"]
    assert scripts["celery-pgq"] == scripts["pgq"] == "pg_transport.ops.cli:main"
