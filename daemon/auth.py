"""Who may use the API: the bearer key every route but the probes and the scraper needs (`--api-key`), and the
rule that a daemon listening beyond loopback has one, or says it does not need one (`--allow-unauthenticated`)."""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web

from diffusiond.daemon.api import ApiError
from diffusiond.daemon.config import ConfigError, ServeConfig, env_var

# Liveness, readiness, scraping and the API document stay open when an API key is set (probes and scrapers carry
# no key).
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/", "/openapi.json"})


def api_key_middleware(key: str | None):
    """The middleware that asks every request for `Authorization: Bearer KEY` (none: every request passes)."""
    expected = key.encode() if key else None

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            scheme, _, token = given.partition(" ")
            # Header bytes that are not UTF-8 arrive as surrogates: compare bytes, never fail on them.
            token_bytes = token.strip().encode("utf-8", "surrogateescape")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token_bytes, expected):
                raise ApiError(
                    401,
                    "missing or invalid API key (send 'Authorization: Bearer KEY')",
                    type="invalid_request_error",
                    code="invalid_api_key",
                )
        return await handler(request)

    return check_key


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name may resolve to anything


def check_exposure(config: ServeConfig) -> None:
    """Listening beyond loopback without an API key is a choice the operator makes explicitly."""
    if not is_loopback(config.host) and not config.api_key and not config.allow_unauthenticated:
        raise ConfigError(
            f"refusing to listen on {config.host} without an API key: anyone who reaches the port could use it. Set "
            f"--api-key (or {env_var('api_key')}), or pass --allow-unauthenticated "
            f"({env_var('allow_unauthenticated')}=true) if something in front of the daemon authenticates"
        )


def exposure_warning(config: ServeConfig) -> str | None:
    if not is_loopback(config.host) and not config.api_key:
        return f"listening on {config.host} with no API key (--allow-unauthenticated): whoever reaches it can use it"
    return None
