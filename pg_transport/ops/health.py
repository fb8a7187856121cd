"""Worker health for container healthchecks: has the worker's consume loop turned lately?

A worker is healthy while its consumer keeps cycling: claiming and delivering
messages, or waiting out an idle poll (Celery's consume loop returns from every
``drain_events`` within a few seconds even when nothing arrives). A process that is
alive but no longer consuming — stopped (SIGSTOP), deadlocked, stuck in a call that
never returns, retrying a lost connection — stops the heartbeat, and so does a
dead one. Checking that the process exists, or that Postgres answers, would call
all of these healthy.

A worker whose loop turns but which holds tasks it never starts is not healthy either:
tasks wait for its pool (reserved) while the pool runs nothing. Its leases are renewed
all the same, so no other worker gets those messages. The heartbeat step watches for
that (:class:`Stuck`) and writes since when into the heartbeat file; ``pgq health`` fails
once it has lasted past the same threshold. (A full pool running long tasks is not
stuck, nor are ETA or rate-limited tasks waiting their turn: Celery does not count them
as reserved until it hands them to the pool.)

The worker side is a Celery consumer bootstep, :class:`HeartbeatStep`, which touches
a heartbeat file (``PGQ_HEALTH_FILE``) after every consume-loop cycle; add it with
:func:`install`. ``pgq health`` compares the file's age with a threshold
(``PGQ_HEALTH_STALE_SECONDS``). The file lives on the worker's own filesystem, so
every replica of a scaled-out service has its own.

Other users of the machine may share the directory the file is in, so the file is
never written through a path someone else could have prepared: it is written to a new
temporary file beside it and renamed over it (a symlink planted at the path is
replaced, never followed), and a beat touches it only while it is still the file this
process wrote. The default location is a directory of its own in the temporary
directory (``pgq-<uid>``), created private (0700); one that exists but is not a real
directory of this user's, closed to everyone else, is refused rather than used, by the
worker and by ``pgq health`` alike (in it, someone else could fake a healthy heartbeat).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import bootsteps

from pg_transport import backoff, fencing

__all__ = [
    "DEFAULT_STALE_SECONDS",
    "FILE_ENV",
    "STALE_ENV",
    "Health",
    "Heartbeat",
    "HeartbeatStep",
    "Stuck",
    "UnsafeDirectory",
    "check",
    "default_file",
    "heartbeat_path",
    "install",
]

logger = logging.getLogger("pg_transport.health")

#: Where the worker writes its heartbeat and ``pgq health`` reads it.
FILE_ENV = "PGQ_HEALTH_FILE"
#: Seconds without a consume-loop cycle after which ``pgq health`` fails.
STALE_ENV = "PGQ_HEALTH_STALE_SECONDS"
# Celery's consume loop waits at most 2 s per cycle when idle; a minute leaves room
# for a slow claim on a loaded server without hiding a stuck worker for long.
DEFAULT_STALE_SECONDS = 60.0
# A busy worker cycles many times a second; one filesystem write per second is enough.
MIN_BEAT_INTERVAL = 1.0
_WRAPPED = "_pgq_heartbeat"


class UnsafeDirectory(OSError):
    """The default heartbeat directory exists, but others could write (or read) in it."""


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def default_dir() -> Path:
    """``pgq-<uid>`` in the temporary directory: one per user, so none is shared.

    Not ``$XDG_RUNTIME_DIR``: it is set in login sessions only, so a worker run by
    systemd and the ``pgq health`` a container runtime execs would look in different
    places. ``$TMPDIR`` (read through :func:`tempfile.gettempdir`) applies to both.
    """
    return Path(tempfile.gettempdir()) / f"pgq-{_uid()}"


def default_file() -> Path:
    """Where the worker writes its heartbeat and ``pgq health`` reads it by default."""
    return default_dir() / "worker.heartbeat"


def heartbeat_path(environ: Mapping[str, str]) -> Path:
    return Path(environ[FILE_ENV]) if environ.get(FILE_ENV) else default_file()


def _check_private(directory: Path) -> None:
    """Refuse ``directory`` unless it is a real directory of ours that only we may enter."""
    found = os.lstat(directory)  # lstat: a symlink to a directory is not one
    if not stat.S_ISDIR(found.st_mode):
        raise UnsafeDirectory(
            f"{directory} is not a directory (a symlink or a file is in its place): "
            f"refusing it for the heartbeat; remove it, or set {FILE_ENV}"
        )
    if found.st_uid != _uid():
        raise UnsafeDirectory(
            f"{directory} belongs to uid {found.st_uid}, not to this user (uid {_uid()}): "
            f"refusing it for the heartbeat; remove it, or set {FILE_ENV}"
        )
    if found.st_mode & 0o077:
        raise UnsafeDirectory(
            f"{directory} has mode {stat.S_IMODE(found.st_mode):04o}, open to other users "
            f"(it must be 0700): refusing it for the heartbeat; remove it, or set {FILE_ENV}"
        )


def _prepare_dir(path: Path) -> None:
    """Make the directory ``path`` is written in; the default one private, and checked."""
    directory = path.parent
    if directory != default_dir():
        # The operator chose this location (PGQ_HEALTH_FILE): created if missing, and
        # the write itself stays safe in a shared directory.
        directory.mkdir(parents=True, exist_ok=True)
        return
    # Made by an earlier worker, or by someone else: checked below either way.
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    _check_private(directory)


class Heartbeat:
    """A file whose modification time is the last sign of life of a consume loop."""

    def __init__(
        self,
        path: Path,
        *,
        min_interval: float = MIN_BEAT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.min_interval = min_interval
        self.clock = clock
        self._last: float | None = None
        #: (device, inode) of the file this process last wrote at ``path``.
        self._written: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._warned = False
        self._info: dict[str, Any] = {}

    def start(self) -> None:
        """Write the file afresh (who is beating, since when) and count it as a beat."""
        if not self._info:
            self._info = {
                "pid": os.getpid(),
                "hostname": socket.gethostname(),
                "started_at": time.time(),
            }
        try:
            _prepare_dir(self.path)
            written = self._write(json.dumps(self._info))
        except OSError as exc:
            self._warn(exc)
            return
        with self._lock:
            self._written = written
            self._last = self.clock()

    def stuck(self, since: float | None, waiting: int = 0) -> None:
        """Say in the file that the worker has held ``waiting`` tasks without starting
        any since ``since`` (wall clock; None: it is not stuck). Written when it changes."""
        found = self._info.get("stuck_since")
        if since == found and (since is None or waiting == self._info.get("waiting")):
            return
        if since is None:
            self._info.pop("stuck_since", None)
            self._info.pop("waiting", None)
        else:
            self._info.update(stuck_since=since, waiting=waiting)
        self.start()

    def broker_refused(self, since: float | None, why: str | None) -> None:
        """Say in the file that the broker has refused this worker since ``since`` (wall
        clock), for ``why`` (None: it is not refused). Written when it changes."""
        if since == self._info.get("refused_since"):
            return
        if since is None:
            self._info.pop("refused_since", None)
            self._info.pop("refused_why", None)
        else:
            self._info.update(refused_since=since, refused_why=(why or "")[:500])
        self.start()

    def refused(self, counts: Mapping[str, int]) -> None:
        """Say in the file how many acks and renewals the fencing refused in this process
        (each a task that runs twice: :mod:`pg_transport.fencing`). Written when it
        changes."""
        found = {k: int(v) for k, v in counts.items() if v}
        if found == (self._info.get("refused") or {}):
            return
        self._info["refused"] = found
        self.start()

    def _write(self, text: str) -> tuple[int, int]:
        """Replace the file with ``text``; the (device, inode) of the file written.

        mkstemp creates a new file (O_EXCL, mode 0600) under a name nobody could guess
        in advance, and rename replaces whatever is at the path (a symlink included)
        without following it: nothing outside the new file is ever written, and the
        health check never reads a half-written file.
        """
        fd, tmp = tempfile.mkstemp(
            dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"
        )
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                written = os.fstat(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return written.st_dev, written.st_ino

    def _ours(self) -> bool:
        """Whether the path is still the file this process wrote (not removed, not
        replaced by another file or a symlink)."""
        with self._lock:
            written = self._written
        try:
            found = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return written == (found.st_dev, found.st_ino) and stat.S_ISREG(found.st_mode)

    def beat(self) -> None:
        """Mark the file fresh, at most once per ``min_interval``."""
        now = self.clock()
        with self._lock:
            if self._last is not None and now - self._last < self.min_interval:
                return
            self._last = now
        if not self._ours():
            # Removed behind our back (a tmp cleaner), or replaced: write ours again.
            self.start()
            return
        try:
            # Not following symlinks: a swap between the check above and this call
            # touches the planted link itself, never what it points to.
            os.utime(self.path, follow_symlinks=False)
        except OSError as exc:
            self._warn(exc)

    def clear(self) -> None:
        """Remove the file: a worker that shut down is not healthy."""
        ours = self._ours()  # someone else's file at the path is not ours to remove
        with self._lock:
            self._last = None
            self._written = None
        if not ours:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._warn(exc)

    def _warn(self, exc: OSError) -> None:
        # A read-only or full filesystem must not take the worker down; the health
        # check will report the missing or stale file instead.
        if not self._warned:
            self._warned = True
            logger.warning("cannot write the pgq heartbeat file %s: %s", self.path, exc)


class Stuck:
    """Since when a worker has had tasks waiting for its pool while its pool runs nothing.

    Fed what Celery's worker state says at each beat: how many requests wait for the
    pool (reserved, not started) and how many run. Waiting with nothing running is a
    moment's state in a healthy worker (the pool picks a task up within milliseconds);
    lasting, it is a worker that will not run what it holds."""

    def __init__(self) -> None:
        self.since: float | None = None

    def observe(self, waiting: int, running: int, now: float) -> float | None:
        if waiting and not running:
            if self.since is None:
                self.since = now
        else:
            self.since = None
        return self.since


def _pool_state() -> tuple[int, int] | None:
    """(waiting, running) requests of this worker; None when they could not be read (a
    pool thread changed them while they were counted)."""
    from celery.worker import state

    try:
        running = set(state.active_requests)
        waiting = set(state.reserved_requests) - running
    except RuntimeError:  # changed during iteration: read at the next beat
        return None
    return len(waiting), len(running)


class HeartbeatStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: beat after every cycle of the consume loop.

    Celery's blocking consume loop (the one pgq workers run) calls the consumer
    connection's ``drain_events`` once per cycle, so the step wraps that method on
    the connection it is started with; after a reconnect Celery starts the step
    again with the new connection. With an event loop (hub) the beat is a timer
    on the hub instead, which fires only while that loop turns.
    """

    requires = ("celery.worker.consumer.connection:Connection",)
    label = "pgq heartbeat"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.heartbeat = Heartbeat(heartbeat_path(os.environ))
        _current[:] = [(os.getpid(), self.heartbeat)]
        backoff.BACKOFF.watch(broker_refused)
        self._timer: Any = None
        self._stuck = Stuck()

    def pulse(self) -> None:
        """A turn of the consume loop: beat, and say whether the pool is stuck."""
        found = _pool_state()
        if found is not None:
            since = self._stuck.observe(*found, now=time.time())
            self.heartbeat.stuck(since, found[0])
        self.heartbeat.refused(fencing.counts())
        self.heartbeat.beat()

    def start(self, c: Any) -> None:
        heartbeat = self.heartbeat
        heartbeat.start()
        if c.hub is not None:
            self._timer = c.hub.call_repeatedly(MIN_BEAT_INTERVAL, self.pulse)
            return
        connection = c.connection
        drain = connection.drain_events
        pulse = self.pulse
        if getattr(drain, _WRAPPED, False):
            return  # the same connection again (a restart): wrapped once is enough

        def drain_events(**kwargs: Any) -> Any:
            try:
                return drain(**kwargs)
            finally:
                # Also after the idle timeout (socket.timeout) and after errors: the
                # loop turned. A drain that never returns never gets here.
                pulse()

        setattr(drain_events, _WRAPPED, True)
        connection.drain_events = drain_events

    def stop(self, c: Any) -> None:
        # A reconnect stops and restarts the step: cancel the timer, keep the file (a
        # short reconnect is not a failure; a long one goes stale on its own).
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def shutdown(self, c: Any) -> None:
        self.stop(c)
        self.heartbeat.clear()


