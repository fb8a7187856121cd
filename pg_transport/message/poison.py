"""What a poisoned (or any dead-lettered) message was: decode what can be decoded.

A message is poisoned when its next delivery would exceed ``max_attempts``; the claim
itself has already moved it to ``dead_letter``. :func:`decode` reads its task id, name
and arguments for the identity and the hooks (:mod:`pg_transport.poisoned`
records and sends them).

Decoding never unpickles: a pickled body yields an empty identity and a reason.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Decoded", "decode"]

JSON = "application/json"
MSGPACK = "application/x-msgpack"
YAML = "application/x-yaml"
PICKLE = "application/x-python-serialize"


@dataclass
class Decoded:
    task_id: str | None = None
    task_name: str | None = None
    args: Any = None
    kwargs: Any = None
    reasons: list[str] = field(default_factory=list)


def _raw_body(payload: Mapping[str, Any]) -> bytes | str:
    body = payload.get("body")
    encoding = (payload.get("properties") or {}).get("body_encoding")
    if encoding == "base64":
        return base64.b64decode(body if isinstance(body, (str, bytes)) else b"")
    if isinstance(body, (str, bytes)):
        return body
    raise ValueError(f"body is {type(body).__name__}")


def _load(raw: bytes | str, content_type: str) -> Any:
    if content_type == JSON:
        return json.loads(raw)
    if content_type == MSGPACK:
        import msgpack  # optional, as in kombu

        return msgpack.unpackb(raw.encode() if isinstance(raw, str) else raw, raw=False)
    if content_type == YAML:
        import yaml  # optional, as in kombu

        return yaml.safe_load(raw)
    if content_type == PICKLE:
        raise ValueError("pickled body: never unpickled to recover identity")
    raise ValueError(f"unsupported content type {content_type!r}")


def decode(payload: Mapping[str, Any]) -> Decoded:
    """What a raw transport payload says about its task. Never raises."""
    out = Decoded()
    headers = payload.get("headers") if isinstance(payload, Mapping) else None
    headers = headers if isinstance(headers, Mapping) else {}
    out.task_id = _text(headers.get("id"))
    out.task_name = _text(headers.get("task"))
    content_type = str(payload.get("content-type") or "") if isinstance(payload, Mapping) else ""
    if headers.get("compression"):
        out.reasons.append(f"compressed body ({headers['compression']}) not decoded")
        return out
    try:
        body = _load(_raw_body(payload), content_type)
    except ImportError as exc:
        out.reasons.append(f"cannot decode {content_type}: {exc.name} is not installed")
        return out
    except Exception as exc:  # any decoder's error means "undecodable", with a reason
        out.reasons.append(f"undecodable body: {exc}")
        return out
    if out.task_name is not None:  # protocol 2: [args, kwargs, embed]
        if isinstance(body, (list, tuple)) and len(body) >= 2:
            out.args, out.kwargs = body[0], body[1]
        else:
            out.reasons.append(f"protocol 2 body is {type(body).__name__}, not [args, kwargs, …]")
    elif isinstance(body, Mapping) and "task" in body:  # protocol 1
        out.task_id = _text(body.get("id"))
        out.task_name = _text(body.get("task"))
        out.args, out.kwargs = body.get("args"), body.get("kwargs")
    else:
        out.reasons.append("not a Celery task message")
    return out


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
