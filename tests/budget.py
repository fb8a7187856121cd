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
needs many tokens is not starved by small ones: the gate's holder writes how many it
needs, and a process that would keep its tokens for its next test (or take a few more
that are free) does so only while what it wants, what the waiter needs and what the
other processes that kept theirs past the waiter hold fit in the budget together (a
test running meanwhile gives its tokens back when it ends: the waiter gets them); else
it gives them back and queues at the gate too. (Giving back always made a process of quick unit
tests idle for as long as a long acceptance test of a third process ran, which a waiter
needing fewer tokens than were left had to wait for anyway.) The gate's holder waits on
a token held by someone else with a blocking lock, never by polling.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

GATE = "gate"
#: The gate's holder and what it needs in all (``<name>\t<n>``, written under the gate;
#: empty when it has left, absent before anyone queued there).
NEED = "need"


def make(directory: Path, total: int) -> None:
    """Lay out a budget of ``total`` tokens in ``directory`` (made by the run's controller)."""
    directory.mkdir(parents=True, exist_ok=True)
    for n in range(total):
        (directory / f"token-{n}").touch()
    (directory / GATE).touch()


def gate_held(directory: Path) -> bool:
    """Whether some holder is at the gate of the budget in ``directory`` now (waiting for
    tokens, or looking at the gate for an instant)."""
    with open(directory / GATE, "rb") as gate:
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(gate, fcntl.LOCK_UN)
        return False


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
        #: This holder's name among the run's (a process may hold several in tests).
        self.name = f"{os.getpid()}.{id(self)}"
        self._kept = False  # whether the last hold kept tokens past a waiter

    @property
    def held(self) -> int:
        return len(self._held)

    def hold(self, wanted: int) -> None:
        """Hold exactly ``min(wanted, total)`` tokens: give back the surplus at once, or give
        back everything and wait at the gate for the whole number."""
        wanted = max(0, min(wanted, self.total))
        self._kept = False
        try:
            waiter, keepers = self._waiter_needs()
            if waiter + keepers + wanted <= self.total:  # (nobody waiting: 0)
                for path in list(self._held)[wanted:]:
                    self._give_back(path)
                if self._take_free(wanted):
                    self._kept = waiter > 0
                    return
            self._hold_at_gate(wanted)
        finally:
            self._note()

    def _hold_at_gate(self, wanted: int) -> None:
        # Growing past what is free, or a waiter at the gate needs what this process
        # holds: queue behind them with nothing held (holders that kept their tokens
        # from test to test would starve a big request).
        self.release()
        with open(self.directory / GATE, "rb") as gate:
            fcntl.flock(gate, fcntl.LOCK_EX)
            (self.directory / NEED).write_text(f"{self.name}\t{wanted}")
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
                (self.directory / NEED).write_text("")
                fcntl.flock(gate, fcntl.LOCK_UN)

    def _waiter_needs(self) -> tuple[int, int]:
        """How many tokens the holder at the gate needs in all (0 when nobody is there;
        all of them while it has not said yet: it has just come), and how many the
        other holders that kept theirs past it hold, as each last wrote it."""
        if not gate_held(self.directory):
            return 0, 0
        try:
            waiter, _, need = (self.directory / NEED).read_text().partition("\t")
            needs = int(need)
        except (OSError, ValueError):
            return self.total, 0
        if needs <= 0:
            return self.total, 0
        keepers = 0
        for path in self.directory.glob("held-*"):
            if path.name[len("held-") :] in (self.name, waiter):
                continue
            try:
                held, _, kept = path.read_text().partition("\t")
                keepers += int(held) if kept == "kept" else 0
            except (OSError, ValueError):
                return self.total, 0
        return needs, keepers

    def _take_free(self, wanted: int) -> bool:
        """Take tokens that are free now, without waiting, until ``wanted`` are held:
        whether that many are (if not, what was taken is kept: the caller gives all back)."""
        for path in self._tokens:
            if self.held >= wanted:
                break
            if path not in self._held:
                self._take(path, block=False)
        return self.held >= wanted

    def release(self) -> None:
        for path in list(self._held):
            self._give_back(path)
        self._kept = False
        self._note()

    def _note(self) -> None:
        """Write how many tokens this process holds, for the others' :meth:`hold`."""
        kept = "kept" if self._kept and self._held else ""
        (self.directory / f"held-{self.name}").write_text(f"{self.held}\t{kept}")

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