# The heartbeat of this process's worker (pid, heartbeat), once its step is built.
_current: list[tuple[int, Heartbeat]] = []


def broker_refused(since: float | None, why: str | None) -> None:
    """The broker refuses this worker since ``since`` (None: no more): its heartbeat file
    says so, and ``pgq health`` fails while it does. Told by :mod:`pg_transport.backoff`
    (a :data:`~pg_transport.backoff.Watcher` of its back-off, given by the step)."""
    for pid, heartbeat in list(_current):
        if pid == os.getpid():
            heartbeat.broker_refused(since, why)


def install(app: Any) -> None:
    """Add :class:`HeartbeatStep` to ``app``'s workers (call once, where the app is made)."""
    app.steps["consumer"].add(HeartbeatStep)


@dataclass(frozen=True)
class Health:
    healthy: bool
    #: One line for a human: what was found, and what it means.
    message: str
    #: Seconds since the last beat; None when there is no heartbeat file.
    age: float | None


def check(path: Path, stale_after: float, *, now: float | None = None) -> Health:
    """Whether the heartbeat at ``path`` is at most ``stale_after`` seconds old."""
    if path.parent == default_dir():
        try:
            _check_private(path.parent)
        except FileNotFoundError:
            pass  # no directory, so no file: reported as missing below
        except OSError as exc:
            return Health(False, str(exc), None)
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return Health(
            False,
            f"no heartbeat file {path}: the worker has not started consuming, has shut "
            f"down, or writes elsewhere ({FILE_ENV})",
            None,
        )
    now = time.time() if now is None else now
    age = max(0.0, now - mtime)
    info = _info(path)
    who = _who(info)
    stuck = _stuck_for(info, now)
    refused = info.get("refused_since")
    if isinstance(refused, (int, float)) and not isinstance(refused, bool):
        return Health(
            False,
            f"worker{who} has been refused by the broker for "
            f"{max(0.0, now - float(refused)):.1f}s: {str(info.get('refused_why'))[:500]} "
            f"(heartbeat {path})",
            age,
        )
    if stuck is not None and stuck > stale_after:
        return Health(
            False,
            f"worker{who} has held {info.get('waiting')} task(s) without starting any for "
            f"{stuck:.1f}s while its pool runs nothing (stuck after {stale_after:g}s; "
            f"heartbeat {path})",
            age,
        )
    if age > stale_after:
        return Health(
            False,
            f"worker{who} has not consumed for {age:.1f}s (stale after {stale_after:g}s; "
            f"heartbeat {path})",
            age,
        )
    return Health(
        True,
        f"worker{who} consumed {age:.1f}s ago (stale after {stale_after:g}s){_refused(info)}",
        age,
    )


def _refused(info: dict[str, Any]) -> str:
    """What the heartbeat file says the fencing refused (each a task run twice)."""
    found = info.get("refused")
    if not isinstance(found, dict):
        return ""
    parts = [
        f"{n} {what}(s)"
        for what, n in sorted(found.items())
        if what in ("ack", "renewal") and isinstance(n, int) and not isinstance(n, bool) and n > 0
    ]
    if not parts:
        return ""
    return f"; refused by the fencing (lease lapsed, task run again): {', '.join(parts)}"


def _info(path: Path) -> dict[str, Any]:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _who(info: dict[str, Any]) -> str:
    try:
        return f" pid {int(info['pid'])} on {info['hostname']}"
    except (ValueError, KeyError, TypeError):
        return ""


def _stuck_for(info: dict[str, Any], now: float) -> float | None:
    """Seconds the worker has been stuck, as its heartbeat file says (None: it is not)."""
    since = info.get("stuck_since")
    if isinstance(since, bool) or not isinstance(since, (int, float)):
        return None
    return max(0.0, now - float(since))
