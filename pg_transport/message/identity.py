"""Which argument of a task identifies the work it belongs to.

``register("app.tasks.run_pipeline", execution_id=2, organization_id=0)`` says:
the pipeline's ``execution_id`` is the kwarg of that name, or else positional
argument 2. ``watch("execution_id")`` says: look for a kwarg of that name in every
task's message, registered or not. When a message is poisoned, :func:`recover` finds
those values so the owning pipeline can be marked failed instead of stranded. pgq
itself knows no field names: they are the application's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["clear", "recover", "register", "registered", "watch", "watched"]

_registry: dict[str, dict[str, int]] = {}
# Looked for by name in the kwargs of every task, registered or not.
_watched: list[str] = []

# Values an identity may hold: JSON scalars that name something.
_SCALARS = (str, int, float)


def register(task_name: str, **fields: int) -> None:
    """Register the identity fields of a task: ``field=positional index``."""
    if not isinstance(task_name, str) or not task_name:
        raise ValueError(f"identity.register needs a task name, got {task_name!r}")
    if not fields:
        raise ValueError(f"identity.register({task_name!r}) needs at least one field=index")
    for name, index in fields.items():
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(
                f"identity.register({task_name!r}): {name}={index!r} must be a "
                "non-negative positional index"
            )
    _registry[task_name] = dict(fields)


def registered(task_name: str) -> dict[str, int]:
    return dict(_registry.get(task_name, {}))


def watch(*names: str) -> None:
    """Look for kwargs of these names in every task's message, registered or not."""
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"identity.watch needs field names, got {name!r}")
        if name not in _watched:
            _watched.append(name)


def watched() -> tuple[str, ...]:
    return tuple(_watched)


def clear() -> None:
    """Forget every registration and watched name (for tests)."""
    _registry.clear()
    _watched.clear()


def _usable(name: str, value: Any, where: str, reasons: list[str]) -> bool:
    if isinstance(value, bool) or not isinstance(value, _SCALARS):
        reasons.append(f"{name}: {where} holds {type(value).__name__}, not a str or number")
        return False
    return True


def recover(task_name: str | None, args: Any, kwargs: Any) -> tuple[dict[str, Any], list[str]]:
    """The identity fields of a task call, and why any could not be recovered.

    kwargs by name first, then the registered positional index; bounds and type
    are checked. Never raises: a bad layout yields fewer fields and a reason.
    """
    identity: dict[str, Any] = {}
    reasons: list[str] = []
    named = kwargs if isinstance(kwargs, Mapping) else {}
    if kwargs is not None and not isinstance(kwargs, Mapping):
        reasons.append(f"kwargs is {type(kwargs).__name__}, not a mapping")
    positional: Sequence[Any] | None = args if isinstance(args, (list, tuple)) else None
    if args is not None and positional is None:
        reasons.append(f"args is {type(args).__name__}, not a list")
    fields = _registry.get(task_name or "", {})
    for name, index in fields.items():
        if name in named:
            if _usable(name, named[name], "kwarg", reasons):
                identity[name] = named[name]
        elif positional is None:
            reasons.append(f"{name}: no kwarg and no positional args")
        elif index >= len(positional):
            reasons.append(
                f"{name}: positional index {index} out of range ({len(positional)} args)"
            )
        elif _usable(name, positional[index], f"args[{index}]", reasons):
            identity[name] = positional[index]
    for name in _watched:
        if name not in fields and name in named and _usable(name, named[name], "kwarg", reasons):
            identity[name] = named[name]
    return identity, reasons
