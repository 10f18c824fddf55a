"""API keys bound to tenants: who is calling, and which part of the cache they may see.

A tenants file is JSON: `{"keys": [{"key": "...", "tenant": "acme"}, {"key": "...", "tenant":
"ops", "admin": true}]}`. An entry may also bound its tenant's share of the engine:
`"max_running"` (requests generating at once), `"max_waiting"` (requests queued) and `"weight"`
(its share of admissions against other tenants with waiting work; default 1). A tenant's requests live in namespaces of that tenant only; a client's
`cache_salt` refines them inside it. Admins also see every tenant in the inspection endpoints.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

KEYS_FILE_ENV = "KVBLOCKS_API_KEYS_FILE"
MIN_KEY_CHARS = 8
MAX_TENANT_CHARS = 128


@dataclass(slots=True, frozen=True)
class Principal:
    """The caller of one request: its tenant ("" = the default tenant) and whether it is an admin."""

    tenant: str
    admin: bool


@dataclass(slots=True, frozen=True)
class TenantLimits:
    """A tenant's bounds in the engine. None: only the server-wide bound applies."""

    max_running: int | None = None
    max_waiting: int | None = None
    weight: float = 1.0


LIMIT_FIELDS = ("max_running", "max_waiting", "weight")


# Who calls a server started without any key: one trusted user, the default tenant.
OPEN = Principal("", admin=True)


class ApiKeys:
    """Bearer keys -> principals. Lookups compare digests in constant time, key by key."""

    def __init__(self, entries: dict[str, Principal]) -> None:
        if not entries:
            raise ValueError("no API keys given")
        self._entries = [(_digest(key), principal) for key, principal in entries.items()]
        self._limits: dict[str, TenantLimits] = {}

    def limits(self, tenant: str) -> TenantLimits:
        """The bounds the keys file sets for `tenant` (none set: no bounds of its own, weight 1)."""
        return self._limits.get(tenant, TenantLimits())

    @classmethod
    def single_admin(cls, key: str) -> ApiKeys:
        """`--api-key KEY`: one admin key in the default tenant."""
        _check_key(key, "--api-key")
        return cls({key: Principal("", admin=True)})

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
            if not isinstance(entry, dict) or set(entry) - {"key", "tenant", "admin", *LIMIT_FIELDS}:
                raise ValueError(
                    f'{where} must be an object with "key", "tenant" and optional "admin", '
                    + ", ".join(f'"{f}"' for f in LIMIT_FIELDS)
                )
            key, tenant, admin = entry.get("key"), entry.get("tenant"), entry.get("admin", False)
            _check_key(key, where)
            if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
                raise ValueError(f'{where}: "tenant" must be a string of 1 to {MAX_TENANT_CHARS} characters')
            if not isinstance(admin, bool):
                raise ValueError(f'{where}: "admin" must be true or false')
            if key in entries:
                raise ValueError(f"{where}: this key is listed twice")
            entries[key] = Principal(tenant, admin)
            limits[tenant] = _merge_limits(limits.get(tenant), _read_limits(entry, where), tenant, where)
        keys = cls(entries)
        keys._limits = {t: lim for t, lim in limits.items() if lim is not None}
        return keys

    def principal(self, authorization: str) -> Principal | None:
        """The principal of an `Authorization` header value, or None if no key matches."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        digest = _digest(token.strip())
        found = None
        for known, principal in self._entries:  # no early exit: timing says nothing of the key
            if hmac.compare_digest(known, digest):
                found = principal
        return found


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
    if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise ValueError(
            f"{where}: an API key must be a string of at least {MIN_KEY_CHARS} characters without spaces"
        )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
