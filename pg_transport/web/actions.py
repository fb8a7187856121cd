"""The console's actions on dead letters: requeue, rehook, purge; and signing in for them.

There are none unless the console was started with a token. Each is a POST (Tornado
rejects one without the XSRF token of the form it came from), by a signed-in operator,
and is logged on ``pg_transport.web.audit`` with who, from where, and what it changed.
A purge is asked again on a page of its own before it is done.
"""

from __future__ import annotations

import math
import re
from typing import Any

import tornado.web

from pg_transport.errors import ConfigurationError
from pg_transport.ops.dead import DeadLetters, NotFound
from pg_transport.web.base import MAX_IDS, USER_COOKIE, Base, Problem, audit

__all__ = ["routes"]

#: An operator's name as given at sign-in: what the audit log says they are.
_NAME = re.compile(r"^[\w .@+-]{1,64}$")


class Login(Base):
    def get(self) -> None:
        if not self.console.actions:
            raise tornado.web.HTTPError(404, "this console is read-only: it has no token")
        self.page("login.html", failed=False, name="")

    def post(self) -> None:
        if not self.console.actions:
            raise tornado.web.HTTPError(404, "this console is read-only: it has no token")
        name = self.get_body_argument("name", "").strip()
        token = self.get_body_argument("token", "")
        client = str(self.request.remote_ip)
        wait = self.console.sign_ins.wait(client)
        if wait > 0:
            # Not even compared: a right token now would tell a guesser it was right.
            audit.warning("sign-in from %s refused: too many failed attempts", client)
            raise Problem(
                429,
                "Too many failed sign-ins",
                f"Too many failed sign-ins from this address: try again in {math.ceil(wait)} s.",
                retry_after=math.ceil(wait),
            )
        if not _NAME.match(name) or not self.console.token_matches(token):
            self.console.sign_ins.failed(client)
            audit.warning("sign-in refused from %s (name %r)", client, name[:64])
            self.set_status(403)
            self.page("login.html", failed=True, name=name[:64])
            return
        self.console.sign_ins.succeeded(client)
        self.set_signed_cookie(
            USER_COOKIE,
            self.console.sessions.open(name),
            expires_days=None,
            httponly=True,
            samesite="Strict",
            secure=self.over_tls,
        )
        audit.info("%s signed in from %s", name, client)
        self.redirect("/dead")


class Logout(Base):
    def post(self) -> None:
        if self.current_user:
            audit.info("%s signed out", self.current_user)
        session = self.session()
        if session:
            # Ended here, not only forgotten by this browser: a copy of the cookie is dead.
            self.console.sessions.close(session)
        self.clear_cookie(USER_COOKIE)
        self.redirect("/queues")


class Action(Base):
    def prepare(self) -> None:
        super().prepare()
        if not self.console.actions:
            raise tornado.web.HTTPError(
                403,
                "this console is read-only: it was started "
                "without a token, so no action is possible",
            )
        if not self.current_user:
            raise tornado.web.HTTPError(403, "sign in with the console's token first")

    def ids(self) -> list[int]:
        raw = self.get_body_arguments("id")
        if not raw:
            raise tornado.web.HTTPError(400, "no dead-letter row chosen")
        if len(raw) > MAX_IDS:
            raise tornado.web.HTTPError(400, f"at most {MAX_IDS} rows at once")
        try:
            return sorted({int(v) for v in raw})
        except ValueError:
            raise tornado.web.HTTPError(400, "a dead-letter id is not a number") from None

    def who(self) -> str:
        return f"{self.current_user} from {self.request.remote_ip}"

    def done(self, message: str) -> None:
        self.page("done.html", message=message)


class Requeue(Action):
    async def post(self) -> None:
        ids = self.ids()
        dead = DeadLetters(self.console.store)
        moved: dict[str, list[int]] = await self.db(lambda: dead.requeue(ids))
        count = sum(len(v) for v in moved.values())
        audit.info(
            "%s requeued dead letters %s: %s", self.who(), ids, {q: v for q, v in moved.items()}
        )
        missing = sorted(set(ids) - {i for v in moved.values() for i in v})
        self.done(
            f"{count} dead-letter row{'s' if count != 1 else ''} requeued"
            + "".join(f"; {len(v)} to queue {q!r}" for q, v in moved.items())
            + (f"; not found (requeued or purged already): {missing}" if missing else "")
        )


class Rehook(Action):
    async def post(self) -> None:
        ids = self.ids()
        dead = DeadLetters(self.console.store)

        def run() -> list[str]:
            lines = []
            for ident in ids:
                try:
                    result = dead.rehook(ident)
                except NotFound:
                    lines.append(f"row {ident}: not found")
                    continue
                except ConfigurationError as exc:
                    lines.append(f"row {ident}: {exc} (start the console with --app)")
                    continue
                ok = sum(1 for o in result.outcomes if o["ok"])
                lines.append(
                    f"row {ident}: {ok} of {len(result.outcomes)} handlers ok"
                    + ("" if result.recorded else "; requeued or purged meanwhile, not recorded")
                )
            return lines

        lines = await self.db(run)
        audit.info("%s rehooked dead letters %s: %s", self.who(), ids, lines)
        self.done("; ".join(lines))


class Purge(Action):
    async def post(self) -> None:
        ids = self.ids()
        if self.get_body_argument("confirm", "") != "yes":
            # Asked again, on a page of its own: nothing is deleted by the first POST.
            self.page("confirm_purge.html", ids=ids)
            return
        query = self.console.reads.q["web_dead_purge_ids"]

        def purge() -> list[Any]:
            return self.console.connector.run(
                lambda conn: conn.execute(query, {"ids": ids}).fetchall(), idempotent=False
            )

        rows = await self.db(purge)
        audit.info("%s purged dead letters %s", self.who(), [(int(i), q) for i, q in rows])
        self.done(f"{len(rows)} dead-letter row{'s' if len(rows) != 1 else ''} purged")


def routes(args: dict[str, Any]) -> list[Any]:
    return [
        (r"/login", Login, args),
        (r"/logout", Logout, args),
        (r"/dead/requeue", Requeue, args),
        (r"/dead/rehook", Rehook, args),
        (r"/dead/purge", Purge, args),
    ]
