"""Broker URLs: pgq:// to libpq conninfo, malformed URLs refused, passwords never shown.

The masking tests run a matrix of hostile passwords (every character with a meaning in
a URL, quotes, backslash, non-ASCII, words that appear elsewhere in the URL) through
each way a URL can carry one, and check the text each surface of this process shows:
the masking function, kombu's Connection as Celery reports and censors it.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from urllib.parse import quote

import pytest
from celery import Celery
from celery.app.utils import filter_hidden_settings
from hypothesis import given
from hypothesis import strategies as st
from kombu import Connection
from psycopg.conninfo import conninfo_to_dict

from pg_transport.db.pool import KEEPALIVES, url_to_conninfo
from pg_transport.db.url import MASK, Credentials, build_url, mask_url, parse_url, seal, unseal
from pg_transport.errors import ConfigurationError
from pg_transport.fanin.backend import backend_for
from pg_transport.results.masking import url_of

# -- pgq:// -> libpq ----------------------------------------------------------------


def libpq(url: str) -> dict[str, object]:
    """What the URL gives libpq, less the keepalive defaults every pgq session adds."""
    params = dict(conninfo_to_dict(url_to_conninfo(url)))
    return {k: v for k, v in params.items() if KEEPALIVES.get(k) != v}


def test_every_session_asks_for_keepalives_unless_the_url_says_otherwise() -> None:
    params = dict(conninfo_to_dict(url_to_conninfo("pgq://u@h/db")))
    assert {k: params[k] for k in KEEPALIVES} == KEEPALIVES
    assert KEEPALIVES["keepalives"] == "1"
    own = dict(conninfo_to_dict(url_to_conninfo("pgq://u@h/db?keepalives=0&tcp_user_timeout=0")))
    assert own["keepalives"] == "0" and own["tcp_user_timeout"] == "0"
    assert own["keepalives_idle"] == KEEPALIVES["keepalives_idle"]


def test_full_url_passes_every_part_to_libpq() -> None:
    assert libpq("pgq://user:pass@host:5432/db?sslmode=require") == {
        "user": "user",
        "password": "pass",
        "host": "host",
        "port": "5432",
        "dbname": "db",
        "sslmode": "require",
    }


def test_libpq_parameters_pass_through() -> None:
    params = libpq(
        "pgq://u@h/db?sslmode=verify-full&connect_timeout=3&application_name=app"
        "&target_session_attrs=any&options=-c%20statement_timeout%3D5000"
    )
    assert params["sslmode"] == "verify-full"
    assert params["connect_timeout"] == "3"
    assert params["application_name"] == "app"
    assert params["target_session_attrs"] == "any"
    assert params["options"] == "-c statement_timeout=5000"


def test_unix_socket_url() -> None:
    assert libpq("pgq:///db") == {"dbname": "db"}
    assert libpq("pgq://%2Fvar%2Frun%2Fpostgresql/db") == {
        "host": "/var/run/postgresql",
        "dbname": "db",
    }


@pytest.mark.parametrize("url", ["pgq://", "", None])
def test_empty_url_means_libpq_defaults(url: str | None) -> None:
    conninfo = url_to_conninfo(url)
    assert conninfo_to_dict(conninfo) == KEEPALIVES


def test_multi_host_url() -> None:
    assert libpq("pgq://u@h1:5432,h2:5433/db?target_session_attrs=read-write") == {
        "user": "u",
        "host": "h1,h2",
        "port": "5432,5433",
        "dbname": "db",
        "target_session_attrs": "read-write",
    }


def test_ipv6_host() -> None:
    assert libpq("pgq://u@[::1]:6432/db") == {
        "user": "u",
        "host": "::1",
        "port": "6432",
        "dbname": "db",
    }


def test_scheme_is_case_insensitive() -> None:
    assert libpq("PGQ://u@h/db") == {"user": "u", "host": "h", "dbname": "db"}


def test_percent_encoded_password_reaches_libpq_decoded() -> None:
    assert libpq("pgq://u:p%40ss%2Fw%3Ad@h/db")["password"] == "p@ss/w:d"


# Any text a URL can carry: no NUL (libpq strings end there), no lone surrogates.
passwords = st.text(
    min_size=1,
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
)


@given(passwords)
def test_any_quoted_password_reaches_libpq_intact(password: str) -> None:
    url = f"pgq://u:{quote(password, safe='')}@h/db"
    assert libpq(url)["password"] == password


# -- malformed URLs ----------------------------------------------------------------
# A URL libpq cannot parse (or would misread) is never quoted back, not even in part:
# the part quoted could be a password. The message says what is wrong instead.


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://u@h:6379/0", "scheme 'redis://' is not pgq://"),
        ("postgres://u@h/db", "scheme 'postgres://' is not pgq://"),
        ("u@h/db", "no scheme"),
        ("u:p@h://db", "no scheme"),
        ("pgq://u@h:notaport/db", "the port is not a number"),
        ("pgq://u@h:99999/db", "the port is not a number between 1 and 65535"),
        ("pgq://u@h:0/db", "the port is not a number"),
        ("pgq://u@h1:5432,h2:x/db", "port 2 of 2 is not a number"),
        ("pgq://u@h/db?port=abc", "the port is not a number"),
        ("pgq://u@h/db?bogus=1", "a query parameter libpq does not know"),
        ("pgq://u@h/db?sslmode", 'a query parameter without its key/value separator "="'),
        ("pgq://u@h/db?sslmode=a=b", 'a query parameter with a second "="'),
        ("pgq://u@[::1/db", 'an IPv6 host without its matching "]"'),
        ("pgq://u@[]/db", "an empty IPv6 host"),
        ("pgq://u@[::1]x/db", "an unexpected character after an IPv6 host"),
        ("pgq://u@h/d%zzb", "a '%' not followed by two hex digits"),
        ("pgq://u@h/d%00b", "a percent-encoded NUL"),
        ("pgq://u@h/d b", "a space"),
        ("pgq://u@h/my@db", "an '@' after the host"),
        ("pgq://u:K7q\x00Zx9@h/db", "a NUL character"),
        ("pgq://u:K7q\udcffZx9@h/db", "a character that UTF-8 cannot encode"),
    ],
)
def test_malformed_url_is_a_configuration_error_naming_the_problem(url: str, problem: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        url_to_conninfo(url)
    message = str(info.value)
    assert message.startswith("malformed broker URL: ")
    assert problem in message
    assert not quotes(message, url), "the URL is not quoted back"


def quotes(message: str, url: str, width: int = 5) -> bool:
    """Whether ``message`` holds any ``width`` characters in a row of ``url``'s text."""
    text = url.partition("://")[2] or url
    return any(text[i : i + width] in message for i in range(len(text) - width + 1))


