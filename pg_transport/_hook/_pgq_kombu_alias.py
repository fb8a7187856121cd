"""Install-time registration of the ``pgq://`` scheme with kombu and Celery.

kombu has no entry-point group for transports: it resolves a URL scheme through
the ``kombu.transport.TRANSPORT_ALIASES`` dict; Celery resolves a result backend's
scheme through ``celery.app.backends.BACKEND_ALIASES`` the same way. A ``.pth`` file
installed next to this module imports it at interpreter start-up. Importing kombu there would slow
every Python process down, so instead this module waits: it adds a meta-path
finder that notices the moment ``kombu.transport`` (or ``celery.app.backends``) is
imported and adds the alias right after the module body runs. A process that never
imports them pays one list insertion.

With Celery's backend table it connects one receiver to Celery's ``import_modules``
signal (a worker, beat, ``celery report``): an app whose ``result_backend`` is a pgq
URL has it sealed there, before any of Celery's surfaces shows it
(:mod:`pg_transport.results.masking`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

ALIAS = "pgq"
TARGET = "pg_transport.transport:Transport"
BACKEND_TARGET = "pg_transport.results.backend:PgqBackend"
# The module watched -> (its alias table, what pgq names in it).
_WATCHED = {
    "kombu.transport": ("TRANSPORT_ALIASES", TARGET),
    "celery.app.backends": ("BACKEND_ALIASES", BACKEND_TARGET),
}


def _register(module: types.ModuleType) -> None:
    table, target = _WATCHED[module.__name__]
    aliases = getattr(module, table, None)
    if isinstance(aliases, dict):
        aliases.setdefault(ALIAS, target)
    if module.__name__ == "celery.app.backends":
        from celery import signals

        signals.import_modules.connect(_seal_result_backend, weak=False, dispatch_uid=ALIAS)


def _seal_result_backend(sender: object = None, **_: object) -> None:
    conf = getattr(sender, "conf", None)
    backend = conf.get("result_backend") if conf is not None else None
    # Only an app with a pgq backend pays for importing pgq.
    if isinstance(backend, str) and backend[: len(ALIAS) + 3].lower() == ALIAS + "://":
        from pg_transport.results.masking import seal_result_backend

        seal_result_backend(sender)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader) -> None:
        self._wrapped = wrapped

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._wrapped.exec_module(module)
        _register(module)

    def __getattr__(self, name: str) -> object:
        # get_source, get_filename, is_package… stay those of the real loader.
        return getattr(self._wrapped, name)


class _AliasFinder(importlib.abc.MetaPathFinder):
    # Two copies of this module may be loaded (the installed one, and the package's when
    # ``import pg_transport`` runs without site): each finder steps over all of them,
    # by this marker, or they would ask each other for ever.
    pgq_alias_finder = True

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "pgq_alias_finder", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _AliasLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register now in what is loaded, and in the rest when it is."""
    waiting = False
    for name in _WATCHED:
        loaded = sys.modules.get(name)
        if loaded is not None:
            _register(loaded)
        else:
            waiting = True
    if waiting and not any(getattr(f, "pgq_alias_finder", False) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


install()
