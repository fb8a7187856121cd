"""Broker URLs: pgq:// to libpq conninfo, malformed URLs refused, passwords never shown."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu import Connection
from psycopg.conninfo import conninfo_to_dict

from pg_transport.connection import mask_url, url_to_conninfo
from pg_transport.errors import ConfigurationError

# -- pgq:// -> libpq ----------------------------------------------------------------


def libpq(url: str) -> dict[str, object]:
    return dict(conninfo_to_dict(url_to_conninfo(url)))


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
    assert conninfo_to_dict(conninfo) == {}


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


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://u@h:6379/0", "scheme 'redis://' is not pgq://"),
        ("postgres://u@h/db", "scheme 'postgres://' is not pgq://"),
        ("u@h/db", "no scheme"),
        ("pgq://u@h:notaport/db", "port 'notaport' is not a number"),
        ("pgq://u@h:99999/db", "port '99999' is not a number between 1 and 65535"),
        ("pgq://u@h:0/db", "port '0'"),
        ("pgq://u@h1:5432,h2:x/db", "port 'x'"),
        ("pgq://u@h/db?port=abc", "port 'abc'"),
        ("pgq://u@h/db?bogus=1", '"bogus"'),
        ("pgq://u@h/db?sslmode", 'separator "="'),
        ("pgq://u@[::1/db", 'matching "]"'),
        ("pgq://u@h/d%zzb", "percent-encoded"),
    ],
)
def test_malformed_url_is_a_configuration_error_naming_the_problem(
    url: str, problem: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        url_to_conninfo(url)
    message = str(info.value)
    assert "malformed broker URL" in message
    assert problem in message
    assert url in message, "the (password-free) URL is quoted back"


def test_wrong_scheme_message_shows_the_expected_form() -> None:
    with pytest.raises(ConfigurationError, match=r"expected pgq://\[user"):
        url_to_conninfo("redis://localhost:6379/0")


@pytest.mark.parametrize(
    "url",
    [
        "redis://u:hunter2@h/db",
        "pgq://u:hunter2@h:notaport/db",
        "pgq://u:hunter2@h/db?bogus=1",
        "pgq://u:hunter2%zz@h/db",
        "pgq://u@h/db?password=hunter2%zz",
        "pgq://u:hun%00ter2@h/db",
    ],
)
def test_malformed_url_errors_never_show_the_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        url_to_conninfo(url)
    assert "hunter2" not in str(info.value)
    assert "hun%00ter2" not in str(info.value)
    assert "**" in str(info.value)


# -- masking ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("pgq://user:pass@host:5432/db", "pgq://user:**@host:5432/db"),
        ("pgq://user@host/db", "pgq://user@host/db"),
        ("pgq://user:@host/db", "pgq://user:**@host/db"),
        ("pgq://u:S3cr3t-p%40ss@h:5432/db?sslmode=require",
         "pgq://u:**@h:5432/db?sslmode=require"),
        ("pgq://u:p%2Fw%3Fd%23x%26y@h/db", "pgq://u:**@h/db"),
        ("pgq://u:pa:ss@h/db", "pgq://u:**@h/db"),
        ("pgq://u@h/db?password=secret", "pgq://u@h/db?password=**"),
        ("pgq://u@h/db?sslmode=require&password=s%26cret&application_name=a",
         "pgq://u@h/db?sslmode=require&password=**&application_name=a"),
        ("pgq://u:one@h1:5432,h2:5433/db?password=two",
         "pgq://u:**@h1:5432,h2:5433/db?password=**"),
        ("pgq:///db", "pgq:///db"),
        ("pgq://", "pgq://"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_mask_url_custom_mask() -> None:
    assert mask_url("pgq://u:p@h/db", mask="***") == "pgq://u:***@h/db"


@given(passwords)
def test_mask_hides_any_percent_encoded_password(password: str) -> None:
    encoded = quote(password, safe="")
    assert mask_url(f"pgq://user:{encoded}@host:5432/db") == "pgq://user:**@host:5432/db"
    assert mask_url(f"pgq://user@host/db?password={encoded}&sslmode=require") == (
        "pgq://user@host/db?password=**&sslmode=require"
    )


def test_kombu_as_uri_hides_the_password() -> None:
    for url in (
        "pgq://u:secret@h/db",
        "pgq://u:secret@h:5432/db?sslmode=require",
        "pgq://u@h/db?password=secret",
    ):
        conn = Connection(url)
        assert "secret" not in conn.as_uri()
        assert "secret" not in repr(conn)
        assert "**" in conn.as_uri()
        assert conn.as_uri(include_password=True) == url


def test_kombu_as_uri_hides_a_percent_encoded_password() -> None:
    conn = Connection("pgq://postgres:S3cr3t-p%40ss@127.0.0.1:5432/test")
    uri = conn.as_uri()
    assert uri == "pgq://postgres:**@127.0.0.1:5432/test"
    assert "S3cr3t" not in uri
