"""The redis-fsync benchmark broker: a Redis of its own that fsyncs every write, started
for a round and gone after it, whatever happens to it on the way."""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import pytest
import redis

from benchmarks import targets
from benchmarks.targets import RedisFsyncBroker

needs_server = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server is not installed"
)


def _refused(url: str) -> bool:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.ConnectionError:
        return True
    return False


@needs_server
def test_each_round_gets_a_server_of_its_own_that_writes_to_disk_before_it_answers(
    tmp_path: Path,
) -> None:
    broker = RedisFsyncBroker(data_dir=tmp_path)
    assert broker.check() is None
    first, second = broker.setup("r1"), broker.setup("r2")
    try:
        assert first.broker_url != second.broker_url
        assert "6379" not in first.broker_url and first.queue == "bench_r1"
        client = redis.Redis.from_url(first.broker_url)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        client.lpush("celery", b"payload-of-round-one")
        # Written to the append-only file by the time LPUSH answered.
        written = b"".join(p.read_bytes() for p in tmp_path.rglob("*.aof"))
        assert b"payload-of-round-one" in written
        assert redis.Redis.from_url(second.broker_url).llen("celery") == 0
    finally:
        broker.teardown(first)
    assert _refused(first.broker_url)
    assert not redis.Redis.from_url(second.broker_url).exists("celery")  # the other lives on
    broker.teardown(second)
    assert _refused(second.broker_url)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_server_or_data_directory_is_a_reason_to_skip(tmp_path: Path) -> None:
    missing = RedisFsyncBroker(server="no-such-redis-server-here")
    assert missing.check() == (
        "no-such-redis-server-here not found on PATH (this broker starts a Redis of its own)"
    )
    gone = tmp_path / "gone"
    # Any program on PATH gets past the first check.
    present = RedisFsyncBroker(data_dir=gone, server=sys.executable)
    assert present.check() == f"data directory {gone} does not exist"


@needs_server
def test_a_server_that_cannot_start_fails_setup_with_its_log_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: a connection is refused
        port = taken.getsockname()[1]
        monkeypatch.setattr(targets, "free_port", lambda: port)
        broker = RedisFsyncBroker(data_dir=tmp_path)
        exited = r"(?s)redis-server exited with 1: .*Address already in use"
        with pytest.raises(RuntimeError, match=exited):
            broker.setup("r1")
    assert list(tmp_path.iterdir()) == []
    assert broker._running == {}
