"""Spill-tier chunks: content-addressed keys and the verified msgpack record of one chunk's KV.

A chunk is `chunk_tokens` consecutive tokens counted from the start of the sequence. Its key is
the namespace plus a chained hash of every token id up to the chunk's end, so one key names one
exact prefix, and any process computing the same prefix with the same model finds it.

Two record forms, both msgpack maps with `"v": 2`:
- plain (no secret: Redis is trusted): namespace, Redis key, token ids, dtype, shape, xxh3 of the
  payload, raw KV. It catches damage and misplaced values, not a writer who recomputes the checksum.
- sealed (a deployment secret): dtype, shape, nonce and an AES-256-GCM ciphertext of token ids +
  raw KV, authenticated together with the Redis key and the namespace. Keys are keyed hashes.
Either way restored KV must be finite; anything else is a VerificationError, which is a miss.
A record's size follows from its layout (`record_size_bounds`), so a value of any other size is
refused before it is parsed, and whatever the parser raises on a damaged value is a VerificationError
too: no value in Redis can make a decode fail any other way.

A recurrent-state snapshot taken where a chunk ends is a third record (`encode_state_record`) under
that chunk's key plus `:state`, framed, checked and sealed the same way, with `"kind": "state"` and
the state layout in place of dtype and shape.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgpack
import numpy as np
import torch
import xxhash

from kvblocks.cache.layout import KVLayout, StateLayout
from kvblocks.spill.sealing import NONCE_BYTES, TAG_BYTES, Sealer
from kvblocks.spill.tier import Value

FORMAT_VERSION = 2


def chain_hashes(
    namespace_key: str, ids: np.ndarray, chunk_tokens: int, sealer: Sealer | None = None
) -> list[str]:
    """Hex hash of each complete chunk of `ids`; hash i covers ids[: (i + 1) * chunk_tokens].

    With a sealer the hash is keyed, so nobody without the secret can compute the key of a prompt.
    """
    digest = (
        (lambda data: hashlib.blake2b(data, digest_size=16).digest()) if sealer is None else sealer.digest
    )
    h = digest(namespace_key.encode())
    out = []
    data = np.ascontiguousarray(ids, dtype="<i4")
    for end in range(chunk_tokens, len(data) + 1, chunk_tokens):
        h = digest(h + data[end - chunk_tokens : end].tobytes())
        out.append(h.hex())
    return out


class VerificationError(ValueError):
    """A stored value is not a valid record for the expected key, namespace, tokens and layout."""


# What msgpack raises on bytes that are not a well-formed, bounded record: BufferFull, OutOfData,
# FormatError and StackError are UnpackExceptions; bad UTF-8 and truncation are ValueErrors, an
# unhashable map key a TypeError.
MSGPACK_FAILURES = (msgpack.UnpackException, ValueError, TypeError)


def _payload(kv: list[torch.Tensor | None]) -> bytes:
    return b"".join(
        t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in kv if t is not None
    )


def encode_record(
    namespace_key: str,
    tokens: np.ndarray,
    layout: KVLayout,
    kv: list[torch.Tensor | None],
    *,
    key: str = "",
    sealer: Sealer | None = None,
) -> bytes:
    """`kv[l]` is `[n, 2, H, D]` on any device; stored as raw little-endian bytes, layer after layer."""
    header = {"v": FORMAT_VERSION, "dtype": layout.dtype_name, "shape": layout.shape(len(tokens))}
    return _frame(header, namespace_key, tokens, _payload(kv), key, sealer)


def _frame(
    header: dict[str, Any],
    namespace_key: str,
    tokens: np.ndarray,
    payload: bytes,
    key: str,
    sealer: Sealer | None,
) -> bytes:
    """A record: `header` plus either the sealed tokens + payload or the plain fields."""
    token_bytes = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    if sealer is not None:
        nonce, sealed = sealer.seal(token_bytes + payload, _bound_to(key, namespace_key, header))
        framed: bytes = msgpack.packb(
            header | {"alg": sealer.algorithm, "nonce": nonce, "ct": sealed}, use_bin_type=True
        )
        return framed
    fields: dict[str, Any] = {
        "ns": namespace_key,
        "key": key,
        "tokens": token_bytes,
        "sum": xxhash.xxh3_64_intdigest(payload),
    }
    framed = msgpack.packb(header | fields | {"kv": payload}, use_bin_type=True)
    return framed


def record_size_bounds(
    namespace_key: str, n: int, layout: KVLayout, *, key: str = "", sealer: Sealer | None = None
) -> tuple[int, int]:
    """Smallest and largest size of a valid record of `n` tokens (`encode_record`); equal when sealed,
    8 bytes apart when plain (msgpack writes the checksum in 1 to 9 bytes)."""
    header = {"v": FORMAT_VERSION, "dtype": layout.dtype_name, "shape": layout.shape(n)}
    return _frame_size_bounds(header, namespace_key, n, n * layout.token_bytes(), key, sealer)


def state_record_size_bounds(
    namespace_key: str, n: int, state: StateLayout, *, key: str = "", sealer: Sealer | None = None
) -> tuple[int, int]:
    """Like `record_size_bounds`, for the state record after a chunk of `n` tokens."""
    header = {"v": FORMAT_VERSION, "kind": "state", "layout": state.describe()}
    return _frame_size_bounds(header, namespace_key, n, state.nbytes, key, sealer)


def _frame_size_bounds(
    header: dict[str, Any], namespace_key: str, n: int, payload_bytes: int, key: str, sealer: Sealer | None
) -> tuple[int, int]:
    """What `_frame` writes, measured on an empty last bin and corrected for the real one."""
    if sealer is not None:
        last = 4 * n + payload_bytes + TAG_BYTES
        fields: dict[str, Any] = {"alg": sealer.algorithm, "nonce": bytes(NONCE_BYTES), "ct": b""}
        spread = 0
    else:
        last = payload_bytes
        fields = {"ns": namespace_key, "key": key, "tokens": bytes(4 * n), "sum": 0, "kv": b""}
        spread = 8
    low = len(msgpack.packb(header | fields, use_bin_type=True)) - 2 + len(_bin_header(last)) + last
    return low, low + spread


def encode_state_record(
    namespace_key: str,
    tokens: np.ndarray,
    state: StateLayout,
    blob: torch.Tensor,
    *,
    key: str = "",
    sealer: Sealer | None = None,
) -> bytes:
    """A recurrent-state snapshot (`hf.capture_state`) taken after the chunk `tokens` ends; framed,
    checked and sealed exactly like a KV chunk, with the state's layout in place of dtype and shape."""
    header = {"v": FORMAT_VERSION, "kind": "state", "layout": state.describe()}
    return _frame(header, namespace_key, tokens, blob.detach().cpu().numpy().tobytes(), key, sealer)


