"""kombu's and Celery's own test suites, from the sdist of the installed version.

Their integration tests ship in the source distributions only (``t/integration``). The
sdist of exactly the installed version is downloaded with pip (checked against the
index's hashes) once, and its ``t/`` tree kept in a cache directory
(``PGQ_UPSTREAM_CACHE``, else ``~/.cache/pgq/upstream``), so later runs work offline.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

__all__ = ["UpstreamUnavailable", "cache_dir", "load_module", "source_tree"]

# pip may need this long on a slow or shared machine; a run without network fails
# sooner (pip's own timeouts) and says so.
DOWNLOAD_TIMEOUT = 600
# Written last into an unpacked tree: a tree without it is not used.
COMPLETE = ".pgq-complete"


class UpstreamUnavailable(Exception):
    """The sdist could not be fetched or read (the message says why)."""


def cache_dir() -> Path:
    configured = os.environ.get("PGQ_UPSTREAM_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "pgq" / "upstream"


def source_tree(project: str) -> Path:
    """The unpacked ``t/`` tree (and ``pyproject.toml``) of ``project``'s sdist, of the
    installed version."""
    version = importlib.metadata.version(project)
    root = cache_dir() / f"{project}-{version}"
    if (root / COMPLETE).is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)  # an older or interrupted unpacking
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as scratch:
        archive = _download(project, version, Path(scratch))
        unpacked = Path(scratch) / "unpacked"
        _extract_tests(archive, f"{project}-{version}", unpacked)
        (unpacked / COMPLETE).touch()
        try:
            unpacked.rename(root)
        except OSError:
            if not (root / COMPLETE).is_file():  # not a concurrent run's
                raise
    return root


def _download(project: str, version: str, into: Path) -> Path:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--dest",
        str(into),
        f"{project}=={version}",
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UpstreamUnavailable(f"pip download {project}=={version}: {exc}") from exc
    archives = sorted(into.glob(f"{project}-{version}.tar.gz"))
    if done.returncode != 0 or not archives:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UpstreamUnavailable(f"pip download {project}=={version} failed: {last}")
    return archives[0]


def _extract_tests(archive: Path, top: str, into: Path) -> None:
    """Only ``<top>/t/`` and ``<top>/pyproject.toml`` of ``archive``, as plain files,
    under ``into``."""
    prefix, settings = f"{top}/t/", f"{top}/pyproject.toml"
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                wanted = member.name.startswith(prefix) or member.name == settings
                if not wanted or not member.isfile():
                    continue
                relative = Path(member.name[len(top) + 1 :])
                if ".." in relative.parts or relative.is_absolute():
                    raise UpstreamUnavailable(f"{archive.name}: unsafe member {member.name!r}")
                source = tar.extractfile(member)
                if source is None:
                    continue
                target = into / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                with source, open(target, "wb") as out:
                    shutil.copyfileobj(source, out)
    except (OSError, tarfile.TarError) as exc:
        raise UpstreamUnavailable(f"{archive.name}: {exc}") from exc
    if not (into / "t" / "integration").is_dir():
        raise UpstreamUnavailable(f"{archive.name} has no t/integration")


def load_module(project: str, relative: str, name: str) -> ModuleType:
    """Import ``relative`` (a path in the sdist, e.g. ``t/integration/common.py``) as
    module ``name``."""
    path = source_tree(project) / relative
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UpstreamUnavailable(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
