"""Add-ons to the ``pgq`` CLI, ``pgq status`` and the console, found by entry point.

An add-on (the barrier is one) names a :class:`Plugin` in its distribution's
``[project.entry-points."pgq.plugins"]``: a click group added to ``pgq`` as is (imported when
named), its rows counted by status (``pgq status``, metrics, the console) and one of its items shown
as a JSON-ready dict (the console). pgq's operator code calls what a plugin offers and
imports nothing of the add-on itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import Any

import click

from pg_transport.db.pool import Connector

__all__ = ["GROUP", "Plugin", "PluginCommands", "names", "plugin"]

#: The entry-point group add-ons register their :class:`Plugin` under.
GROUP = "pgq.plugins"


@dataclass(frozen=True)
class Plugin:
    """What one add-on brings to pgq's operator surfaces."""

    name: str
    #: Added to ``pgq`` under its own name (``pgq barrier show ID``).
    cli: click.Command | None = None
    #: (connector, schema) -> rows by status, every status present.
    status_counts: Callable[[Connector, str], Mapping[str, int]] | None = None
    #: (connector, schema, id) -> one item as a JSON-ready dict, None if unknown.
    show: Callable[[Connector, str, str], dict[str, Any] | None] | None = None


def names() -> list[str]:
    """The installed plugins' names, read from metadata (nothing is imported)."""
    return sorted({entry.name for entry in entry_points(group=GROUP)})


@cache
def plugin(name: str) -> Plugin | None:
    """The installed plugin called ``name``, loaded (its package imported) on first use;
    None if there is none."""
    for entry in entry_points(group=GROUP, name=name):
        loaded = entry.load()
        if not isinstance(loaded, Plugin):
            raise TypeError(
                f"entry point {entry.name!r} of {GROUP} names {entry.value}, "
                f"a {type(loaded).__name__}, not a pg_transport.ops.plugins.Plugin"
            )
        return loaded
    return None


class PluginCommands(click.Group):
    """A click group that also offers each plugin's CLI group under the plugin's name.
    A plugin is imported only when its command runs or the group's help lists it: a
    ``celery`` command (which loads ``celery pgq``) imports no add-on."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *names()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        found = super().get_command(ctx, cmd_name)
        if found is not None or cmd_name not in names():
            return found
        extra = plugin(cmd_name)
        return None if extra is None else extra.cli