def test_wrong_scheme_message_shows_the_expected_form() -> None:
    with pytest.raises(ConfigurationError, match=r"expected pgq://\[user"):
        url_to_conninfo("redis://localhost:6379/0")


def test_a_url_that_cannot_be_parsed_is_described_not_shown() -> None:
    assert mask_url("pgq://u:Kq7%zzZx9@h/db") == (
        "<malformed broker URL: libpq cannot parse it: it has a '%' not followed by two "
        "hex digits (write '%' itself as %25)>"
    )


# -- the hostile password matrix ----------------------------------------------------

USER, HOST, PORT, DB = "pgq", "db.internal", "5432", "pgq"
# Each password but the last few holds K7q…Zx9, so that a fragment shown anywhere is
# found; the last few are words the URL holds elsewhere: found only by position.
HOSTILE = {
    "hash": "K7q#Zx9",
    "question mark": "K7q?Zx9",
    "slash": "K7q/Zx9",
    "at": "K7q@Zx9",
    "colon": "K7q:Zx9",
    "percent": "K7q%Zx9",
    "percent and hex digits": "K7q%41Zx9",
    "ampersand": "K7q&Zx9",
    "equals": "K7q=Zx9",
    "space": "K7q Zx9",
    "single quote": "K7q'Zx9",
    "double quote": 'K7q"Zx9',
    "backslash": "K7q\\Zx9",
    "non-ASCII": "K7qü☃Zx9",
    "semicolon": "K7q;Zx9",
    "comma": "K7q,Zx9",
    "everything": "K7q#?/@:%&= '\"\\ü;,Zx9",
    "the mask itself": MASK,
    "the user and database name": USER,
    "the port": PORT,
    "a query value": "prefer",
}
# Where libpq reads the raw (unencoded) password intact; anywhere else it reads
# something else, and pgq refuses the URL or shows what libpq read (no password).
RAW_IN_USER_PART = {
    "hash",
    "question mark",
    "colon",
    "ampersand",
    "equals",
    "single quote",
    "double quote",
    "backslash",
    "non-ASCII",
    "semicolon",
    "comma",
    "the mask itself",
    "the user and database name",
    "the port",
    "a query value",
}
RAW_IN_QUERY = {
    "hash",
    "question mark",
    "slash",
    "at",
    "colon",
    "single quote",
    "double quote",
    "backslash",
    "non-ASCII",
    "semicolon",
    "comma",
    "the mask itself",
    "the user and database name",
    "the port",
    "a query value",
}

