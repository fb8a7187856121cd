"""kombu's failover URLs on pgq: ``pgq://a;pgq://b`` and Celery's list-valued broker_url.

Each alternate is a whole pgq URL with its own libpq parameters; kombu's switch to the
next one keeps them (its own parser would hand them to ``Connection`` as keywords it does
not take); no alternate's password is shown where kombu reports its alternates; a ``;``
inside a password that splits a URL into pieces is refused with the rule, not quoted.
(kombu's own ``BaseFailover`` class runs in test_kombu_suite.py.)
"""

from __future__ import annotations

from urllib.parse import quote

import psycopg
import pytest
from celery import Celery
from kombu import Connection
from psycopg.conninfo import conninfo_to_dict

from pg_transport.errors import ConfigurationError

UNREACHABLE = "pgq://postgres@127.0.0.1:1/test?connect_timeout=2"


def with_params(url: str, **params: str) -> str:
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in params.items())
    return f"{url}{'&' if '?' in url else '?'}{query}"


def test_a_switch_keeps_the_alternates_own_libpq_parameters(broker_url: str, schema: str) -> None:
    live = with_params(broker_url, application_name="pgq-failover-alt")
    conn = Connection(f"{UNREACHABLE};{live}", transport_options={"schema": schema})
    try:
        assert conn.connect()
        queue = conn.SimpleQueue("failover-params")
        queue.put({"n": 1})
        assert queue.get(timeout=10).payload == {"n": 1}
        with conn.transport.connector.connection() as session:
            name = session.execute("SHOW application_name").fetchone()
        assert name == ("pgq-failover-alt",)
        queue.close()
    finally:
        conn.release()


def test_no_alternate_password_is_shown_where_kombu_reports_them(
    broker_url: str, schema: str
) -> None:
    secret = "s3cr;t#pw?"
    params = conninfo_to_dict(broker_url.replace("pgq://", "postgresql://", 1))
    user = params.get("user") or "postgres"
    other = f"pgq://{user}:{quote(secret, safe='')}@127.0.0.1:2/other"
    conn = Connection(f"{UNREACHABLE};{other};{broker_url}", transport_options={"schema": schema})
    try:
        conn.transport  # noqa: B018 (the transport takes the list in)
        shown = repr(conn.info()) + repr(conn.alt) + conn.as_uri()
        assert secret not in shown and quote(secret, safe="") not in shown, shown
        # past two unreachable alternates to the live one
        conn.ensure_connection(max_retries=3, interval_start=0, interval_step=0)
        assert conn.connected
    finally:
        conn.release()


def test_a_raw_semicolon_in_a_password_is_refused_with_the_rule(schema: str) -> None:
    url = "pgq://app:pa;ss-w0rd@127.0.0.1:5432/test"
    conn = Connection(url, transport_options={"schema": schema})
    with pytest.raises(ConfigurationError) as refused:
        conn.transport  # noqa: B018
    message = str(refused.value)
    assert "%3B" in message and "part 2 is not a pgq:// URL" in message
    assert "ss-w0rd" not in message


def test_a_percent_encoded_semicolon_is_one_url(broker_url: str, schema: str) -> None:
    conn = Connection(broker_url, transport_options={"schema": schema})
    try:
        assert len(conn.alt) == 0 or len(conn.alt) == 1
        assert conn.connect()
    finally:
        conn.release()


def test_celery_list_valued_broker_url_fails_over(broker_url: str, schema: str) -> None:
    app = Celery("failover", broker=[UNREACHABLE, broker_url], set_as_current=False)
    app.conf.broker_transport_options = {"schema": schema}
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=3, interval_start=0, interval_step=0)
        assert conn.port != 1
        queue = conn.SimpleQueue("failover-celery")
        queue.put({"n": 2})
        assert queue.get(timeout=10).payload == {"n": 2}
        queue.close()


def test_two_alternates_that_differ_only_in_parameters_stay_apart(
    broker_url: str, schema: str
) -> None:
    first = with_params(UNREACHABLE, application_name="one")
    second = with_params(broker_url, application_name="two")
    third = with_params(broker_url, application_name="three")
    conn = Connection(f"{first};{second};{third}", transport_options={"schema": schema})
    try:
        assert conn.connect()
        with conn.transport.connector.connection() as session:
            assert session.execute("SHOW application_name").fetchone() == ("two",)
    finally:
        conn.release()


def test_the_server_answers_through_an_alternate_only(broker_url: str) -> None:
    # The unreachable URL really is: the test above proves a switch, not a lucky first try.
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect("host=127.0.0.1 port=1 dbname=test connect_timeout=2").close()
