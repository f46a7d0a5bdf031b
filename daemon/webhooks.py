"""Webhooks for jobs (issue 53): a client that queued a video (or sound) job is told when it ends, instead of polling.

When a job ends completed or failed, the endpoint of the tenant that made it (its `webhook_url` in the tenants file,
else `--webhook-url`) gets OpenAI's event, `{"id": "evt_...", "object": "event", "type": "video.completed",
"created_at": ..., "data": {"id": "video_..."}}` (`video.failed`; a sound job's are `audio.completed` and
`audio.failed`), signed the Standard Webhooks way: headers `webhook-id` (the event's id), `webhook-timestamp` (Unix
seconds) and `webhook-signature` (`v1,` + base64 of HMAC-SHA256 over `{id}.{timestamp}.{body}`, keyed by the secret
`whsec_<base64>` decoded); OpenAI's SDK checks it (`client.webhooks.verify_signature(body, headers, secret=...)`).
A job cancelled (by its client, or by a shutdown that leaves it to run again) sends nothing.

Delivery is at least once: a 2xx answer ends it; anything else (another
status, no answer within TIMEOUT_S, a refused connection) is tried again after 1, 2, 4 ... seconds (doubling, at most
MAX_DELAY_S apart), TRIES times in all; every try carries the same `webhook-id`, so a receiver drops repeats by it.
Under a job database (`--state-dir`, `--state-url`) the job's record keeps the event's id until it is delivered: the
replica that finished the job sends it again, with the same id, when it starts (daemon/videos_api.py); without
one, what is still being retried at a restart is lost (the job's status stays at `GET /v1/videos/{id}`). Each try counts
in `diffusiond_webhooks_total{result}` (delivered, retried, dropped).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgspec
from aiohttp import web

log = logging.getLogger(__name__)

# What `--webhook-url` and a tenant's `webhook_url` may be, and a Standard Webhooks secret (24 bytes or more).
WEBHOOK_URL = r"^https?://[^\s/?#]+[^\s]*$"
WEBHOOK_SECRET = r"^whsec_[A-Za-z0-9+/]{32,}={0,2}$"
TRIES = 8
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 300.0
TIMEOUT_S = 10.0
# Deliveries waiting or under way; past it a new event is dropped (and logged), never queued without bound.
MAX_PENDING = 10_000


def sign(secret: str, event_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header's value for one try (Standard Webhooks, version 1)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{event_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def event_body(event_type: str, object_id: str, event_id: str, created_at: int) -> bytes:
    """OpenAI's webhook event, as sent."""
    event = {"id": event_id, "object": "event", "type": event_type, "created_at": created_at}
    return msgspec.json.encode({**event, "data": {"id": object_id}})


class Webhooks:
    """The deliveries under way, each a task (kept here, cancelled at shutdown)."""

    def __init__(self, counter=None, first_delay: float = FIRST_DELAY_S) -> None:
        self.session: aiohttp.ClientSession | None = None  # made at the first event
        self.counter = counter  # diffusiond_webhooks_total, by result (None in tests that build one bare)
        self.first_delay = first_delay
        self.tasks: set[asyncio.Task] = set()

    def send(
        self,
        url: str | None,
        secret: str | None,
        event_type: str,
        object_id: str,
        event: tuple[str, int],
        delivered: Callable[[], None] | None = None,
    ) -> None:
        """Queues one event, `event` (its id and created_at: the same on every try and after a restart), for `url`
        (nothing without one); `delivered`: called once a try is answered 2xx."""
        if url is None or secret is None:
            return
        if len(self.tasks) >= MAX_PENDING:
            message = "webhook %s for %s dropped: %d deliveries are under way already"
            log.error(message, event_type, object_id, MAX_PENDING)
            self._count("dropped")
            return
        if self.session is None:
            self.session = aiohttp.ClientSession()
        event_id, created = event
        body = event_body(event_type, object_id, event_id, created)
        task = asyncio.create_task(self._deliver(url, secret, event_id, body, event_type, object_id, delivered))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _deliver(
        self,
        url: str,
        secret: str,
        event_id: str,
        body: bytes,
        event_type: str,
        object_id: str,
        delivered: Callable[[], None] | None,
    ) -> None:
        assert self.session is not None
        delay = self.first_delay
        for attempt in range(1, TRIES + 1):
            timestamp = int(time.time())
            headers = {
                "Content-Type": "application/json",
                "webhook-id": event_id,
                "webhook-timestamp": str(timestamp),
                "webhook-signature": sign(secret, event_id, timestamp, body),
            }
            try:
                timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
                async with self.session.post(url, data=body, headers=headers, timeout=timeout) as response:
                    outcome = f"status {response.status}"
                    if 200 <= response.status < 300:
                        log.info("webhook %s %s for %s delivered (try %d)", event_id, event_type, object_id, attempt)
                        self._count("delivered")
                        if delivered is not None:
                            delivered()
                        return
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                outcome = type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {exc}"
            if attempt == TRIES:
                break
            log.warning(
                "webhook %s %s for %s: %s; trying again in %gs", event_id, event_type, object_id, outcome, delay
            )
            self._count("retried")
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_DELAY_S)
        log.error("webhook %s %s for %s dropped after %d tries: %s", event_id, event_type, object_id, TRIES, outcome)
        self._count("dropped")

    def _count(self, result: str) -> None:
        if self.counter is not None:
            self.counter.labels(result).inc()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()


WEBHOOKS = web.AppKey("webhooks", Webhooks)


def endpoint(app: web.Application, owner: str) -> tuple[str | None, str | None]:
    """(URL, secret) of the endpoint `owner`'s events go to: its own, else `--webhook-url`'s; (None, None): none."""
    from diffusiond.daemon.auth import TENANTS
    from diffusiond.daemon.state import STATE

    tenant, config = app[TENANTS].tenant(owner), app[STATE].config
    if tenant.webhook_url is not None:
        return tenant.webhook_url, tenant.webhook_secret
    return config.webhook_url, config.webhook_secret


def new_event_id() -> str:
    return "evt_" + secrets.token_hex(16)


def notify(
    app: web.Application,
    owner: str,
    event_type: str,
    object_id: str,
    event: tuple[str, int],
    delivered: Callable[[], None] | None = None,
) -> None:
    """`event_type` for `object_id` to `owner`'s endpoint, if there is one (`Webhooks.send`)."""
    url, secret = endpoint(app, owner)
    app[WEBHOOKS].send(url, secret, event_type, object_id, event, delivered)


async def webhooks_ctx(app: web.Application) -> AsyncIterator[None]:
    from diffusiond.daemon.state import METRICS

    app[WEBHOOKS] = Webhooks(app[METRICS].webhooks)
    try:
        yield
    finally:
        await app[WEBHOOKS].close()
