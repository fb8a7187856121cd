"""Poisoned messages: decode what can be decoded, recover identity, run the hooks.

A message is poisoned when its next delivery would exceed ``max_attempts``; the
claim itself has already moved it to ``dead_letter`` (nothing here can lose it).
This module only learns what the message was, tells the app through the
``message_poisoned`` signal, and records each handler's outcome on the row so an
operator can re-run the hooks (``pgq dead rehook ID``).

Decoding never unpickles: a pickled body yields an empty identity and a reason.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pg_transport import identity as identity_registry
from pg_transport.signals import message_dead_lettered, message_poisoned

__all__ = [
    "Decoded",
    "PoisonReport",
    "decode",
    "handle_poisoned",
    "run_hooks",
    "tell_dead_lettered",
]

logger = logging.getLogger("pg_transport.poison")

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


@dataclass
class PoisonReport:
    dead_letter_id: int
    queue: str
    task_id: str | None
    task_name: str | None
    identity: dict[str, Any]
    reasons: list[str]
    hooks: list[dict[str, Any]]


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


def run_hooks(
    *,
    dead_letter_id: int,
    queue: str,
    decoded: Decoded,
    identity: dict[str, Any],
    attempts: int,
) -> list[dict[str, Any]]:
    """Send ``message_poisoned``; one outcome per handler, a raising one included."""
    responses = message_poisoned.send(
        sender=decoded.task_name or queue,
        queue=queue,
        task_id=decoded.task_id,
        identity=dict(identity),
        args=decoded.args,
        kwargs=decoded.kwargs,
        attempts=attempts,
        dead_letter_id=dead_letter_id,
    )
    at = datetime.now(timezone.utc).isoformat()
    outcomes: list[dict[str, Any]] = []
    for receiver, response in responses:
        module = getattr(receiver, "__module__", "?")
        name = f"{module}.{getattr(receiver, '__qualname__', receiver)}"
        if isinstance(response, BaseException):
            outcomes.append({"receiver": name, "ok": False, "error": repr(response), "at": at})
        else:
            outcomes.append({"receiver": name, "ok": True, "at": at})
    return outcomes


def handle_poisoned(
    store: Any,
    *,
    dead_letter_id: int,
    queue: str,
    payload: Mapping[str, Any],
    attempts: int,
    reason: str = "",
) -> PoisonReport:
    """Recover identity, record it on the dead-letter row, run and record the hooks."""
    decoded = decode(payload)
    identity, why = identity_registry.recover(decoded.task_name, decoded.args, decoded.kwargs)
    reasons = decoded.reasons + why
    store.identify_dead_letter(
        dead_letter_id,
        task_id=decoded.task_id,
        task_name=decoded.task_name,
        identity=identity,
        reasons=reasons,
    )
    hooks = run_hooks(
        dead_letter_id=dead_letter_id,
        queue=queue,
        decoded=decoded,
        identity=identity,
        attempts=attempts,
    )
    store.record_hooks(dead_letter_id, hooks)
    failed = [h for h in hooks if not h["ok"]]
    logger.error(
        "dead-lettered message %s of queue %r (task %s %s) after %d deliveries (%s); identity %s%s",
        dead_letter_id,
        queue,
        decoded.task_name,
        decoded.task_id,
        attempts,
        reason or "max_attempts",
        identity,
        f"; {len(failed)} hook(s) failed: re-run with `pgq dead rehook {dead_letter_id}`"
        if failed
        else "",
    )
    return PoisonReport(
        dead_letter_id, queue, decoded.task_id, decoded.task_name, identity, reasons, hooks
    )


def tell_dead_lettered(
    *,
    dead_letter_id: int,
    queue: str,
    payload: Mapping[str, Any],
    reason: str,
    settled: bool,
) -> None:
    """Send ``message_dead_lettered``; a raising receiver is logged, never raised: the
    message is in dead_letter whatever its receivers do."""
    decoded = decode(payload)
    for receiver, response in message_dead_lettered.send(
        sender=decoded.task_name or queue,
        queue=queue,
        task_id=decoded.task_id,
        reason=reason,
        dead_letter_id=dead_letter_id,
        payload=payload,
        settled=settled,
    ):
        if isinstance(response, BaseException):
            logger.error(
                "message_dead_lettered receiver %r failed for dead letter %s: %r",
                receiver,
                dead_letter_id,
                response,
            )
