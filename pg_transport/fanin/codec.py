"""JSON as kombu writes it, typed: datetimes, UUIDs and decimals round-trip, which
plain ``json`` would refuse or flatten. Used for everything the barrier stores as
JSON text (signatures, results) so a callback receives what the part returned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kombu.compression import compress as _compress
from kombu.serialization import dumps as _serialize
from kombu.utils import json as _json

__all__ = ["compress", "dumps", "loads", "serialize"]

# kombu ships these without annotations; the names here give them their types.
dumps: Callable[[Any], str] = _json.dumps
loads: Callable[[str], Any] = _json.loads
#: (body, serializer=…) -> (content_type, content_encoding, body)
serialize: Callable[..., tuple[str, str, str | bytes]] = _serialize
#: (body, method) -> (compressed body, content type of the compression)
compress: Callable[[str | bytes, str], tuple[bytes, str]] = _compress