def decode_state_record(
    raw: Value,
    namespace_key: str,
    tokens: np.ndarray,
    state: StateLayout,
    *,
    key: str = "",
    sealer: Sealer | None = None,
) -> torch.Tensor:
    """Verify a state record; the snapshot as a fresh `[nbytes]` uint8 host tensor. Anything that
    does not match (see `decode_record_into`) or holds a non-finite float raises VerificationError."""
    header = {"v": FORMAT_VERSION, "kind": "state", "layout": state.describe()}
    blob = torch.empty(state.nbytes, dtype=torch.uint8)
    _open_into(raw, header, namespace_key, tokens, [blob.numpy()], key, sealer)
    if not all(all_finite(t) for t in state.views(blob) if t.is_floating_point()):
        raise VerificationError("state holds non-finite numbers")
    return blob


def decode_record(
    raw: Value,
    namespace_key: str,
    tokens: np.ndarray,
    layout: KVLayout,
    device: torch.device | str,
    *,
    key: str = "",
    sealer: Sealer | None = None,
) -> list[torch.Tensor | None]:
    """Verify and unpack a record into fresh per-layer `[n, 2, H, D]` tensors on `device`."""
    out = layout.empty(len(tokens))
    decode_record_into(raw, namespace_key, tokens, layout, out, key=key, sealer=sealer)
    return [None if t is None else t.to(device) for t in out]


