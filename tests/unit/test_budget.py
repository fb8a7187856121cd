"""The session budget parallel runs share (tests/budget.py): real file locks, real
processes; a holder that waits is seen waiting (the gate locked) before it is let go."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests import budget
from tests.acceptance.harness import wait_for

ROOT = Path(__file__).resolve().parents[2]


def waiter_said(directory: Path) -> bool:
    """Whether a holder is at the gate and has written what it needs (the gate alone may
    be a holder's look at it, for an instant, before it queues there)."""
    path = directory / budget.NEED
    return budget.gate_held(directory) and path.exists() and path.read_text() != ""


def holding(directory: Path, wanted: int, done: threading.Event) -> threading.Thread:
    """A thread whose own Budget holds ``wanted`` tokens, then sets ``done``."""

    def run() -> None:
        mine = budget.Budget(directory)
        mine.hold(wanted)
        done.set()
        threading.Event().wait()  # keeps ``mine`` (a daemon thread: ends with the process)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_test_that_needs_every_token_waits_until_the_holders_give_theirs_back(
    tmp_path: Path,
) -> None:
    budget.make(tmp_path, 4)
    small = budget.Budget(tmp_path)
    small.hold(3)
    everything = threading.Event()
    holding(tmp_path, 4, everything)
    wait_for(lambda: waiter_said(tmp_path), 10, "the big holder to wait at the gate")
    assert not everything.is_set()
    small.release()
    assert everything.wait(10), "the big holder never got the whole budget"


def test_holders_side_by_side_never_hold_more_than_the_budget(tmp_path: Path) -> None:
    budget.make(tmp_path, 5)
    in_use = [0]
    most = [0]
    lock = threading.Lock()
    start = threading.Barrier(4)

    def run(wanted: int) -> None:
        mine = budget.Budget(tmp_path)
        start.wait()
        for _ in range(10):
            mine.hold(wanted)
            with lock:
                in_use[0] += wanted
                most[0] = max(most[0], in_use[0])
                assert in_use[0] <= 5
            with lock:
                in_use[0] -= wanted
            mine.release()

    threads = [threading.Thread(target=run, args=(n,)) for n in (1, 2, 3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert in_use == [0]
    assert 1 <= most[0] <= 5


def test_holding_fewer_gives_the_rest_back_at_once(tmp_path: Path) -> None:
    budget.make(tmp_path, 4)
    first = budget.Budget(tmp_path)
    first.hold(4)
    first.hold(1)
    assert first.held == 1
    got = threading.Event()
    holding(tmp_path, 3, got)
    assert got.wait(10)


HOLDER = """
import sys
from pathlib import Path
from tests import budget
mine = budget.Budget(Path(sys.argv[1]))
mine.hold(int(sys.argv[2]))
print("held", flush=True)
sys.stdin.read()
"""


def test_a_killed_holder_s_tokens_come_back(tmp_path: Path) -> None:
    budget.make(tmp_path, 3)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), "3"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        got = threading.Event()
        holding(tmp_path, 3, got)
        wait_for(lambda: waiter_said(tmp_path), 10, "the holder to wait at the gate")
        assert not got.is_set()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert got.wait(10), "a killed process's tokens were not given back"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_holders_keeping_their_share_from_test_to_test_let_a_waiting_big_one_in(
    tmp_path: Path,
) -> None:
    budget.make(tmp_path, 4)
    one, two = budget.Budget(tmp_path), budget.Budget(tmp_path)
    one.hold(2)
    two.hold(2)
    big = threading.Event()
    holding(tmp_path, 4, big)
    wait_for(lambda: waiter_said(tmp_path), 10, "the big holder to wait at the gate")
    # Their next tests need no more than before, but someone waits: they give theirs back
    # and queue behind it (each hold below returns only once the big holder got its four
    # and... never gives them back: so they are asked from threads of their own).
    queued = [threading.Event(), threading.Event()]
    for mine, done in zip((one, two), queued, strict=True):
        threading.Thread(target=lambda m=mine, d=done: (m.hold(2), d.set()), daemon=True).start()
    assert big.wait(10), "the big holder was starved by holders keeping their share"
    assert not any(done.is_set() for done in queued)  # behind it: it holds all four


def test_a_holder_keeps_its_share_past_a_waiter_that_fits_beside_it(tmp_path: Path) -> None:
    budget.make(tmp_path, 6)
    long_test, small = budget.Budget(tmp_path), budget.Budget(tmp_path)
    long_test.hold(3)  # a long test of a third process, running
    small.hold(2)
    big = threading.Event()
    holding(tmp_path, 4, big)  # waits for the long test's tokens (1 is free)
    wait_for(lambda: waiter_said(tmp_path), 10, "the big holder to wait at the gate")
    # Its next test needs no more than it holds, and the waiter's 4 fit beside its 2:
    # it goes on at once instead of idling behind the waiter until the long test ends.
    small.hold(2)
    assert small.held == 2 and not big.is_set()
    long_test.release()
    assert big.wait(10), "the waiter never got in beside the holder that kept its share"


def test_only_as_many_keep_their_share_past_a_waiter_as_leave_it_room(tmp_path: Path) -> None:
    budget.make(tmp_path, 6)
    long_test = budget.Budget(tmp_path)
    long_test.hold(2)
    one, two = budget.Budget(tmp_path), budget.Budget(tmp_path)
    one.hold(1)
    two.hold(1)
    big, let_go = threading.Event(), threading.Event()

    def waiter() -> None:
        mine = budget.Budget(tmp_path)
        mine.hold(5)  # 2 free: it waits for the long test
        big.set()
        let_go.wait()
        mine.release()

    threading.Thread(target=waiter, daemon=True).start()
    wait_for(lambda: waiter_said(tmp_path), 10, "the big holder to wait at the gate")
    one.hold(1)  # 5 + 1 fit: kept
    assert one.held == 1
    queued = threading.Event()
    threading.Thread(target=lambda: (two.hold(1), queued.set()), daemon=True).start()
    # 5 + one's 1 + its own 1 do not fit in 6: it gives its token back and queues.
    wait_for(lambda: two.held == 0, 10, "the second keeper to give its token back")
    assert not queued.is_set()
    long_test.release()
    assert big.wait(10), "the waiter never got in"
    let_go.set()
    assert queued.wait(10), "the queued holder never got its token after the waiter"
