"""The session budget of a parallel run (pytest-xdist): tokens shared by its processes.

The suite may hold at most ``PGQ_TEST_MAX_CONNECTIONS`` (30) sessions on the server at
once, whatever number of pytest processes run it. Each test declares how many it holds
at most (``@pytest.mark.sessions(n)``, else its tier's default: tests/conftest.py); before
it starts, its process takes that many tokens of the run's budget, one file lock each, and
gives them back when it is done. A test that needs every token runs alone.

A token is an ``fcntl.flock`` on a file of its own in a directory the controlling process
made for the run, so a process that dies gives its tokens back with its open files. Taking
tokens happens under one more lock, the gate, and a process gives back all it holds before
it waits for the gate: so nobody waits while holding tokens others wait for. A test that
needs many tokens is not starved by small ones: they queue behind it at the gate, and a
process that would keep its tokens for its next test gives them back and queues too when
someone is waiting there. The gate's holder waits on a token held by someone else with a
blocking lock, never by polling.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import IO

GATE = "gate"


def make(directory: Path, total: int) -> None:
    """Lay out a budget of ``total`` tokens in ``directory`` (made by the run's controller)."""
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(total):
        (directory / f"token-{n}").touch()
    (directory / GATE).touch()


class Budget:
    """One process's view of a run's budget: how many tokens it holds, and taking more."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._tokens = sorted(
            (p for p in directory.iterdir() if p.name.startswith("token-")),
            key=lambda p: int(p.name.split("-", 1)[1]),
        )
        self.total = len(self._tokens)
        self._held: dict[Path, IO[bytes]] = {}

    @property
    def held(self) -> int:
        return len(self._held)

    def hold(self, wanted: int) -> None:
        """Hold exactly ``min(wanted, total)`` tokens: give back the surplus at once, or give
        back everything and wait at the gate for the whole number."""
        wanted = max(0, min(wanted, self.total))
        if wanted <= self.held and not self._someone_waiting():
            for path in list(self._held)[wanted:]:
                self._give_back(path)
            return
        # Growing, or someone is waiting at the gate: queue behind them with nothing held
        # (holders that kept their tokens from test to test would starve a big request).
        self.release()
        with open(self.directory / GATE, "rb") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX)
            try:
                while self.held < wanted:
                    free = [p for p in self._tokens if p not in self._held]
                    for path in free:
                        if self.held < wanted:
                            self._take(path, block=False)
                    if self.held < wanted:
                        # All the rest are held by tests running now: wait for one of them.
                        waiting = next(p for p in self._tokens if p not in self._held)
                        self._take(waiting, block=True)
            finally:
                fcntl.flock(gate, fcntl.LOCK_UN)

    def _someone_waiting(self) -> bool:
        """Whether another process is at the gate now (waiting for tokens)."""
        with open(self.directory / GATE, "rb") as gate:
            try:
                fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(gate, fcntl.LOCK_UN)
            return False

    def release(self) -> None:
        for path in list(self._held):
            self._give_back(path)

    def _take(self, path: Path, *, block: bool) -> None:
        handle = open(path, "rb")  # noqa: SIM115 (held open as long as the token)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return
        except BaseException:
            handle.close()
            raise
        self._held[path] = handle

    def _give_back(self, path: Path) -> None:
        handle = self._held.pop(path)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
