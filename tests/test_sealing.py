"""Sealing: a secret derives a keyed hash and an AEAD; what it seals opens only with the same
secret, the same binding and untouched bytes."""

from __future__ import annotations

from itertools import pairwise

import pytest

from kvblocks.spill.sealing import SECRET_ENV, TAG_BYTES, Sealer, SealError, read_secret

SECRET = b"0123456789abcdef-secret"


def opened(sealer: Sealer, nonce: bytes, sealed: bytes, bound_to: bytes) -> bytes:
    out = bytearray(len(sealed) - TAG_BYTES)
    sealer.open_into(nonce, sealed, bound_to, [out])
    return bytes(out)


def test_sealed_bytes_open_only_with_the_same_secret_and_binding():
    nonce, sealed = Sealer(SECRET).seal(b"payload", b"key-1")
    assert opened(Sealer(SECRET), nonce, sealed, b"key-1") == b"payload"
    with pytest.raises(SealError):
        opened(Sealer(SECRET), nonce, sealed, b"key-2")
    with pytest.raises(SealError):
        opened(Sealer(b"another secret of 16+ bytes"), nonce, sealed, b"key-1")


@pytest.mark.parametrize("where", [0, 3, -1])
def test_any_changed_byte_fails_authentication(where):
    nonce, sealed = Sealer(SECRET).seal(b"some kv bytes", b"k")
    damaged = bytearray(sealed)
    damaged[where] ^= 0x01
    with pytest.raises(SealError):
        opened(Sealer(SECRET), nonce, bytes(damaged), b"k")
    with pytest.raises(SealError, match="malformed"):
        opened(Sealer(SECRET), nonce[:-1], sealed, b"k")


@pytest.mark.parametrize("cuts", [(), (0,), (1,), (5, 5), (1, 7, 12), (13,)])
def test_plaintext_streams_into_parts_split_anywhere(cuts):
    plaintext = bytes(range(13))
    nonce, sealed = Sealer(SECRET).seal(plaintext, b"k")
    bounds = [0, *cuts, len(plaintext)]
    parts = [bytearray(b - a) for a, b in pairwise(bounds)]
    Sealer(SECRET).open_into(nonce, sealed, b"k", parts)
    assert b"".join(parts) == plaintext


@pytest.mark.parametrize("sizes", [(12,), (14,), (6, 6), (13, 1), ()])
def test_parts_that_do_not_add_up_to_the_plaintext_are_malformed(sizes):
    nonce, sealed = Sealer(SECRET).seal(bytes(13), b"k")
    with pytest.raises(SealError, match="malformed"):
        Sealer(SECRET).open_into(nonce, sealed, b"k", [bytearray(n) for n in sizes])
    with pytest.raises(SealError, match="malformed"):
        Sealer(SECRET).open_into(nonce, sealed[: TAG_BYTES - 1], b"k", [])


def test_nonces_differ_so_equal_plaintexts_give_different_values():
    s = Sealer(SECRET)
    assert s.seal(b"same", b"k") != s.seal(b"same", b"k")


def test_keyed_digest_depends_on_the_secret():
    assert Sealer(SECRET).digest(b"x") == Sealer(SECRET).digest(b"x")
    assert Sealer(SECRET).digest(b"x") != Sealer(SECRET + b"!").digest(b"x")


def test_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Sealer(b"too short")


def test_secret_comes_from_a_file_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert read_secret() is None
    monkeypatch.setenv(SECRET_ENV, "  from-the-environment-1234 \n")
    assert read_secret() == b"from-the-environment-1234"
    path = tmp_path / "secret"
    path.write_bytes(b"from-a-file-0123456789\n")
    assert read_secret(str(path)) == b"from-a-file-0123456789"
    path.write_bytes(b"  \n")
    with pytest.raises(ValueError, match="is empty"):
        read_secret(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        read_secret(str(tmp_path / "missing"))
