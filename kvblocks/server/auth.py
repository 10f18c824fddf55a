"""API keys bound to tenants: who is calling, and which part of the cache they may see.

A tenants file is JSON: `{"keys": [{"key": "...", "tenant": "acme"}, {"key": "...", "tenant":
"ops", "admin": true}, {"key": "...", "tenant": "lb", "role": "router"}]}`. A key's role is "tenant"
(the default), "router" (also reads the engine's load and metrics, as routers and Prometheus do,
but nothing of any tenant's cache) or "admin" (sees everything; `"admin": true` says the same). An entry may also bound its tenant's share of the engine:
`"max_running"` (requests generating at once), `"max_waiting"` (requests queued) and `"weight"`
(its share of admissions against other tenants with waiting work; default 1). A tenant's requests
live in namespaces of that tenant only; a client's `cache_salt` refines them inside it. Admins also
see every tenant in the inspection endpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvblocks.engine.admission import TenantLimits

KEYS_FILE_ENV = "KVBLOCKS_API_KEYS_FILE"
MIN_KEY_CHARS = 8
MAX_TENANT_CHARS = 128


ROLES = ("tenant", "router", "admin")


@dataclass(slots=True, frozen=True)
class Principal:
    """The caller of one request: its tenant ("" = the default tenant) and its role (see ROLES)."""

    tenant: str
    role: str = "tenant"

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def sees_engine(self) -> bool:
        """May read what every tenant's traffic does to the engine (load, server info, metrics)."""
        return self.role in ("router", "admin")


LIMIT_FIELDS = ("max_running", "max_waiting", "weight")


# Who calls a server started without any key: one trusted user, the default tenant.
OPEN = Principal("", "admin")


class ApiKeys:
    """Bearer keys -> principals, found by the SHA-256 digest of the key in a dict.

    A dict lookup takes the same time for any number of keys, and what its timing could leak is
    about the digest of the presented key, which says nothing useful about any valid key: finding
    a key through it would need SHA-256 preimages. No linear scan, no per-key comparison.
    """

    def __init__(self, entries: dict[str, Principal]) -> None:
        if not entries:
            raise ValueError("no API keys given")
        self._by_digest = {_digest(key): principal for key, principal in entries.items()}
        self._limits: dict[str, TenantLimits] = {}

    def limits(self, tenant: str) -> TenantLimits:
        """The bounds the keys file sets for `tenant` (none set: no bounds of its own, weight 1)."""
        return self._limits.get(tenant, TenantLimits())

    def weights(self) -> dict[str, float]:
        """Every tenant some key names, with its weight."""
        return {p.tenant: self.limits(p.tenant).weight for p in self._by_digest.values()}

    @classmethod
    def single_admin(cls, key: str) -> ApiKeys:
        """`--api-key KEY`: one admin key in the default tenant."""
        _check_key(key, "--api-key")
        return cls({key: Principal("", "admin")})

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        """Read a tenants file; ValueError with the reason for anything malformed."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read the API keys file {path}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"the API keys file {path} is not valid JSON: {exc}") from exc
        keys = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(keys, list) or not keys:
            raise ValueError(f'the API keys file {path} needs a non-empty "keys" list')
        entries: dict[str, Principal] = {}
        limits: dict[str, TenantLimits | None] = {}
        for i, entry in enumerate(keys):
            where = f"{path}: keys[{i}]"
            if not isinstance(entry, dict) or set(entry) - {"key", "tenant", "admin", "role", *LIMIT_FIELDS}:
                raise ValueError(
                    f'{where} must be an object with "key", "tenant" and optional "role", "admin", '
                    + ", ".join(f'"{f}"' for f in LIMIT_FIELDS)
                )
            key, tenant = entry.get("key"), entry.get("tenant")
            _check_key(key, where)
            _check_tenant(tenant, where)
            if key in entries:
                raise ValueError(f"{where}: this key is listed twice")
            entries[key] = Principal(tenant, _read_role(entry, where))
            limits[tenant] = _merge_limits(limits.get(tenant), _read_limits(entry, where), tenant, where)
        keys = cls(entries)
        keys._limits = {t: lim for t, lim in limits.items() if lim is not None}
        return keys

    def principal(self, authorization: str) -> Principal | None:
        """The principal of an `Authorization` header value, or None if no key matches."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        return self._by_digest.get(_digest(token.strip()))


def permission_warning(path: str | Path) -> str | None:
    """A one-line warning when the keys file can be read by its group or by others, else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (
            f"kvblocks: warning: the API keys file {path} is readable by other users "
            f"(mode {stat.S_IMODE(mode):o}); run chmod 600 {path}"
        )
    return None


def _read_role(entry: dict, where: str) -> str:
    """ "role" ("tenant", "router", "admin"), or the older `"admin": true`; both given must agree."""
    admin, role = entry.get("admin", False), entry.get("role")
    if not isinstance(admin, bool):
        raise ValueError(f'{where}: "admin" must be true or false')
    if role is not None and role not in ROLES:
        raise ValueError(f'{where}: "role" must be one of ' + ", ".join(f'"{r}"' for r in ROLES))
    if admin and role not in (None, "admin"):
        raise ValueError(f'{where}: "admin": true contradicts "role": "{role}"')
    return "admin" if admin else role or "tenant"


def _check_tenant(tenant, where: str) -> None:
    """Tenant names become cache namespaces and log fields: printable text that encodes as UTF-8."""
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
        raise ValueError(f'{where}: "tenant" must be a string of 1 to {MAX_TENANT_CHARS} characters')
    if not tenant.isprintable() or not _utf8(tenant):
        raise ValueError(
            f'{where}: "tenant" must be printable text (no control characters or lone surrogates)'
        )


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _read_limits(entry: dict, where: str) -> TenantLimits | None:
    """The limit fields of one keys-file entry, checked; None when it sets none."""
    if not any(f in entry for f in LIMIT_FIELDS):
        return None
    counts = {}
    for name in ("max_running", "max_waiting"):
        value = entry.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f'{where}: "{name}" must be a whole number of at least 1')
        counts[name] = value
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= 1000:
        raise ValueError(f'{where}: "weight" must be a number above 0 and at most 1000')
    return TenantLimits(counts["max_running"], counts["max_waiting"], float(weight))


def _merge_limits(known: TenantLimits | None, new: TenantLimits | None, tenant: str, where: str):
    """Limits are the tenant's, whichever of its keys states them: two keys may not disagree."""
    if known is None or new is None or known == new:
        return known or new
    raise ValueError(f"{where}: tenant '{tenant}' has other limits on another key; state them once")


def _check_key(key, where: str) -> None:
    """Keys are printable ASCII: HTTP headers arrive as latin-1 bytes, so any other key could never match."""
    if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise ValueError(
            f"{where}: an API key must be a string of at least {MIN_KEY_CHARS} characters without spaces"
        )
    if not (key.isascii() and key.isprintable()):
        raise ValueError(
            f"{where}: an API key must be printable ASCII (a header cannot carry other characters)"
        )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
