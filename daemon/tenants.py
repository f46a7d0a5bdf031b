"""Who is asking: tenants, each with its keys (stored as SHA-256 hashes), its quotas and its share (issue 33).

`--api-keys-file FILE` (TOML), one table per tenant:

    [tenants.alice]
    key_sha256 = "9f86d081..."      # hex SHA-256 of the bearer token (or `keys_sha256 = [...]` for several)
    max_in_flight = 4               # requests admitted and not finished
    max_queued = 16                 # of those, waiting to start
    max_stored_jobs = 100           # video jobs remembered
    max_stored_bytes = 1073741824   # bytes of finished videos and images by URL on disk
    priority = [0, 5]               # the range of `priority` (0-9) the tenant may ask for (default: all)
    weight = 1.0                    # its share under fair scheduling (default 1)
    admin = true                    # may read /metrics and register or delete the shared LoRA adapters
    webhook_url = "https://alice.example/hooks"   # told when its jobs end (daemon/webhooks.py; else --webhook-url)
    webhook_secret = "whsec_..."    # the Standard Webhooks secret they are signed with (with webhook_url)

Every quota is optional (none: the daemon's own bounds only). `--api-key KEY` is the one-tenant shorthand (tenant
"default"); with neither, every request is tenant "default". With a file, `/metrics` (it names every tenant) and
the shared LoRA adapters' registration and removal are an admin tenant's alone (401 without a key, 403 for another
tenant); with `--api-key`, or no key, its one tenant is the admin. A tenant sees, cancels and downloads only what it
created: another tenant's ids answer 404, as ids that do not exist. The file is read again on SIGHUP
(`TenantBook.reload`): keys added and revoked take effect for the next request; requests already admitted run on.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec

from diffusiond.daemon.webhooks import WEBHOOK_SECRET, WEBHOOK_URL

log = logging.getLogger(__name__)

DEFAULT = "default"
# Tenant names become metric labels and log fields: short, plain, from the operator's file only.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-fA-F]{64}$")]
Quota = Annotated[int, msgspec.Meta(ge=0)] | None


class Tenant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = DEFAULT
    key_sha256: Sha256 | None = None
    keys_sha256: tuple[Sha256, ...] = ()
    max_in_flight: Quota = None
    max_queued: Quota = None
    max_stored_jobs: Quota = None
    max_stored_bytes: Quota = None
    # The classes it may ask for (engine/scheduler.py; default: all of them).
    priority: tuple[Annotated[int, msgspec.Meta(ge=0, le=9)], Annotated[int, msgspec.Meta(ge=0, le=9)]] = (0, 9)
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # May read /metrics and change the shared LoRA adapters (a file's tenants; the one tenant of --api-key is).
    admin: bool = False
    # Told when its jobs end (daemon/webhooks.py), and the secret the events are signed with; both or neither.
    webhook_url: Annotated[str, msgspec.Meta(pattern=WEBHOOK_URL)] | None = None
    webhook_secret: Annotated[str, msgspec.Meta(pattern=WEBHOOK_SECRET)] | None = None

    def hashes(self) -> tuple[str, ...]:
        return tuple(h.lower() for h in (*((self.key_sha256,) if self.key_sha256 else ()), *self.keys_sha256))


class TenantsError(ValueError):
    """A tenants file that cannot be used; the message names the file and the field."""


class Tenants:
    """The tenants of one reading of the file (or of `--api-key`), and who a bearer token is."""

    def __init__(self, tenants: dict[str, Tenant], open_: bool = False, several: bool = False) -> None:
        self.tenants = tenants
        # No key anywhere: every request is the default tenant.
        self.open = open_
        # Read from a file: tenants that must not see each other (else the one tenant is its own admin).
        self.several = several
        self._by_hash = {h: name for name, t in tenants.items() for h in t.hashes()}

    @classmethod
    def anyone(cls) -> Tenants:
        return cls({DEFAULT: Tenant()}, open_=True)

    @classmethod
    def single(cls, api_key: str) -> Tenants:
        return cls({DEFAULT: Tenant(key_sha256=hashlib.sha256(api_key.encode()).hexdigest())})

    @classmethod
    def read(cls, path: str | Path) -> Tenants:
        """The tenants of a TOML file (TenantsError naming the file and what is wrong in it)."""
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise TenantsError(f"{path}: {exc}") from None
        unknown = set(raw) - {"tenants"}
        if unknown or not isinstance(raw.get("tenants"), dict) or not raw["tenants"]:
            raise TenantsError(f"{path}: expected [tenants.NAME] tables and nothing else")
        tenants: dict[str, Tenant] = {}
        owners: dict[str, str] = {}
        for name, table in raw["tenants"].items():
            if not NAME.match(name):
                raise TenantsError(f"{path}: tenant name {name!r}: letters, digits, '_', '.', '-', at most 64")
            try:
                tenant = msgspec.convert({**table, "name": name}, Tenant)
            except msgspec.ValidationError as exc:
                raise TenantsError(f"{path}: tenants.{name}: {exc}") from None
            if not tenant.hashes():
                raise TenantsError(f"{path}: tenants.{name}: key_sha256 (or keys_sha256) is required")
            if (tenant.webhook_url is None) != (tenant.webhook_secret is None):
                raise TenantsError(f"{path}: tenants.{name}: webhook_url and webhook_secret go together")
            low, high = tenant.priority
            if low > high:
                raise TenantsError(f"{path}: tenants.{name}.priority: [{low}, {high}] is empty")
            for h in tenant.hashes():
                if h in owners:
                    raise TenantsError(f"{path}: tenants.{name}: a key of tenants.{owners[h]} too")
                owners[h] = name
            tenants[name] = tenant
        return cls(tenants, several=True)

    def who(self, token: bytes) -> str | None:
        """The tenant a bearer token names (None: no tenant has it)."""
        return self._by_hash.get(hashlib.sha256(token).hexdigest())

    def is_admin(self, name: str) -> bool:
        """Whether tenant `name` may read /metrics and change the shared LoRA adapters."""
        tenant = self.tenants.get(name)  # (gone, after a reload, while its request runs: not an admin)
        return not self.several or (tenant is not None and tenant.admin)

    def names(self) -> list[str]:
        return sorted(self.tenants)


class TenantBook:
    """The tenants now in force, read again from their file on SIGHUP (`reload`)."""

    def __init__(self, path: str | None, api_key: str | None) -> None:
        self.path = path
        if path is not None:
            self.current = Tenants.read(path)
        elif api_key:
            self.current = Tenants.single(api_key)
        else:
            self.current = Tenants.anyone()

    def reload(self) -> bool:
        """Read the file again; a file that cannot be used leaves the tenants as they were (and says why)."""
        if self.path is None:
            log.info("SIGHUP: no --api-keys-file to read again")
            return False
        try:
            tenants = Tenants.read(self.path)
        except TenantsError as exc:
            log.error("SIGHUP: the tenants stay as they were: %s", exc)
            return False
        before = set(self.current.tenants)
        self.current = tenants
        log.info(
            "SIGHUP: %d tenants (added: %s; removed: %s)",
            len(tenants.tenants),
            ", ".join(sorted(set(tenants.tenants) - before)) or "none",
            ", ".join(sorted(before - set(tenants.tenants))) or "none",
        )
        return True

    def tenant(self, name: str) -> Tenant:
        """A tenant's settings now (one removed since its request was admitted: no quotas)."""
        return self.current.tenants.get(name) or Tenant(name=name)
