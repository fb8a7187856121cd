"""``pg_transport.UniqueTask``: a Celery task base whose duplicate publish returns the
``AsyncResult`` of the task that holds its unique key (docs/flow-control.md).

Celery picks a task's id before it publishes, and ``apply_async`` returns an
``AsyncResult`` of that id whatever the publish did; a duplicate is never run, so that
result would never be ready. This base asks the publish to raise
:class:`~pg_transport.errors.DuplicateTask` and answers with the holder's id instead,
unless the call (or the task) asked for the error itself (``unique_conflict="raise"``).
"""

from __future__ import annotations

from typing import Any

from celery import Task

from pg_transport.errors import DuplicateTask

__all__ = ["UniqueTask"]


class UniqueTask(Task):  # type: ignore[misc]
    """A task whose duplicate publish returns the existing task's ``AsyncResult``."""

    abstract = True

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        conflict = options.get("unique_conflict", getattr(self, "unique_conflict", "return"))
        options["unique_conflict"] = "raise"
        try:
            return super().apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )
        except DuplicateTask as duplicate:
            if conflict == "raise":
                raise
            return self.AsyncResult(duplicate.existing_id)
