"""kombu's failover URLs on pgq: ``pgq://a;pgq://b`` and Celery's list-valued ``broker_url``.

kombu splits a broker URL at every ``;`` into alternates (``Connection.alt``) and, when a
connection fails, ``Connection.switch()``-es to the next one, re-parsing it with its own
URL parser into host, port, user, password and virtual host. Two things of that do not
fit a pgq URL: kombu's parser hands every query parameter (``sslmode``,
``target_session_attrs``, …) to ``Connection`` as a keyword it does not take, and the
alternates are reported as they were written (``Connection.info()``, so ``celery inspect
stats``), passwords included.

So when a transport first meets a connection's alternates, each is checked to be a whole
pgq URL (a raw ``;`` inside a password splits a URL into pieces that are not, and is
refused with the rule: write it ``%3B``), and replaced, in kombu's list, by a *switch
form*: its user, host, port and database only, the password shown as ``***`` followed by
a digest of the whole URL (which tells two alternates apart that differ only in their
parameters, and reveals nothing of the password). The full URL is kept here, under the
fields kombu's parser reads from that form; the transport a switch creates finds its URL
by those fields (:func:`full_url`). kombu's round-robin
strategy (its default) reads the list as it goes round, so it switches to the forms; a
strategy that copies the list first (``shuffle``) switches to the URLs as written.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any
from urllib.parse import quote

from kombu.utils.url import parse_url as kombu_parse_url

from pg_transport.db.url import MASK, parse_url, scheme_of
from pg_transport.errors import ConfigurationError

__all__ = ["adopt", "full_url"]

Key = tuple[Any, Any, Any, Any, Any]

_lock = threading.Lock()
#: The fields kombu reads from a switch form -> the full URL it stands for.
_urls: dict[Key, str] = {}
#: Switch forms made so far (a clone of a connection passes them on as its alternates).
_forms: set[str] = set()


def _key(fields: dict[str, Any]) -> Key:
    return (
        fields.get("userid") or None,
        str(fields.get("password") or ""),
        fields.get("hostname") or "",
        fields.get("port"),
        fields.get("virtual_host") or "",
    )


def _switch_form(url: str, params: dict[str, str]) -> str:
    digest = hashlib.blake2b(url.encode("utf-8"), digest_size=4, person=b"pgq-alt").hexdigest()
    user = quote(params.get("user", ""), safe="") + f":{MASK}{digest}@"
    hosts, ports = params.get("host", ""), params.get("port", "")
    if "," in hosts or "," in ports or hosts.startswith("/"):
        # kombu's parser takes one host and one port: a libpq host list (or a socket
        # directory) stands in the form as text kombu keeps whole.
        netloc = quote(f"{hosts}|{ports}", safe="")
    else:
        netloc = quote(hosts, safe="") + (f":{ports}" if ports else "")
    return f"pgq://{user}{netloc}/{quote(params.get('dbname', ''), safe='')}"


def adopt(alternates: list[Any]) -> None:
    """Check kombu's alternates and put their switch forms in their place (in place)."""
    count = len(alternates)
    for index, url in enumerate(alternates):
        # Every piece first: a raw ';' in a password leaves a piece that is no URL at all,
        # and that (not the piece before it, whose "port" is part of the password) is
        # what to report.
        scheme = scheme_of(url) if isinstance(url, str) else None
        if scheme is None or scheme.lower() != "pgq":
            raise ConfigurationError(
                f"the broker URL is a list of {count} failover URLs (kombu splits a URL at "
                f"every ';'), and part {index + 1} is not a pgq:// URL: each alternate must "
                "be a whole pgq URL, and a ';' inside a user name or password must be "
                "written %3B"
            )
    for index, url in enumerate(alternates):
        if url in _forms:
            continue
        try:
            params = parse_url(url)
        except ConfigurationError as exc:
            raise ConfigurationError(f"failover URL {index + 1} of {count}: {exc}") from None
        form = _switch_form(url, params)
        key = _key(kombu_parse_url(form))
        with _lock:
            _urls[key] = url
            _forms.add(form)
        alternates[index] = form


def full_url(client: Any) -> str | None:
    """The URL a switch form stands for, from the fields kombu parsed out of it."""
    key = _key(
        {
            "userid": client.userid,
            "password": client.password,
            "hostname": client.hostname,
            "port": client.port,
            "virtual_host": client.virtual_host,
        }
    )
    with _lock:
        return _urls.get(key)
