"""What a stored payload must be before kombu is given it.

A row's payload is whatever its publisher wrote: pgq's transport writes kombu's
message layout (``body``, ``properties``, ``headers``, ...), but a publisher role can
insert anything a JSON column takes. kombu and Celery index into that layout without
asking, so a row that does not have it would raise inside the consumer loop. The
consumer checks it here first and dead-letters a row that fails, with the reason; then
what Celery reads of a task message (:mod:`~pg_transport.message.protocol`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from pg_transport.message import protocol

__all__ = ["fault"]

# The body encodings pgq's channel writes (kombu's virtual channel decodes these only).
_ENCODINGS = (None, "base64")


def fault(payload: dict[str, Any]) -> str | None:
    """Why ``payload`` cannot be delivered as a kombu message (None: it can)."""
    properties = payload.get("properties", {})
    if not isinstance(properties, dict):
        return f"payload's properties is a JSON {_kind(properties)}, not an object"
    headers = payload.get("headers")
    if headers is not None and not isinstance(headers, dict):
        return f"payload's headers is a JSON {_kind(headers)}, not an object"
    info = properties.get("delivery_info")
    if info is not None and not isinstance(info, dict):
        return f"payload's delivery_info is a JSON {_kind(info)}, not an object"
    body = payload.get("body")
    if not isinstance(body, str):
        return "payload has no body" if body is None else f"payload's body is a JSON {_kind(body)}"
    encoding = properties.get("body_encoding")
    if encoding not in _ENCODINGS:
        return f"payload's body_encoding {str(encoding)[:40]!r} is not one pgq writes"
    if encoding == "base64":
        try:
            base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            return "payload's base64 body does not decode"
    for key in ("content-type", "content-encoding"):
        value = payload.get(key)
        if value is not None and not isinstance(value, str):
            return f"payload's {key} is a JSON {_kind(value)}, not a string"
    return protocol.fault(payload)


def _kind(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