SHOWN = f"pgq://{USER}:{MASK}@{HOST}:{PORT}/{DB}?sslmode=prefer"
SHOWN_SSL = f"pgq://{USER}@{HOST}:{PORT}/{DB}?sslmode=prefer&sslpassword={MASK}"


TAIL = f"{HOST}:{PORT}/{DB}"
# Each way a URL carries a password: (the URL, the key libpq reads it as, the URL shown).
WAYS: dict[str, tuple[Callable[[str], str], str, str]] = {
    "encoded in the user part": (
        lambda pw: f"pgq://{USER}:{quote(pw, safe='')}@{TAIL}?sslmode=prefer",
        "password",
        SHOWN,
    ),
    "encoded ?password=": (
        lambda pw: f"pgq://{USER}@{TAIL}?password={quote(pw, safe='')}&sslmode=prefer",
        "password",
        SHOWN,
    ),
    "encoded ?sslpassword=": (
        lambda pw: f"pgq://{USER}@{TAIL}?sslmode=prefer&sslpassword={quote(pw, safe='')}",
        "sslpassword",
        SHOWN_SSL,
    ),
    "raw in the user part": (
        lambda pw: f"pgq://{USER}:{pw}@{TAIL}?sslmode=prefer",
        "password",
        SHOWN,
    ),
    "raw ?password=": (
        lambda pw: f"pgq://{USER}@{TAIL}?sslmode=prefer&password={pw}",
        "password",
        SHOWN,
    ),
    "raw ?sslpassword=": (
        lambda pw: f"pgq://{USER}@{TAIL}?sslmode=prefer&sslpassword={pw}",
        "sslpassword",
        SHOWN_SSL,
    ),
}


def carries(way: str, name: str) -> bool:
    if way == "raw in the user part":
        return name in RAW_IN_USER_PART
    return name in RAW_IN_QUERY if way.startswith("raw") else True


def matrix() -> list[tuple[str, str, str, str, str]]:
    """(password, way, URL, the key libpq must read it as, the URL as shown)."""
    return [
        (password, way, url(password), key, shown)
        for name, password in HOSTILE.items()
        for way, (url, key, shown) in WAYS.items()
        if carries(way, name)
    ]


MATRIX = pytest.mark.parametrize(("password", "way", "url", "key", "shown"), matrix())
# kombu splits a URL at a raw ';' before pgq sees it: that case has a test of its own.
KOMBU_MATRIX = pytest.mark.parametrize(
    ("password", "way", "url", "key", "shown"), [case for case in matrix() if ";" not in case[2]]
)


@MATRIX
def test_libpq_reads_the_password_the_url_carries(
    password: str, way: str, url: str, key: str, shown: str
) -> None:
    assert parse_url(url)[key] == password


@MATRIX
def test_mask_url_shows_what_libpq_parsed_with_the_password_masked(
    password: str, way: str, url: str, key: str, shown: str
) -> None:
    assert mask_url(url) == shown


@KOMBU_MATRIX
def test_kombu_and_celery_show_the_masked_url(
    password: str, way: str, url: str, key: str, shown: str
) -> None:
    conn = Connection(url)
    assert conn.as_uri() == shown
    assert repr(conn) == f"<Connection: {shown} at {id(conn):#x}>"
    # What `celery inspect stats` reports (and Flower shows): info() without `password`.
    info = conn.info()
    info.pop("password")
    assert info["hostname"] == shown
    # The rest does not depend on the password at all: it is what a dull one gives.
    dull = Connection(WAYS[way][0]("dull")).info()
    dull.pop("password")
    assert info == dull
    # What `celery inspect conf` shows: Celery censors broker_url through as_uri.
    assert filter_hidden_settings({"broker_url": url}) == {"broker_url": shown}


@KOMBU_MATRIX
def test_clones_and_pickles_keep_the_real_password(
    password: str, way: str, url: str, key: str, shown: str
) -> None:
    conn = Connection(url)
    conn.as_uri()  # the transport exists: the connection holds its URL masked
    for copy in (conn.clone(), pickle.loads(pickle.dumps(conn))):
        assert copy.as_uri() == shown
        assert parse_url(copy.as_uri(include_password=True)) == parse_url(url)


