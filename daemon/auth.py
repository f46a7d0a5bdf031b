"""Who may use the API: the bearer key every route but the probes and the scraper needs (`--api-key`, or one of
the tenants' keys of `--api-keys-file`, daemon/tenants.py), the tenant it names, and the rule that a daemon listening
beyond loopback has keys, or says it does not need them (`--allow-unauthenticated`)."""

from __future__ import annotations

import ipaddress

from aiohttp import web

from diffusiond.daemon.api import ApiError
from diffusiond.daemon.config import ConfigError, ServeConfig, env_var
from diffusiond.daemon.tenants import DEFAULT, Tenant, TenantBook, TenantsError

# The tenant a request is made for (daemon/tenants.py): its name.
TENANT = web.RequestKey("tenant", str)
TENANTS = web.AppKey("tenants", TenantBook)

# Liveness, readiness, scraping and the API document stay open when an API key is set (probes and scrapers carry
# no key); scraping asks an admin tenant's key when a tenants file names several (`require_admin`).
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/", "/openapi.json"})
ADMIN_PATHS = frozenset({"/metrics"})
FILES_PREFIX = "/v1/files/"


def tenant_of(request: web.Request) -> Tenant:
    """The settings (quotas, share) of the tenant the request is made for."""
    return request.app[TENANTS].tenant(request[TENANT])


def tenant_middleware(book: TenantBook):
    """The middleware that asks every request for `Authorization: Bearer KEY` and sets the tenant the key names
    (`request[TENANT]`); with no key configured, every request is the default tenant."""

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        tenants = book.current
        admin_only = tenants.several and request.path in ADMIN_PATHS
        # A file's URL carries its own key: a signature (daemon/files.py).
        if tenants.open or (request.path in OPEN_PATHS and not admin_only) or request.path.startswith(FILES_PREFIX):
            request[TENANT] = DEFAULT
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        # Header bytes that are not UTF-8 arrive as surrogates: hash bytes, never fail on them.
        name = tenants.who(token.strip().encode("utf-8", "surrogateescape")) if scheme.lower() == "bearer" else None
        if name is None:
            raise ApiError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer KEY')",
                type="invalid_request_error",
                code="invalid_api_key",
            )
        request[TENANT] = name
        if admin_only:
            require_admin(request, "read /metrics (it names every tenant)")
        return await handler(request)

    return check_key


def require_admin(request: web.Request, what: str) -> None:
    """ApiError 403 unless the request's tenant is an admin (daemon/tenants.py): `what` it may not do."""
    tenants = request.app[TENANTS].current
    if not tenants.is_admin(request[TENANT]):
        raise ApiError(
            403,
            f"only an admin tenant may {what}: this key's tenant is not one (admin = true in the tenants file)",
            type="invalid_request_error",
            code="admin_only",
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name may resolve to anything


def check_exposure(config: ServeConfig) -> None:
    """Listening beyond loopback without an API key is a choice the operator makes explicitly."""
    if config.api_key and config.api_keys_file:
        raise ConfigError("--api-key and --api-keys-file: give one (a key of its own is a tenant in the file)")
    if config.api_keys_file:
        try:
            TenantBook(config.api_keys_file, None)
        except TenantsError as exc:
            raise ConfigError(f"--api-keys-file {exc}") from None
    keyed = bool(config.api_key or config.api_keys_file)
    if not is_loopback(config.host) and not keyed and not config.allow_unauthenticated:
        raise ConfigError(
            f"refusing to listen on {config.host} without an API key: anyone who reaches the port could use it. Set "
            f"--api-key (or {env_var('api_key')}), or pass --allow-unauthenticated "
            f"({env_var('allow_unauthenticated')}=true) if something in front of the daemon authenticates"
        )


def exposure_warning(config: ServeConfig) -> str | None:
    if not is_loopback(config.host) and not config.api_key and not config.api_keys_file:
        return f"listening on {config.host} with no API key (--allow-unauthenticated): whoever reaches it can use it"
    return None
