"""Celery protocol-2 task messages in the payload layout the pgq transport stores.

What ``Producer.publish`` + ``Channel._put`` would have written for
``sig.apply_async()``, built here instead so the message can be inserted with
:meth:`Store.publish_on` inside the caller's transaction (a barrier's arm, a
part's completion). Layout, as kombu's virtual channel builds it: ``body``
(text as is, bytes as base64 with ``body_encoding`` "base64"), ``content-type``,
``content-encoding``, ``headers`` (Celery's task headers), ``properties``
(``correlation_id``, ``reply_to``, ``delivery_mode``, ``delivery_info``
{``exchange``, ``routing_key``}, ``priority``, ``body_encoding``, ``delivery_tag``).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

from celery.canvas import Signature, maybe_signature
from celery.utils import uuid

from pg_transport.fanin.codec import compress, serialize
from pg_transport.fanin.errors import BarrierError
from pg_transport.message.eta import eta_delay

__all__ = ["Outgoing", "as_signature", "eta_delay", "publish_key", "task_message"]

# The transport's priority range (it clamps what it stores the same way).
MIN_PRIORITY, MAX_PRIORITY = 0, 255


@dataclass(frozen=True)
class Outgoing:
    """One message ready for ``Store.publish_on``."""

    queue: str
    priority: int
    payload: dict[str, Any]
    task_id: str
    #: Seconds until its ETA (countdown/eta option); 0 for "now".
    delay: float = 0.0


def as_signature(app: Any, sig: Any, what: str) -> Signature:
    """``sig`` as a single-task signature of ``app``; canvas types are refused
    (a chain's completion is not its first task's, a group has many)."""
    signature = maybe_signature(sig, app=app)
    if not isinstance(signature, Signature) or signature.get("subtask_type"):
        kind = signature.get("subtask_type") if isinstance(signature, dict) else type(sig)
        raise BarrierError(f"{what} must be a single task signature, not {kind!r}")
    return signature


def publish_key(*parts: str) -> str:
    """A bounded, deterministic publish key: the same message is never inserted twice."""
    return blake2b("\x00".join(parts).encode("utf-8"), digest_size=16).hexdigest()


def _priority(value: Any) -> int:
    try:
        return max(min(int(value), MAX_PRIORITY), MIN_PRIORITY)
    except (TypeError, ValueError):
        return MIN_PRIORITY


def _queue_name(
    app: Any, options: dict[str, Any], name: str, args: Any, kwargs: Any
) -> tuple[str, dict[str, Any]]:
    route = app.amqp.router.route(options, name, args, kwargs)
    queue = route.get("queue")
    qname = getattr(queue, "name", None) or queue or app.conf.task_default_queue
    return str(qname), route


def task_message(
    app: Any,
    sig: Signature,
    *,
    args_prefix: Sequence[Any] = (),
    extra_kwargs: Mapping[str, Any] | None = None,
    headers: Mapping[str, Any] | None = None,
    parent_id: str | None = None,
    root_id: str | None = None,
) -> Outgoing:
    """The message ``sig.apply_async(args_prefix, extra_kwargs, headers=…)`` would send.

    As Celery's ``apply_async``: an immutable signature (``.si()``) ignores
    ``args_prefix`` (``extra_kwargs`` are transport bookkeeping, the barrier's marker,
    and always added); ``parent_id``/``root_id`` are those of the task the message is
    sent from, used where the signature names none of its own. Routed like
    ``apply_async``: the signature's ``queue`` option, else ``task_routes``, else the
    app's default queue (by queue name: the message is inserted straight into that
    queue).
    """
    options = dict(sig.options)
    name = sig.task
    task_id = options.get("task_id") or uuid()
    args = tuple(sig.args) if sig.immutable else (*args_prefix, *sig.args)
    kwargs = {**sig.kwargs, **(extra_kwargs or {})}
    queue, route = _queue_name(app, options, name, args, kwargs)

    link = options.get("link")
    link_error = options.get("link_error")
    message = app.amqp.as_task_v2(
        task_id,
        name,
        args,
        kwargs,
        countdown=options.get("countdown"),
        eta=options.get("eta"),
        expires=options.get("expires"),
        callbacks=[link] if isinstance(link, dict) else link,
        errbacks=[link_error] if isinstance(link_error, dict) else link_error,
        time_limit=options.get("time_limit"),
        soft_time_limit=options.get("soft_time_limit"),
        shadow=options.get("shadow"),
        ignore_result=options.get("ignore_result"),
        root_id=options.get("root_id") or root_id,
        parent_id=options.get("parent_id") or parent_id,
    )
    message_headers = dict(message.headers)
    message_headers.update(options.get("headers") or {})
    message_headers.update(headers or {})

    serializer = options.get("serializer") or app.conf.task_serializer
    content_type, content_encoding, body = serialize(message.body, serializer=serializer)
    compression = options.get("compression") or app.conf.task_compression
    if compression:
        body, message_headers["compression"] = compress(body, compression)
    # The transport keeps text bodies readable and stores bytes as base64.
    if isinstance(body, str):
        stored, body_encoding = body, None
    else:
        stored, body_encoding = base64.b64encode(bytes(body)).decode("ascii"), "base64"

    priority = options.get("priority", route.get("priority"))
    if priority is None:
        priority = app.conf.task_default_priority
    properties = dict(message.properties)
    properties.update(
        delivery_mode=2,
        delivery_info={"exchange": "", "routing_key": queue},
        priority=priority or MIN_PRIORITY,
        body_encoding=body_encoding,
        delivery_tag=uuid(),
    )
    payload = {
        "body": stored,
        "content-encoding": content_encoding,
        "content-type": content_type,
        "headers": message_headers,
        "properties": properties,
    }
    return Outgoing(
        queue=queue,
        priority=_priority(priority),
        payload=payload,
        task_id=task_id,
        delay=eta_delay(message_headers),
    )