def without_secrets(url: str) -> dict[str, str]:
    return {k: v for k, v in parse_url(url).items() if k not in ("password", "sslpassword")}


@MATRIX
def test_celery_shows_the_result_backend_masked_once_the_app_imports_its_modules(
    password: str, way: str, url: str, key: str, shown: str
) -> None:
    app = Celery("results", backend=url, set_as_current=False)
    # What a worker, beat and `celery report` do first: pgq seals the setting there.
    app.loader.import_default_modules()
    assert str(app.conf.result_backend) == shown
    # `celery inspect conf`, Flower's Config tab; `report` (its settings and results line).
    reported = re.search(r"^settings -> .* results:(\S+)$", app.bugreport(), re.MULTILINE)
    assert reported is not None
    for censored in (app.conf.table()["result_backend"], reported.group(1)):
        assert without_secrets(censored) == without_secrets(url)
        assert set(parse_url(censored)[key]) == {"*"}
    # The backend still connects with the password, in this process and in a pickle.
    assert url_of(app.conf.result_backend) == url
    assert url_of(pickle.loads(pickle.dumps(app.conf.result_backend))) == url


@pytest.mark.parametrize("name", sorted(set(HOSTILE) - RAW_IN_USER_PART))
def test_a_raw_password_libpq_would_misread_is_refused_without_showing_it(name: str) -> None:
    password = HOSTILE[name]
    url = f"pgq://{USER}:{password}@{HOST}:{PORT}/{DB}"
    try:
        parsed = parse_url(url)
    except ConfigurationError as exc:
        assert "K7q" not in str(exc) and "Zx9" not in str(exc), exc
        return
    # '%41' is a valid escape: libpq reads another password, and that is masked.
    assert parsed["password"] != password
    assert mask_url(url) == f"pgq://{USER}:{MASK}@{HOST}:{PORT}/{DB}"


@pytest.mark.parametrize("name", sorted(set(HOSTILE) - RAW_IN_QUERY))
def test_a_raw_query_password_libpq_would_misread_is_refused_without_showing_it(
    name: str,
) -> None:
    for key in ("password", "sslpassword"):
        url = f"pgq://{USER}@{HOST}:{PORT}/{DB}?{key}={HOSTILE[name]}"
        shown = mask_url(url)
        assert "K7q" not in shown and "Zx9" not in shown, shown


def test_a_password_kombu_would_split_at_a_raw_semicolon_is_refused() -> None:
    """kombu reads a raw ';' as a list of failover URLs: the piece after it is no URL."""
    conn = Connection(f"pgq://{USER}:K7q;Zx9@{HOST}/{DB}")
    with pytest.raises(ConfigurationError) as info:
        conn.as_uri()
    assert "K7q" not in str(info.value) and "Zx9" not in str(info.value)
    assert "inside a user name or password must be written %3B" in str(info.value)


# -- what survives masking ---------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("pgq://user:pass@host:5432/db", "pgq://user:***@host:5432/db"),
        ("pgq://user@host/db", "pgq://user@host/db"),
        ("pgq://user:@host/db", "pgq://user@host/db"),  # libpq reads no password
        ("pgq://:pass@host/db", "pgq://:***@host/db"),
        (
            "pgq://u:S3cr3t-p%40ss@h:5432/db?sslmode=require",
            "pgq://u:***@h:5432/db?sslmode=require",
        ),
        ("pgq://u@h/db?password=", "pgq://u:***@h/db"),  # even an empty one
        (
            "pgq://u:one@h1:5432,h2:5433/db?password=two&target_session_attrs=read-write",
            "pgq://u:***@h1:5432,h2:5433/db?target_session_attrs=read-write",
        ),
        ("pgq://u:p@h1,h2:5433/db", "pgq://u:***@h1,h2:5433/db"),
        ("pgq://u:p@h/db?host=a,b&port=5432", "pgq://u:***@/db?host=a,b&port=5432"),
        ("pgq://u:p@%2Fvar%2Frun%2Fpostgresql/db", "pgq://u:***@%2Fvar%2Frun%2Fpostgresql/db"),
        ("pgq://u:p@[::1]:6432/db", "pgq://u:***@[::1]:6432/db"),
        (
            "pgq://u:p@h/db?options=-c%20statement_timeout%3D5000&application_name=a%26b",
            "pgq://u:***@h/db?options=-c%20statement_timeout%3D5000&application_name=a%26b",
        ),
        (
            "pgq://u:p@h?sslmode=require&sslkey=/keys/k.pem&sslpassword=q",
            "pgq://u:***@h/?sslmode=require&sslkey=/keys/k.pem&sslpassword=***",
        ),
        ("pgq:///db", "pgq:///db"),
        ("pgq://", "pgq://"),
    ],
)
def test_hosts_sockets_and_parameters_survive_masking(url: str, shown: str) -> None:
    assert mask_url(url) == shown
    expected = {
        k: MASK if k in ("password", "sslpassword") else v for k, v in parse_url(url).items()
    }
    assert parse_url(shown) == expected


