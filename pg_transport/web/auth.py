"""The console's sign-ins: sessions kept by the console, and a limit on failed attempts.

The sign-in cookie names a session, not an operator: the console keeps its sessions, so
signing out ends one for good (a copy of the cookie kept elsewhere signs in no more),
and every session ends after :data:`SESSION_SECONDS`, or when the console stops.
A client that fails :data:`SIGN_IN_ATTEMPTS` sign-ins within :data:`SIGN_IN_WINDOW`
seconds is refused until its oldest failure leaves the window, however right its next
guess: the token cannot be guessed at the speed of the network.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable

__all__ = [
    "SESSION_SECONDS",
    "SIGN_IN_ATTEMPTS",
    "SIGN_IN_WINDOW",
    "Sessions",
    "SignInLimit",
]

#: Seconds a sign-in lasts.
SESSION_SECONDS = 12 * 3600.0
#: Failed sign-ins a client may make within SIGN_IN_WINDOW seconds.
SIGN_IN_ATTEMPTS = 5
SIGN_IN_WINDOW = 300.0
#: Clients (and sessions) remembered at most: the oldest is forgotten past it.
MAX_TRACKED = 10_000

Clock = Callable[[], float]


class Sessions:
    """Live sign-ins: a random id per session, with who and until when."""

    def __init__(self, seconds: float = SESSION_SECONDS, clock: Clock = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        self._live: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def open(self, name: str) -> str:
        session = secrets.token_urlsafe(32)
        self._live[session] = (name, self._clock() + self.seconds)
        while len(self._live) > MAX_TRACKED:
            self._live.popitem(last=False)
        return session

    def user(self, session: str) -> str | None:
        """Who signed in with ``session``; None once it ended or if it never was."""
        found = self._live.get(session)
        if found is None:
            return None
        name, ends = found
        if self._clock() >= ends:
            del self._live[session]
            return None
        return name

    def close(self, session: str) -> None:
        self._live.pop(session, None)


class SignInLimit:
    """Failed sign-ins per client address, within a sliding window."""

    def __init__(
        self,
        attempts: int = SIGN_IN_ATTEMPTS,
        window: float = SIGN_IN_WINDOW,
        clock: Clock = time.monotonic,
    ) -> None:
        self.attempts = attempts
        self.window = window
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def wait(self, client: str) -> float:
        """Seconds ``client`` must wait before it may try again (0: it may now)."""
        failures = self._failures.get(client)
        if failures is None:
            return 0.0
        now = self._clock()
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        if not failures:
            del self._failures[client]
            return 0.0
        if len(failures) < self.attempts:
            return 0.0
        return failures[0] + self.window - now

    def failed(self, client: str) -> None:
        failures = self._failures.setdefault(client, deque(maxlen=self.attempts))
        failures.append(self._clock())
        self._failures.move_to_end(client)
        while len(self._failures) > MAX_TRACKED:
            self._failures.popitem(last=False)

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)
