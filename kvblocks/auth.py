"""API keys bound to tenants: who is calling, and which part of the cache they may see.

A tenants file is JSON: `{"keys": [{"key": "...", "tenant": "acme"}, {"key": "...", "tenant":
"ops", "admin": true}]}`. A tenant's requests live in namespaces of that tenant only; a client's
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


# Who calls a server started without any key: one trusted user, the default tenant.
OPEN = Principal("", admin=True)


class ApiKeys:
    """Bearer keys -> principals. Lookups compare digests in constant time, key by key."""

    def __init__(self, entries: dict[str, Principal]) -> None:
        if not entries:
            raise ValueError("no API keys given")
        self._entries = [(_digest(key), principal) for key, principal in entries.items()]

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
        for i, entry in enumerate(keys):
            where = f"{path}: keys[{i}]"
            if not isinstance(entry, dict) or set(entry) - {"key", "tenant", "admin"}:
                raise ValueError(f'{where} must be an object with "key", "tenant" and optional "admin"')
            key, tenant, admin = entry.get("key"), entry.get("tenant"), entry.get("admin", False)
            _check_key(key, where)
            if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS:
                raise ValueError(f'{where}: "tenant" must be a string of 1 to {MAX_TENANT_CHARS} characters')
            if not isinstance(admin, bool):
                raise ValueError(f'{where}: "admin" must be true or false')
            if key in entries:
                raise ValueError(f"{where}: this key is listed twice")
            entries[key] = Principal(tenant, admin)
        return cls(entries)

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


def _check_key(key, where: str) -> None:
    if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise ValueError(
            f"{where}: an API key must be a string of at least {MIN_KEY_CHARS} characters without spaces"
        )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
