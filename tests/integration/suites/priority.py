"""Priority: higher first (0-255, as RabbitMQ with x-max-priority), FIFO within one."""

from __future__ import annotations

from kombu import Connection


class Priority:
    def test_higher_first_fifo_within(self, connection: Connection) -> None:
        queue = connection.SimpleQueue("prio")
        for label, prio in [("a", 0), ("b", 200), ("c", 5), ("d", 200), ("e", 255)]:
            queue.put({"l": label}, priority=prio)
        got = []
        for _ in range(5):
            message = queue.get(timeout=10)
            got.append(message.payload["l"])
            message.ack()
        assert got == ["e", "b", "d", "c", "a"]
        queue.close()
