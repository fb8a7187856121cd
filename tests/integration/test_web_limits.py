"""The console's limits page against a real Postgres and a real server: each flow limit
with its definition and its slots in use and waiting, as `pgq status` counts them; no
key of the application's on the page; a limit's name shown as text, never as markup."""

from __future__ import annotations

import html
import re

import pytest

pytest.importorskip("tornado")

from pg_transport.web.base import Console
from tests.integration.conftest import Peek, PublishingStore
from tests.integration.test_flow_limits import Q, define, delivered, keyed
from tests.integration.test_web_auth import TOKEN, Browser, serving

ROW = re.compile(r"<tr><td class=\"name\">(.*?)</td>(.*?)</tr>", re.S)
CELL = re.compile(r"<td class=\"[^\"]*\">(.*?)</td>")


UNIQUE_ROW = re.compile(r"<tr><td class=\"queue\">(.*?)</td>(.*?)</tr>", re.S)


def unique_rows(page: str) -> dict[str, list[str]]:
    """The unique keys table: each queue (unescaped) and its queued and running counts."""
    return {html.unescape(q): CELL.findall(rest) for q, rest in UNIQUE_ROW.findall(page)}


def limit_rows(page: str) -> dict[str, list[str]]:
    """The limits table: each limit's name (unescaped) and its other cells."""
    return {html.unescape(name): CELL.findall(rest) for name, rest in ROW.findall(page)}


def test_the_limits_page_shows_each_limit_s_slots_in_use_and_waiting(
    store: PublishingStore, peek: Peek
) -> None:
    odd = "<b>odd</b> & co"
    define(peek, "erp", concurrency=1)
    define(peek, "task:app.call_api", rate=(600, 60.0), burst=3)
    define(peek, odd, concurrency=2)
    secret_key = "customer-7f3a"
    for n in range(3):
        store.publisher.publish(Q, keyed(n, secret_key))
    assert delivered(store.claim([Q], [30.0], 10)) == [0]
    console = Console(store.connector, store.schema, token=TOKEN)
    try:
        with serving(console) as port:
            status, _, page = Browser(port).request("GET", "/limits")
            assert status == 200, page
            assert limit_rows(page) == {
                "erp": ["-", "-", "1", "1", "2"],
                "task:app.call_api": ["600/m", "3", "-", "0", "0"],
                odd: ["-", "-", "2", "0", "0"],
            }
            assert "<b>odd</b>" not in page  # the name is text, escaped
            assert secret_key not in page  # counted per limit, no key shown
            assert 'href="/limits"' in Browser(port).request("GET", "/processes")[2]
            peek("DELETE FROM {schema}.flow_limit")
            _, _, empty = Browser(port).request("GET", "/limits")
            assert limit_rows(empty) == {}
            assert "No flow limits." in empty
    finally:
        console.executor.shutdown(wait=False)
