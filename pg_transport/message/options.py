"""What ordering, limits, unique tasks and fair share do alike with Celery's options and a
task's defaults: move ``apply_async``'s options into the message's headers
(:func:`move_options`), and find a key a task attribute names for one call
(:func:`key_of`)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

__all__ = ["key_of", "move_options"]


def move_options(message: dict[str, Any], options: Mapping[str, str]) -> None:
    """Move ``options`` (``apply_async`` option -> header), which Celery passes on as
    message properties, into the headers, where a retry of the task keeps them. A header
    already there wins; an option given as None is dropped."""
    properties = message.get("properties")
    if not isinstance(properties, dict) or not any(o in properties for o in options):
        return
    headers = message.get("headers")
    if not isinstance(headers, dict):
        headers = message["headers"] = {}
    for option, header in options.items():
        if option in properties:
            value = properties.pop(option)
            if value is not None:
                headers.setdefault(header, value)


def key_of(
    task: Any, option: str, spec: Any, args: Any, kwargs: Any, error: type[Exception]
) -> Any:
    """The value a task's ``option`` attribute (``spec``: a callable of the call's
    arguments, or an argument's name) gives for a call of ``args`` and ``kwargs``;
    ``error`` naming the task and the option when it gives none."""
    args = list(args) if isinstance(args, (list, tuple)) else []
    kwargs = dict(kwargs) if isinstance(kwargs, Mapping) else {}
    if callable(spec):
        return spec(*args, **kwargs)
    if not isinstance(spec, str):
        raise error(f"task {task.name}: {option}={spec!r} must name an argument or be callable")
    if spec in kwargs:
        return kwargs[spec]
    try:
        bound = inspect.signature(task.run).bind_partial(*args)
    except (TypeError, ValueError):
        bound = None
    if bound is not None and spec in bound.arguments:
        return bound.arguments[spec]
    raise error(
        f"task {task.name}: {option} names argument {spec!r}, which this call does not pass"
    )
