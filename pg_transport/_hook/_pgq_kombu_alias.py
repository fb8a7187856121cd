"""Install-time registration of the ``pgq://`` scheme with kombu.

kombu has no entry-point group for transports: it resolves a URL scheme through
the ``kombu.transport.TRANSPORT_ALIASES`` dict. A ``.pth`` file installed next to
this module imports it at interpreter start-up. Importing kombu there would slow
every Python process down, so instead this module waits: it adds a meta-path
finder that notices the moment ``kombu.transport`` is imported and adds the
alias right after the module body runs. A process that never imports kombu pays
one list insertion.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

ALIAS = "pgq"
TARGET = "pg_transport.transport:Transport"
_WATCHED = "kombu.transport"


def _register(module: types.ModuleType) -> None:
    aliases = getattr(module, "TRANSPORT_ALIASES", None)
    if isinstance(aliases, dict):
        aliases.setdefault(ALIAS, TARGET)


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
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _AliasLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register now if kombu is loaded, else when it is."""
    loaded = sys.modules.get(_WATCHED)
    if loaded is not None:
        _register(loaded)
        return
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


install()
