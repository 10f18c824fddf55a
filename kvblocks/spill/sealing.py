"""Deployment secret -> keyed hashes and authenticated encryption for spill-tier records.

Everything a Redis reader could learn from is derived from the secret: keys use a keyed BLAKE2b,
so a guessed prompt cannot be confirmed by computing its key, and values are sealed with
AES-256-GCM bound to their Redis key and namespace, so a forged, altered or swapped value fails
to open. Processes that share the secret share the tier; with different secrets they never do.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MIN_SECRET_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
SECRET_ENV = "KVBLOCKS_REDIS_SECRET"


class SealError(ValueError):
    """A sealed value does not open with this secret for this key (forged, altered or foreign)."""


class Sealer:
    """Two independent keys derived from one secret with HKDF-SHA256: one hashes, one seals."""

    algorithm = "aes-256-gcm"

    def __init__(self, secret: bytes | str) -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(raw) < MIN_SECRET_BYTES:
            raise ValueError(f"the Redis secret must be at least {MIN_SECRET_BYTES} bytes, got {len(raw)}")
        self._hash_key = _derive(raw, b"kvblocks/redis/key-hash/v2")
        self._seal_key = _derive(raw, b"kvblocks/redis/record-seal/v2")
        self._aead = AESGCM(self._seal_key)

    def digest(self, data: bytes, size: int = 16) -> bytes:
        """Keyed BLAKE2b: unpredictable without the secret."""
        return hashlib.blake2b(data, digest_size=size, key=self._hash_key).digest()

    def seal(self, plaintext: bytes, bound_to: bytes) -> tuple[bytes, bytes]:
        """(nonce, ciphertext with tag); `bound_to` is authenticated, not stored."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce, self._aead.encrypt(nonce, plaintext, bound_to)

    def open_into(
        self,
        nonce: bytes,
        ciphertext: bytes | memoryview,
        bound_to: bytes,
        parts: Sequence[bytearray | memoryview],
    ) -> None:
        """Decrypt `ciphertext` into the writable buffers `parts`, in order, and authenticate it;
        their sizes must add up to the plaintext's. SealError if anything was changed.

        Decryption streams into `parts` before the tag is checked (no plaintext copy), so after a
        SealError they hold unauthenticated bytes: the caller must discard them.
        """
        sizes = [memoryview(part).nbytes for part in parts]
        if len(nonce) != NONCE_BYTES or len(ciphertext) != sum(sizes) + TAG_BYTES:
            raise SealError("malformed sealed value")
        sealed = memoryview(ciphertext)
        decryptor = Cipher(algorithms.AES(self._seal_key), modes.GCM(nonce)).decryptor()
        decryptor.authenticate_additional_data(bound_to)
        offset = 0
        for part, size in zip(parts, sizes):
            decryptor.update_into(sealed[offset : offset + size], part)
            offset += size
        try:
            decryptor.finalize_with_tag(bytes(sealed[offset:]))
        except InvalidTag as exc:
            raise SealError("sealed value failed authentication") from exc


def _derive(secret: bytes, label: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=label).derive(secret)


def read_secret(path: str | None = None) -> bytes | None:
    """The secret from a file (surrounding whitespace stripped), else $KVBLOCKS_REDIS_SECRET, else None."""
    if path is not None:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the Redis secret file {path}: {exc.strerror}") from exc
        if not secret:
            raise ValueError(f"the Redis secret file {path} is empty")
        return secret
    value = os.environ.get(SECRET_ENV, "").strip()
    return value.encode() if value else None
