"""The transport's word that it refused a chord's header part (no database): sent for
the part ``before_task_publish`` noted on this thread, and for nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pg_transport.kombu import chord_parts
from pg_transport.message.unique import UniqueError
from pg_transport.signals import chord_part_refused

EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": {"task": "app.body"}}


@pytest.fixture
def heard() -> Iterator[list[dict[str, Any]]]:
    got: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        got.append(kwargs)

    chord_part_refused.connect(receiver, weak=False, dispatch_uid="test-chord-parts")
    yield got
    chord_part_refused.disconnect(receiver, dispatch_uid="test-chord-parts")


def message(task_id: str) -> dict[str, Any]:
    return {
        "headers": {"task": "app.part", "id": task_id, "group": "g1"},
        "properties": {"correlation_id": task_id},
    }


def test_a_refused_chord_part_is_announced_once(heard: list[dict[str, Any]]) -> None:
    error = UniqueError("refused")
    chord_parts.note(((), {}, EMBED), {"id": "p1", "group": "g1"}, {})
    chord_parts.refused(message("p1"), error)
    chord_parts.refused(message("p1"), error)  # noted once: announced once
    assert [(h["sender"], h["task_id"], h["group_id"], h["exc"]) for h in heard] == [
        ("app.part", "p1", "g1", error)
    ]


def test_protocol_1_names_its_group_in_the_body(heard: list[dict[str, Any]]) -> None:
    chord_parts.note({"id": "p1", "taskset": "g9", "chord": {"task": "b"}}, {}, {})
    chord_parts.refused(message("p1"), UniqueError("refused"))
    assert [h["group_id"] for h in heard] == ["g9"]


def test_nothing_is_announced_for_another_message(heard: list[dict[str, Any]]) -> None:
    chord_parts.note(((), {}, EMBED), {"id": "p1", "group": "g1"}, {})
    chord_parts.refused(message("other"), UniqueError("refused"))  # not the noted part
    # A task outside a chord's header (a group's part, a plain task) is not noted.
    no_chord = {**EMBED, "chord": None}
    chord_parts.note(((), {}, no_chord), {"id": "p2", "group": "g1"}, {})
    chord_parts.refused(message("p2"), UniqueError("refused"))
    assert heard == []