def decode_record_into(
    raw: Value,
    namespace_key: str,
    tokens: np.ndarray,
    layout: KVLayout,
    out: list[torch.Tensor | None],
    *,
    key: str = "",
    sealer: Sealer | None = None,
) -> None:
    """Verify a record and write its KV into `out`: contiguous host `[n, 2, H, D]` per layer, as
    `layout.empty(n)` or row slices of it.

    Anything that does not match exactly (version, form, key, namespace, token ids, dtype, shape,
    length, checksum or seal) or holds a non-finite number raises VerificationError: the caller
    treats it as a miss, never as data. `out` may have been written by then; it must be discarded.
    """
    n = len(tokens)
    header = {"v": FORMAT_VERSION, "dtype": layout.dtype_name, "shape": layout.shape(n)}
    layers = [t for t in out if t is not None]
    assert all(t.dtype == layout.dtype and t.is_contiguous() for t in layers)
    assert [tuple(t.shape) for t in layers] == [(n, 2, h, d) for h, d in layout.shapes if h]
    targets = [t.view(-1).view(torch.uint8).numpy() for t in layers]  # writable bytes of each layer
    _open_into(raw, header, namespace_key, tokens, targets, key, sealer)
    if not all(all_finite(t) for t in layers):  # a checksum or a seal says who wrote it, not that it is sane
        raise VerificationError("payload holds non-finite numbers")


def _open_into(
    raw: Value,
    header: dict[str, Any],
    namespace_key: str,
    tokens: np.ndarray,
    targets: list[np.ndarray],
    key: str,
    sealer: Sealer | None,
) -> None:
    """Check a record against `header`, its key, namespace and tokens, and copy (or decrypt) its
    payload into `targets` (writable byte arrays, in order). Raises VerificationError."""
    payload_bytes = sum(t.nbytes for t in targets)
    expected_tokens = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    low, high = _frame_size_bounds(header, namespace_key, len(tokens), payload_bytes, key, sealer)
    if not low <= len(raw) <= high:  # checked first: nothing of a value of the wrong size is parsed
        raise VerificationError(f"size mismatch: {len(raw)} bytes, a record has {low} to {high}")
    rec = _split_record(
        raw, payload_bytes if sealer is None else len(expected_tokens) + payload_bytes + TAG_BYTES
    )
    if rec is None:  # not shaped as expected: the full parse names what is wrong
        try:
            rec = msgpack.unpackb(raw, raw=False)
        except MSGPACK_FAILURES as exc:
            raise VerificationError(f"not a msgpack record: {exc}") from exc
    if not isinstance(rec, dict):
        raise VerificationError("record is not a map")
    _check(("version", rec.get("v") == header["v"]))
    _check(("form", ("ct" in rec) == (sealer is not None)))
    _check(*((name, rec.get(name) == value) for name, value in header.items() if name != "v"))
    if sealer is not None:
        _check(("algorithm", rec.get("alg") == sealer.algorithm))
        nonce, sealed = rec.get("nonce"), rec.get("ct")
        if not isinstance(nonce, bytes) or not isinstance(sealed, bytes | memoryview):
            raise VerificationError("sealed record is malformed")
        token_bytes = bytearray(len(expected_tokens))
        try:
            sealer.open_into(
                nonce,
                sealed,
                _bound_to(key, namespace_key, header),
                [token_bytes, *(t.data for t in targets)],
            )
        except ValueError as exc:  # a SealError, or cryptography refusing a buffer
            raise VerificationError(str(exc)) from exc
        _check(("tokens", token_bytes == expected_tokens))
        return
    _check(
        ("namespace", rec.get("ns") == namespace_key),
        ("key", rec.get("key") == key),
        ("tokens", rec.get("tokens") == expected_tokens),
    )
    payload = rec.get("kv")
    if not isinstance(payload, bytes | memoryview) or len(payload) != payload_bytes:
        raise VerificationError("payload length mismatch")
    if rec.get("sum") != xxhash.xxh3_64_intdigest(payload):
        raise VerificationError("checksum mismatch")
    source, offset = memoryview(payload), 0
    for target in targets:
        target[:] = source[offset : offset + target.nbytes]
        offset += target.nbytes


