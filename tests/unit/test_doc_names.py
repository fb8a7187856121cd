"""Every dotted Python name the user docs mention (``pg_transport.…``, ``barrier.…``)
exists: a module that imports, or an attribute of one. A rename that forgets the docs
fails here. Logger names (``pg_transport.web.audit``) are checked as the loggers code
creates."""

from __future__ import annotations

import importlib
import logging
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"(?<![\w./-])((?:pg_transport|barrier)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
# Named in the docs as loggers, not as Python objects.
LOGGERS = {"pg_transport.web.audit"}
# Design pages of features not built yet: the names they propose do not exist until the
# feature lands (the page then moves its names into user docs, and out of this list).
PROPOSALS: set[str] = set()


def doc_names() -> list[str]:
    docs = ROOT / "docs"
    pages = [
        p for p in sorted(docs.rglob("*.md")) if p.relative_to(docs).as_posix() not in PROPOSALS
    ]
    files = [ROOT / "README.md", *pages]
    found = set()
    for path in files:
        found.update(_NAME.findall(path.read_text(encoding="utf-8")))
    return sorted(found)


def resolve(name: str) -> object:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_the_docs_name_python_objects_at_all() -> None:
    assert len(doc_names()) >= 10, doc_names()


@pytest.mark.parametrize("name", doc_names())
def test_every_dotted_name_in_the_docs_exists(name: str) -> None:
    if name in LOGGERS:
        module = importlib.import_module(name.rsplit(".", 1)[0])
        assert module is not None
        assert name in logging.Logger.manager.loggerDict, name
        return
    assert resolve(name) is not None


def test_the_proposals_left_out_are_pages_that_exist() -> None:
    for page in PROPOSALS:
        assert (ROOT / "docs" / page).is_file(), page
