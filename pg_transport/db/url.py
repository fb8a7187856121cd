"""Passwords in broker URLs: masked from what libpq parsed, on every surface.

A pgq URL is a libpq URL under another scheme, and libpq alone decides which part of
it is a password: it percent-decodes, reads a raw ``#`` or ``?`` inside the user part
as part of the password, and takes ``?password=`` and ``?sslpassword=`` from the query.
A pattern over the text cannot follow all of that, so nothing here masks text: every
URL that is shown is *built* from libpq's parameters, with each secret as :data:`MASK`,
and a URL libpq cannot parse is described, never quoted.

kombu keeps a URL it does not parse itself whole in ``Connection.hostname``, which
Celery reports in ``inspect stats``. :func:`seal` splits a URL into the masked URL
(fit for ``hostname``) and the :class:`Credentials` kombu keeps in its own ``password``
field (which Celery drops from stats); :func:`unseal` puts the two back together.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote

import psycopg
from psycopg import conninfo as pg_conninfo

from pg_transport.errors import ConfigurationError

__all__ = [
    "MASK",
    "SECRET_KEYS",
    "URL_FORM",
    "Credentials",
    "SealedURL",
    "build_url",
    "first_port",
    "mask_url",
    "parse_url",
    "scheme_of",
    "seal",
    "seal_text",
    "unseal",
]

MASK = "***"
#: The libpq parameters whose values are never shown.
SECRET_KEYS = ("password", "sslpassword")
URL_FORM = "pgq://[user[:password]@]host[:port]/dbname[?params]"

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")

# libpq's URL syntax errors quote the offending part of the URL, which may be part of
# a password: each known one is replaced by a description of our own, and any other
# (a newer or translated libpq) by the generic one.
_LIBPQ_SYNTAX_ERRORS = (
    (
        "invalid percent-encoded token",
        "a '%' not followed by two hex digits (write '%' itself as %25)",
    ),
    ("forbidden value %00", "a percent-encoded NUL (%00)"),
    ("unexpected spaces", "a space (write it as %20)"),
    ("missing key/value separator", 'a query parameter without its key/value separator "="'),
    ("extra key/value separator", 'a query parameter with a second "="'),
    ("invalid URI query parameter", "a query parameter libpq does not know"),
    ("end of string reached when looking for matching", 'an IPv6 host without its matching "]"'),
    ("IPv6 host address may not be empty", "an empty IPv6 host"),
    ("unexpected character", 'an unexpected character after an IPv6 host (expected ":" or "/")'),
)


@dataclass(frozen=True, repr=False)
class Credentials:
    """The secrets of a broker URL, kept apart from the URL that may be shown.

    Its text is the mask: printed by accident (a debug dump of a kombu
    Connection's info), it still shows no secret.
    """

    password: str | None = None
    sslpassword: str | None = None

    def as_params(self) -> dict[str, str]:
        """The libpq parameters these credentials set."""
        given = {"password": self.password, "sslpassword": self.sslpassword}
        return {key: value for key, value in given.items() if value is not None}

    def __repr__(self) -> str:
        return f"Credentials({MASK})"

    __str__ = __repr__


def _malformed(problem: str) -> ConfigurationError:
    return ConfigurationError(f"malformed broker URL: {problem}")


def _syntax_error(exc: psycopg.Error) -> str:
    text = str(exc).strip()
    for start, problem in _LIBPQ_SYNTAX_ERRORS:
        if text.startswith(start):
            return f"libpq cannot parse it: it has {problem}"
    return "libpq cannot parse it"


def scheme_of(url: str | None) -> str | None:
    """The scheme of ``url`` (``pgq``, ``redis``, ...), None when it has none.

    What may be said of a URL that is not a pgq URL: no part of it past the scheme.
    """
    scheme, sep, _ = (url or "").partition("://")
    return scheme if sep and _SCHEME.fullmatch(scheme) else None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _stray_at(rest: str) -> bool:
    """Whether libpq would read a raw '@' as part of a host or database name.

    libpq ends the user part at the first '@' or '/', whichever comes first. An '@'
    after that and before the query means a user name or password held a raw '@' or
    '/': libpq would read the rest of the password as a host, port or database, and
    connecting, or showing the URL, would show it.
    """
    at, slash = rest.find("@"), rest.find("/")
    user_part_ends = at if at >= 0 and (slash < 0 or at < slash) else -1
    return "@" in rest[user_part_ends + 1 :].partition("?")[0]


def _check_ports(ports: str) -> None:
    listed = ports.split(",")
    for index, port in enumerate(listed, 1):
        if port and not (port.isascii() and port.isdigit() and 0 < int(port) <= 65535):
            # The value is not quoted: in `pgq://user:secret` (no '@host') libpq reads
            # the password as a port.
            which = f"port {index} of {len(listed)}" if len(listed) > 1 else "the port"
            raise _malformed(f"{which} is not a number between 1 and 65535")


def parse_url(url: str | None) -> dict[str, str]:
    """The libpq parameters of a ``pgq://`` URL (``pgq://`` or nothing: libpq defaults).

    Everything libpq accepts in a ``postgresql://`` URL works (multi-host lists, unix
    sockets, query parameters). A URL it cannot parse, or would misread, is a
    :class:`ConfigurationError` that says what is wrong without quoting the URL.
    Ports are checked here: libpq would only notice a bad one when connecting.
    """
    if not url:
        return {}
    scheme, rest = scheme_of(url), url.partition("://")[2]
    if scheme is None:
        raise _malformed(f"no scheme, expected {URL_FORM}")
    if scheme.lower() != "pgq":
        raise _malformed(f"scheme {scheme + '://'!r} is not pgq://, expected {URL_FORM}")
    if "\x00" in rest:
        raise _malformed("a NUL character")  # libpq would read up to it only
    if not _encodes(rest):
        raise _malformed("a character that UTF-8 cannot encode (a lone surrogate)")
    if _stray_at(rest):
        raise _malformed(
            "an '@' after the host: a '@' or '/' in the user name or password must be "
            "percent-encoded (%40, %2F)"
        )
    try:
        parsed = pg_conninfo.conninfo_to_dict("postgresql://" + rest)
    except psycopg.ProgrammingError as exc:
        raise _malformed(_syntax_error(exc)) from None
    params = {key: str(value) for key, value in parsed.items() if value is not None}
    _check_ports(params.get("port", ""))
    return params


def first_port(url: str) -> int | None:
    """The port libpq tries first for ``url`` (None: none written, libpq's default)."""
    port = parse_url(url).get("port", "").split(",")[0]
    return int(port) if port else None


def _quote(text: str, safe: str = "") -> str:
    # '*' is left as it is, so that the mask reads as *** and not %2A%2A%2A.
    return quote(text, safe="*" + safe)


def _host(host: str) -> str:
    if ":" in host and not host.startswith("/"):
        return f"[{quote(host, safe=':')}]"  # IPv6
    return quote(host, safe="")


def _netloc(hosts: str | None, ports: str | None) -> str | None:
    """The URL's host part for libpq's host and port lists; None when it cannot say
    them (one port for several hosts, an empty host): they then go in the query."""
    if hosts is None:
        return "" if ports is None else None
    host_list = hosts.split(",")
    if not all(host_list):
        return None
    if len(host_list) == 1:
        # In the URL, `h:` is no port at all, and `h:1,2` two hosts.
        if ports == "" or (ports and "," in ports):
            return None
        return _host(hosts) + (f":{ports}" if ports else "")
    # From a multi-host URL libpq always lists one port per host, empty or not.
    port_list = ports.split(",") if ports is not None else []
    if len(port_list) != len(host_list):
        return None
    pairs = zip(host_list, port_list, strict=True)
    return ",".join(_host(host) + (f":{port}" if port else "") for host, port in pairs)


def build_url(params: Mapping[str, str]) -> str:
    """A ``pgq://`` URL that libpq parses back to exactly ``params``.

    What the URL's user, host and path parts cannot say (an empty value, say)
    stays a query parameter.
    """
    rest = dict(params)
    userinfo = ""
    user, password = rest.pop("user", ""), rest.pop("password", "")
    if password:
        userinfo = f"{_quote(user)}:{_quote(password)}@"
    elif user:
        userinfo = f"{_quote(user)}@"
    for key, value in (("user", user), ("password", password)):
        if key in params and not value:
            rest[key] = value
    hosts, ports = rest.pop("host", None), rest.pop("port", None)
    netloc = _netloc(hosts, ports)
    if netloc is None:
        netloc = ""
        rest.update(
            {key: value for key, value in (("host", hosts), ("port", ports)) if value is not None}
        )
    dbname = rest.pop("dbname", "")
    path = "/" + _quote(dbname) if dbname else ""
    if "dbname" in params and not dbname:
        rest["dbname"] = dbname
    query = "&".join(f"{_quote(key)}={_quote(value, '/:,')}" for key, value in rest.items())
    if query and not path:
        path = "/"
    return f"pgq://{userinfo}{netloc}{path}{'?' + query if query else ''}"


def _masked(params: Mapping[str, str]) -> dict[str, str]:
    return {key: MASK if key in SECRET_KEYS else value for key, value in params.items()}


def mask_url(url: str | None) -> str:
    """``url`` as it may be shown: built from libpq's parse, every secret as ``***``.

    A URL that cannot be parsed is not shown at all: what is wrong with it is.
    """
    try:
        params = parse_url(url)
    except ConfigurationError as exc:
        return f"<{exc}>"
    return build_url(_masked(params))


def seal(url: str) -> tuple[str, Credentials | None]:
    """(``url`` masked, its secrets); ``None`` when it has none to keep apart."""
    params = parse_url(url)
    secrets = {key: params[key] for key in SECRET_KEYS if key in params}
    if not secrets:
        return url, None
    return build_url(_masked(params)), Credentials(**secrets)


def unseal(url: str, password: object) -> str:
    """The URL to connect with: ``url`` with the secrets of ``password`` put back.

    ``password`` is kombu's ``password`` field: :class:`Credentials` from :func:`seal`,
    which replace what ``url`` shows for them; a plain password (Celery's
    ``broker_password``), used when ``url`` has none of its own; or nothing.
    """
    if isinstance(password, Credentials):
        params = parse_url(url)
        for key in SECRET_KEYS:
            params.pop(key, None)
        return build_url({**params, **password.as_params()})
    if isinstance(password, str) and password:
        params = parse_url(url)
        if "password" not in params:
            return build_url({**params, "password": password})
    return url


class SealedURL(str):
    """A URL held where others read it as text: its text is the masked URL.

    Celery shows a setting such as ``result_backend`` through a pattern of its own
    (``inspect conf``, ``report``, Flower's Config tab), which misses a raw ``#`` or
    ``?`` in a password and ``?password=``. A SealedURL put in the setting shows only
    what :func:`mask_url` shows, whoever reads it and however they mask it; the URL to
    connect with is :attr:`url`, for pgq alone to read.
    """

    __slots__ = ("_url",)

    _url: str

    def __new__(cls, url: str) -> SealedURL:
        sealed = super().__new__(cls, mask_url(url))
        sealed._url = url
        return sealed

    @property
    def url(self) -> str:
        """The URL itself, secrets included."""
        return self._url

    def __reduce__(self) -> tuple[type[SealedURL], tuple[str]]:
        # A pickled setting carries the URL, as the plain text it replaced did.
        return (SealedURL, (self._url,))


def seal_text(url: str) -> str:
    """``url`` as a :class:`SealedURL` when a pgq URL shown as it is would show a secret
    or could not be parsed; any other text as it is."""
    if isinstance(url, SealedURL) or scheme_of(url) is None:
        return url
    if str(scheme_of(url)).lower() != "pgq":
        return url
    try:
        params = parse_url(url)
    except ConfigurationError:
        return SealedURL(url)  # shown as what is wrong with it; the backend says so
    if not any(key in params for key in SECRET_KEYS):
        return url
    return SealedURL(url)