def _split_record(raw: Value, payload_bytes: int) -> dict[str, Any] | None:
    """The record's fields with its last one, the payload, as a view of `raw` (no copy), when `raw`
    is shaped as `encode_record` writes it: a map whose last value is a bin of `payload_bytes`.
    None otherwise; `msgpack.unpackb` of the whole value then reports what is wrong."""
    bin_header = _bin_header(payload_bytes)
    cut = len(raw) - payload_bytes - len(bin_header)
    if cut <= 0 or raw[cut : cut + len(bin_header)] != bin_header:
        return None
    head = msgpack.Unpacker(raw=False, max_buffer_size=max(cut, 1))
    try:
        head.feed(memoryview(raw)[:cut])  # copies the small header only
        fields = {head.unpack(): head.unpack() for _ in range(head.read_map_header() - 1)}
        last = head.unpack()
    except MSGPACK_FAILURES:
        return None
    if head.tell() != cut or not isinstance(last, str) or last in fields:
        return None
    fields[last] = memoryview(raw)[cut + len(bin_header) :]
    return fields


def _bin_header(size: int) -> bytes:
    """msgpack's header of a bin of `size` bytes (bin 8, 16 or 32)."""
    if size < 1 << 8:
        return bytes((0xC4, size))
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or ±inf in `t`: its min and max are finite (NaN propagates through both).

    One pass and no temporaries, where `torch.isfinite(t).all()` builds masks as large as `t`.
    """
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t)
    return math.isfinite(low.item()) and math.isfinite(high.item())


def _check(*checks: tuple[str, bool]) -> None:
    for what, ok in checks:
        if not ok:
            raise VerificationError(f"{what} mismatch")


def _bound_to(key: str, namespace_key: str, header: dict[str, Any]) -> bytes:
    """What a sealed value is authenticated against besides its content: where it lives and what for
    (for a KV chunk: version, dtype and shape; for a state snapshot: version, kind and layout)."""
    bound: bytes = msgpack.packb([key, namespace_key, *header.values()])
    return bound


class ChunkCodec(Protocol):
    """How a spill tier names, frames and verifies chunks in Redis.

    `NativeCodec` is kvblocks' own format; `kvblocks.adapters.lmcache.LMCacheCodec` reads and
    writes LMCache's. `decode_into` writes a chunk's KV into the caller's host tensors (rows of a
    whole fetched run, so chunks are never joined afterwards) and raises VerificationError for
    anything it cannot vouch for, after which those tensors must be discarded. `key` is the Redis
    key the value was read from (or is written to).
    """

    # Whether a value that fails verification may be deleted: only when the format's keys belong
    # to kvblocks, never when other programs may read the same key with other expectations.
    delete_invalid: ClassVar[bool]

    @property
    def authenticated(self) -> bool:
        """Whether values are authenticated (a Redis writer cannot forge them)."""
        ...

    def bind(self, layout: KVLayout, namespace_key: str) -> None: ...

    def chunk_hashes(self, namespace_key: str, ids: np.ndarray, chunk_tokens: int) -> list[str]: ...

    def key(self, namespace_key: str, chunk_hash: str) -> str: ...

    def size_bounds(self, key: str, namespace_key: str, n: int, layout: KVLayout) -> tuple[int, int]:
        """Smallest and largest size of a valid value of `n` tokens: the tier reads nothing else."""
        ...

    def encode(
        self,
        key: str,
        namespace_key: str,
        tokens: np.ndarray,
        layout: KVLayout,
        kv: list[torch.Tensor | None],
    ) -> bytes: ...

    def decode_into(
        self,
        raw: Value,
        key: str,
        namespace_key: str,
        tokens: np.ndarray,
        layout: KVLayout,
        out: list[torch.Tensor | None],
    ) -> None: ...


@runtime_checkable
class StateCodec(ChunkCodec, Protocol):
    """A codec that also frames recurrent-state snapshots (one without these spills KV only)."""

    def state_key(self, namespace_key: str, chunk_hash: str) -> str: ...

    def state_size_bounds(
        self, key: str, namespace_key: str, n: int, state: StateLayout
    ) -> tuple[int, int]: ...

    def encode_state(
        self, key: str, namespace_key: str, tokens: np.ndarray, state: StateLayout, blob: torch.Tensor
    ) -> bytes: ...

    def decode_state(
        self, raw: Value, key: str, namespace_key: str, tokens: np.ndarray, state: StateLayout
    ) -> torch.Tensor: ...


@dataclass(slots=True, frozen=True)
class NativeCodec:
    """kvblocks' own format: `prefix:v2:namespace:chain-hash` keys and verified msgpack records;
    with a secret, `prefix:v2s:tag:keyed-chain-hash` keys and sealed records (see the module doc)."""

    key_prefix: str = "kvblocks"
    sealer: Sealer | None = field(default=None, repr=False)
    delete_invalid: ClassVar[bool] = True

    @property
    def authenticated(self) -> bool:
        return self.sealer is not None

    def bind(self, layout: KVLayout, namespace_key: str) -> None:
        """Every layout is supported."""

    def chunk_hashes(self, namespace_key: str, ids: np.ndarray, chunk_tokens: int) -> list[str]:
        return chain_hashes(namespace_key, ids, chunk_tokens, self.sealer)

    def key(self, namespace_key: str, chunk_hash: str) -> str:
        if self.sealer is None:
            return f"{self.key_prefix}:v{FORMAT_VERSION}:{namespace_key}:{chunk_hash}"
        # The namespace appears only as a keyed tag: a salt cannot be guessed offline from it.
        tag = self.sealer.digest(b"namespace\0" + namespace_key.encode(), size=8).hex()
        return f"{self.key_prefix}:v{FORMAT_VERSION}s:{tag}:{chunk_hash}"

    def size_bounds(self, key: str, namespace_key: str, n: int, layout: KVLayout) -> tuple[int, int]:
        return record_size_bounds(namespace_key, n, layout, key=key, sealer=self.sealer)

    def encode(
        self,
        key: str,
        namespace_key: str,
        tokens: np.ndarray,
        layout: KVLayout,
        kv: list[torch.Tensor | None],
    ) -> bytes:
        return encode_record(namespace_key, tokens, layout, kv, key=key, sealer=self.sealer)

    def decode_into(
        self,
        raw: Value,
        key: str,
        namespace_key: str,
        tokens: np.ndarray,
        layout: KVLayout,
        out: list[torch.Tensor | None],
    ) -> None:
        decode_record_into(raw, namespace_key, tokens, layout, out, key=key, sealer=self.sealer)

    # recurrent-state snapshots (a codec without these methods spills KV chunks only)

    def state_key(self, namespace_key: str, chunk_hash: str) -> str:
        return self.key(namespace_key, chunk_hash) + ":state"

    def state_size_bounds(self, key: str, namespace_key: str, n: int, state: StateLayout) -> tuple[int, int]:
        return state_record_size_bounds(namespace_key, n, state, key=key, sealer=self.sealer)

    def encode_state(
        self, key: str, namespace_key: str, tokens: np.ndarray, state: StateLayout, blob: torch.Tensor
    ) -> bytes:
        return encode_state_record(namespace_key, tokens, state, blob, key=key, sealer=self.sealer)

    def decode_state(
        self, raw: Value, key: str, namespace_key: str, tokens: np.ndarray, state: StateLayout
    ) -> torch.Tensor:
        return decode_state_record(raw, namespace_key, tokens, state, key=key, sealer=self.sealer)