# Any text a URL can carry: no NUL (libpq strings end there), no lone surrogates.
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))
hosts = st.lists(
    st.text(
        min_size=1,
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00,"),
    ),
    min_size=1,
    max_size=3,
).map(",".join)
ports = st.integers(1, 65535).map(str) | st.just("")


@st.composite
def libpq_params(draw: st.DrawFn) -> dict[str, str]:
    params: dict[str, str] = {}
    for key in ("user", "password", "dbname", "application_name", "sslpassword", "options"):
        if draw(st.booleans()):
            params[key] = draw(texts)
    if draw(st.booleans()):
        params["host"] = draw(hosts)
        count = params["host"].count(",") + 1
        shape = draw(st.sampled_from(["none", "each", "one"]))
        if shape == "each":
            params["port"] = ",".join(draw(st.lists(ports, min_size=count, max_size=count)))
        elif shape == "one":
            params["port"] = draw(ports)
    return params


@given(libpq_params())
def test_a_built_url_is_parsed_back_to_the_same_parameters(params: dict[str, str]) -> None:
    assert parse_url(build_url(params)) == params


@given(libpq_params())
def test_sealing_keeps_the_secrets_out_of_the_url_and_gives_them_back(
    params: dict[str, str],
) -> None:
    url = build_url(params)
    shown, credentials = seal(url)
    assert shown == (mask_url(url) if credentials else url)
    assert parse_url(unseal(shown, credentials)) == params
    if credentials is not None:
        assert repr(credentials) == str(credentials) == f"Credentials({MASK})"
        assert {
            k: v for k, v in parse_url(shown).items() if k in ("password", "sslpassword")
        } == dict.fromkeys(credentials.as_params(), MASK)


@given(texts)
def test_any_password_in_any_carrier_is_shown_as_the_mask(password: str) -> None:
    encoded = quote(password, safe="")
    assert mask_url(f"pgq://{USER}:{encoded}@{HOST}:{PORT}/{DB}?sslmode=prefer") == (
        SHOWN if password else f"pgq://{USER}@{HOST}:{PORT}/{DB}?sslmode=prefer"
    )
    assert mask_url(f"pgq://{USER}@{HOST}:{PORT}/{DB}?sslmode=prefer&sslpassword={encoded}") == (
        SHOWN_SSL
    )


def test_a_plain_kombu_password_joins_a_url_without_one() -> None:
    """Celery's broker_password (kombu's `password`) for a URL that has none."""
    conn = Connection(f"pgq://{USER}@{HOST}/{DB}", password="K7q#Zx9")
    assert conn.as_uri() == f"pgq://{USER}:{MASK}@{HOST}/{DB}"
    assert parse_url(conn.as_uri(include_password=True))["password"] == "K7q#Zx9"
    assert isinstance(conn.info()["password"], Credentials)


def test_the_barrier_names_a_foreign_broker_by_its_scheme_only() -> None:
    for url, uses in (
        ("redis://:K7q#Zx9@h:6379/0", "a redis:// broker"),
        ("K7q:Zx9@h", "a broker URL without a scheme"),
    ):
        with pytest.raises(ConfigurationError) as info:
            backend_for(Celery("shop", broker=url))
        assert str(info.value) == f"the barrier needs a pgq:// broker, app 'shop' uses {uses}"


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_a_postgresql_broker_url_is_answered_with_pgq_s_scheme(scheme: str) -> None:
    import pg_transport  # noqa: F401 (what registers the hint, as the .pth hook does)

    conn = Connection(f"{scheme}://app:K7q@db.internal:5432/app")
    with pytest.raises(ConfigurationError) as info:
        conn.transport  # noqa: B018
    message = str(info.value)
    assert "pgq's scheme is pgq://" in message and "K7q" not in message
