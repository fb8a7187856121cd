"""A Django settings module for the tests of pgq's Django integration: the test server's
database on the psycopg 3 backend ("default"), another database of the same server
("elsewhere"), and a database of another driver ("lite")."""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

from tests.pg import session_database

# A worker or producer subprocess is told the test database; the test run makes its own.
_url = os.environ.get("TEST_PG_URL") or session_database()
_parts = conninfo_to_dict(_url)


def _postgres(name: str) -> dict[str, object]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": _parts.get("user", ""),
        "PASSWORD": _parts.get("password", ""),
        "HOST": _parts.get("host", ""),
        "PORT": _parts.get("port", ""),
    }


SECRET_KEY = "pgq-tests"
USE_TZ = True
INSTALLED_APPS: list[str] = []
DATABASES = {
    "default": _postgres(str(_parts.get("dbname", "postgres"))),
    "elsewhere": _postgres("postgres"),
    "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}
