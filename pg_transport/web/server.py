"""Running the console: ``pgq web``."""

from __future__ import annotations

import asyncio
import logging
import signal

import tornado.httpserver
import tornado.netutil

from pg_transport.db.pool import Connector
from pg_transport.web.app import make_app
from pg_transport.web.base import Console
from pg_transport.web.sampler import Sampler

__all__ = ["serve", "start"]

logger = logging.getLogger("pg_transport.web")


#: Seconds a client has to send a request's headers (or, between requests, to start
#: the next one), and its body: a connection that sends nothing, or a byte now and
#: then, is closed instead of kept for ever.
HEADER_TIMEOUT = 10.0
BODY_TIMEOUT = 30.0


def start(
    console: Console, host: str, port: int, *, header_timeout: float = HEADER_TIMEOUT
) -> tuple[tornado.httpserver.HTTPServer, int]:
    """Listen on ``host:port`` (0: any free port); the server and the port it has."""
    server = tornado.httpserver.HTTPServer(
        make_app(console),
        xheaders=False,
        idle_connection_timeout=header_timeout,
        body_timeout=BODY_TIMEOUT,
    )
    sockets = tornado.netutil.bind_sockets(port, host)
    server.add_sockets(sockets)
    return server, int(sockets[0].getsockname()[1])


def serve(
    connector: Connector,
    schema: str,
    *,
    host: str,
    port: int,
    token: str | None,
    interval: float,
    allowed_hosts: tuple[str, ...] = (),
    announce: object = print,
    url: str | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, sampling every ``interval`` seconds meanwhile.

    The console's log (``pg_transport.web``, its audit lines on ``pg_transport.web.audit``)
    goes to stderr at INFO unless the application configured logging already.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("pg_transport.web").setLevel(logging.INFO)
    import ipaddress

    try:
        ipaddress.ip_address(host)
        named: tuple[str, ...] = ()
    except ValueError:
        named = (host,)  # listening on a name: requests to that name are expected
    console = Console(
        connector,
        schema,
        token=token,
        interval=interval,
        where=connector.display_url,
        allowed_hosts=frozenset((*named, *allowed_hosts)),
        url=url,
    )
    sampler = Sampler(connector, schema, interval)

    async def main() -> None:
        server, bound = start(console, host, port)
        sampler.start()
        if callable(announce):
            announce(
                f"pgq console of schema {schema!r} at {connector.display_url} on "
                f"http://{host}:{bound}/ ({'actions need the token' if token else 'read-only'})"
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.stop()

    try:
        asyncio.run(main())
    finally:
        sampler.stop()
        console.executor.shutdown(wait=False, cancel_futures=True)
