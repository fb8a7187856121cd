"""The delivery guard: a hand-over to the pool that raises gives its slot back, whether
it ran at once or later, when a slot freed up (from the pool's own callback)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from celery.worker import state
from kombu.asynchronous.semaphore import LaxBoundedSemaphore

from pg_transport.kombu.guard import guard


class Worker:
    """Celery's WorkController as the prefork pool sets it up: a semaphore of one slot."""

    def __init__(self) -> None:
        self.semaphore = LaxBoundedSemaphore(1)
        self.ran: list[str] = []

    def _process_task_sem(self, req: Any) -> Any:
        return self.semaphore.acquire(self._process_task, req)

    def _process_task(self, req: Any) -> None:
        if req.bad:
            raise ValueError("too many values to unpack (expected 2)")
        self.ran.append(req.name)  # the pool has it: its slot is released when done


class Req:
    def __init__(self, name: str, *, bad: bool = False) -> None:
        self.name, self.id, self.bad = name, name, bad
        self.rejected: list[bool] = []
        self.message = SimpleNamespace(channel=SimpleNamespace(qos=None))

    def reject(self, requeue: bool = False) -> None:
        self.rejected.append(requeue)


def test_a_raise_after_the_slot_was_taken_gives_it_back_busy_or_idle() -> None:
    worker = Worker()
    consumer = SimpleNamespace(controller=worker, on_task_request=worker._process_task_sem)
    guard(consumer)
    # Idle: the bad one takes the only slot and raises at once.
    bad = Req("bad", bad=True)
    state.task_reserved(bad)
    consumer.on_task_request(bad)
    assert bad.rejected == [False] and bad not in state.reserved_requests
    assert worker.semaphore.value == 1
    # Busy: a good one holds the slot; the bad one waits, and runs when it is released.
    consumer.on_task_request(Req("good"))
    late = Req("late", bad=True)
    consumer.on_task_request(late)
    consumer.on_task_request(Req("after"))
    assert worker.ran == ["good"]
    worker.semaphore.release()  # "good" finished: late raises inside the release
    assert late.rejected == [False]
    assert worker.ran == ["good", "after"]
    worker.semaphore.release()
    assert worker.semaphore.value == 1


def test_without_a_semaphore_the_hand_over_itself_is_guarded() -> None:
    worker = Worker()
    consumer = SimpleNamespace(controller=worker, on_task_request=worker._process_task)
    guard(consumer)
    bad = Req("bad", bad=True)
    consumer.on_task_request(bad)
    consumer.on_task_request(Req("good"))
    assert bad.rejected == [False] and worker.ran == ["good"]
