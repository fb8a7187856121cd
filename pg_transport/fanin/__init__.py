"""The exactly-once fan-in core that native chords (:mod:`pg_transport.results.chords`)
and the barrier add-on (``barrier``) share: the ``barrier`` and ``barrier_part`` tables'
statements (``fanin.sql``), arming, recording a part once, counting it and the flips
``armed -> fired|failed|expired`` with their messages in the same transaction
(:mod:`~pg_transport.fanin.state`), the task messages they insert
(:mod:`~pg_transport.fanin.messages`), and one app's database side
(:mod:`~pg_transport.fanin.backend`). It imports neither the barrier nor results.
"""

from __future__ import annotations
