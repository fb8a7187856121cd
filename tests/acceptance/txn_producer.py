"""A producer process for tests/acceptance/test_transactional.py, killed by the test.

``python -m tests.acceptance.txn_producer FRONT hold LABEL``: one transaction with one
order in it, then ``READY`` on stdout, and it waits (uncommitted) to be killed.
``python -m tests.acceptance.txn_producer FRONT loop PREFIX``: orders PREFIX-0, -1, ...
each in a transaction of its own, until killed.
Environment: TEST_PG_URL, PGQ_BROKER_URL, PGQ_SCHEMA (as the worker's).
"""

from __future__ import annotations

import os
import sys
import threading

from tests.acceptance.txn_fronts import Fronts, setup_django


def main() -> None:
    front, mode, label = sys.argv[1:4]
    if front == "django":
        setup_django()
    fronts = Fronts(
        os.environ["TEST_PG_URL"], os.environ["PGQ_BROKER_URL"], os.environ["PGQ_SCHEMA"]
    )
    if mode == "hold":
        with fronts.transaction(front) as txn:
            txn.order(label)
            print("READY", flush=True)
            threading.Event().wait()  # killed here, before the commit
    n = 0
    while True:
        with fronts.transaction(front) as txn:
            txn.order(f"{label}-{n}")
        n += 1


if __name__ == "__main__":
    main()
